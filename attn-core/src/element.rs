//! `Element`: the dtypes attention runs on (f32, f64, f16, bf16) and their conversions.

use half::{bf16, f16};

/// Runtime tag of an element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
}

impl DType {
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 => 8,
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
    /// Parse `f32`, `f64`, `f16`, `bf16`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(DType::F32),
            "f64" | "float64" => Some(DType::F64),
            "f16" | "float16" | "half" => Some(DType::F16),
            "bf16" | "bfloat16" => Some(DType::BF16),
            _ => None,
        }
    }
}

/// An element type of q, k, v and outputs. Accumulation is always f32 or wider.
pub trait Element: Copy + Send + Sync + Default + PartialEq + std::fmt::Debug + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    fn to_f64(self) -> f64;
    fn from_f64(x: f64) -> Self;
    /// The raw bit pattern, zero-extended (bf16 and f16: the 16 stored bits).
    fn to_bits(self) -> u64;
    /// `dst[i] = from_f32(mul * src[i])` for every `i` of the shorter slice, rounded as
    /// [`Element::from_f32`] rounds (overridden where a branch-free form vectorises).
    #[inline]
    fn from_f32_scaled(dst: &mut [Self], src: &[f32], mul: f32) {
        for (o, &x) in dst.iter_mut().zip(src) {
            *o = Self::from_f32(mul * x);
        }
    }
}

/// f32 to bf16, round to nearest even, NaN kept quiet: `half::bf16::from_f32` without
/// branches, so row conversions vectorise (checked against it bit for bit in the tests).
#[inline(always)]
pub fn bf16_from_f32_rne(x: f32) -> bf16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) as u16) | 0x0040;
    bf16::from_bits(if b & 0x7fff_ffff > 0x7f80_0000 { nan } else { rounded })
}

macro_rules! impl_element {
    ($t:ty, $d:expr, $to32:expr, $from32:expr, $to64:expr, $from64:expr, $bits:expr $(, from_f32_scaled: $scaled:expr)?) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn to_f32(self) -> f32 {
                $to32(self)
            }
            #[inline(always)]
            fn from_f32(x: f32) -> Self {
                $from32(x)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                $to64(self)
            }
            #[inline(always)]
            fn from_f64(x: f64) -> Self {
                $from64(x)
            }
            #[inline(always)]
            fn to_bits(self) -> u64 {
                $bits(self)
            }
            $(
                #[inline]
                fn from_f32_scaled(dst: &mut [Self], src: &[f32], mul: f32) {
                    $scaled(dst, src, mul)
                }
            )?
        }
    };
}

impl_element!(f32, DType::F32, |x| x, |x| x, |x: f32| x as f64, |x: f64| x as f32, |x: f32| u64::from(x.to_bits()));
impl_element!(f64, DType::F64, |x: f64| x as f32, |x: f32| x as f64, |x| x, |x| x, f64::to_bits);
impl_element!(f16, DType::F16, f16::to_f32, f16::from_f32, f16::to_f64, f16::from_f64, |x: f16| u64::from(x.to_bits()));
impl_element!(
    bf16,
    DType::BF16,
    bf16::to_f32,
    bf16::from_f32,
    bf16::to_f64,
    bf16::from_f64,
    |x: bf16| u64::from(x.to_bits()),
    from_f32_scaled: |dst: &mut [bf16], src: &[f32], mul: f32| {
        for (o, &x) in dst.iter_mut().zip(src) {
            *o = bf16_from_f32_rne(mul * x);
        }
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    /// The branch-free bf16 rounding equals `half`'s for every f32 bit class: a sweep of
    /// patterns (normals, subnormals, ties, overflow to infinity, infinities, NaNs).
    #[test]
    fn bf16_rounding_matches_half_bit_for_bit() {
        let mut bits: u32 = 0;
        let mut checked = 0u64;
        loop {
            for b in [bits, bits | 0x8000, bits | 0x7fff, bits ^ 0x1_0000] {
                let x = f32::from_bits(b);
                assert_eq!(bf16_from_f32_rne(x).to_bits(), bf16::from_f32(x).to_bits(), "{b:#010x}");
                checked += 1;
            }
            match bits.checked_add(0x0001_0123) {
                Some(n) => bits = n,
                None => break,
            }
        }
        assert!(checked > 60_000);
        let (src, mut dst) = ([1.0f32, -2.5, f32::NAN, 3.0e38, 1e-40], [bf16::ZERO; 5]);
        bf16::from_f32_scaled(&mut dst, &src, 2.0);
        for (d, s) in dst.iter().zip(src) {
            assert_eq!(d.to_bits(), bf16::from_f32(2.0 * s).to_bits());
        }
    }
}
