//! `LayerFloat`: the element types a layer stores (f32 for speed, f64 for gradient
//! checks, bf16 and f16 for memory) and the wider float each accumulates products and
//! reductions in (`Accumulator`: f32 for the 2-byte types, the type itself otherwise).

use attn_core::Element;
use half::{bf16, f16};
use num_traits::Float;

mod sealed {
    /// Only f32 and f64 are accumulators: the types `gemm` multiplies natively.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// A float products and reductions accumulate in (f32 or f64), which `gemm` multiplies.
pub trait Accumulator:
    sealed::Sealed + Element + Float + std::iter::Sum + std::ops::AddAssign + std::ops::MulAssign
{
}

impl Accumulator for f32 {}
impl Accumulator for f64 {}

/// A float a multihead layer runs in: an attention [`Element`] that `num_traits` does
/// arithmetic on, with the [`Accumulator`] its products, sums and LayerNorm statistics
/// run in. Every stage stores its result in `Self`, rounded once from the accumulator
/// (PyTorch's rule for bf16 and f16).
pub trait LayerFloat: Element + Float + std::iter::Sum + std::ops::AddAssign + std::ops::MulAssign {
    /// The accumulator: f32 for bf16 and f16, the type itself for f32 and f64.
    type Acc: Accumulator;
    /// Safetensors dtype of this float.
    const SAFETENSORS_DTYPE: safetensors::Dtype;

    /// Convert from f64 (rounding for the narrower types).
    fn of(x: f64) -> Self {
        <Self as Element>::from_f64(x)
    }
    /// The value in the accumulator (exact).
    fn widen(self) -> Self::Acc;
    /// An accumulated value rounded to `Self` (identity where `Self` is the accumulator).
    fn narrow(acc: Self::Acc) -> Self;
    /// The slice as accumulator elements when `Self` is its own accumulator (f32, f64),
    /// so products run in place; `None` for the narrower types.
    fn as_acc(x: &[Self]) -> Option<&[Self::Acc]>;
    /// [`LayerFloat::as_acc`] for a mutable slice.
    fn as_acc_mut(x: &mut [Self]) -> Option<&mut [Self::Acc]>;
    /// Decode little-endian bytes of one element.
    fn from_le(bytes: &[u8]) -> Self;
    /// Append the little-endian bytes of `self`.
    fn push_le(self, out: &mut Vec<u8>);
}

/// `LayerFloat` for a type that is its own accumulator.
macro_rules! native {
    ($t:ty, $dtype:expr, $size:literal) => {
        impl LayerFloat for $t {
            type Acc = $t;
            const SAFETENSORS_DTYPE: safetensors::Dtype = $dtype;
            #[inline(always)]
            fn widen(self) -> $t {
                self
            }
            #[inline(always)]
            fn narrow(acc: $t) -> $t {
                acc
            }
            fn as_acc(x: &[$t]) -> Option<&[$t]> {
                Some(x)
            }
            fn as_acc_mut(x: &mut [$t]) -> Option<&mut [$t]> {
                Some(x)
            }
            fn from_le(bytes: &[u8]) -> Self {
                let mut b = [0u8; $size];
                b.copy_from_slice(&bytes[..$size]);
                <$t>::from_le_bytes(b)
            }
            fn push_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    };
}

native!(f32, safetensors::Dtype::F32, 4);
native!(f64, safetensors::Dtype::F64, 8);

/// `LayerFloat` for a 2-byte float accumulated in f32.
macro_rules! half_width {
    ($t:ty, $dtype:expr) => {
        impl LayerFloat for $t {
            type Acc = f32;
            const SAFETENSORS_DTYPE: safetensors::Dtype = $dtype;
            #[inline(always)]
            fn widen(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn narrow(acc: f32) -> Self {
                <$t as Element>::from_f32(acc)
            }
            fn as_acc(_: &[Self]) -> Option<&[f32]> {
                None
            }
            fn as_acc_mut(_: &mut [Self]) -> Option<&mut [f32]> {
                None
            }
            fn from_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes([bytes[0], bytes[1]])
            }
            fn push_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    };
}

half_width!(bf16, safetensors::Dtype::BF16);
half_width!(f16, safetensors::Dtype::F16);

#[cfg(test)]
mod tests {
    use super::*;

    /// Each type's bytes decode to itself and carry its safetensors dtype; the 2-byte
    /// types widen exactly and narrow by rounding to nearest.
    #[test]
    fn bytes_round_trip_and_half_types_round_to_nearest() {
        fn round_trip<F: LayerFloat>(x: f64) {
            let v = F::of(x);
            let mut b = Vec::new();
            v.push_le(&mut b);
            assert_eq!(b.len(), F::DTYPE.size());
            assert_eq!(F::from_le(&b), v, "{:?}", F::DTYPE);
        }
        for x in [1.0 / 3.0, -2.5e-3, 6.0e4] {
            round_trip::<f32>(x);
            round_trip::<f64>(x);
            round_trip::<bf16>(x);
            round_trip::<f16>(x);
        }
        let third = 1.0f32 / 3.0;
        assert_eq!(bf16::narrow(third), bf16::from_f32(third));
        assert_eq!(f16::narrow(third).widen(), f16::from_f32(third).to_f32());
        assert!(bf16::as_acc(&[bf16::ONE]).is_none() && f32::as_acc(&[1.0]).is_some());
    }
}
