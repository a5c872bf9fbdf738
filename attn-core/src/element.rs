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
}

macro_rules! impl_element {
    ($t:ty, $d:expr, $to32:expr, $from32:expr, $to64:expr, $from64:expr, $bits:expr) => {
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
        }
    };
}

impl_element!(f32, DType::F32, |x| x, |x| x, |x: f32| x as f64, |x: f64| x as f32, |x: f32| u64::from(x.to_bits()));
impl_element!(f64, DType::F64, |x: f64| x as f32, |x: f32| x as f64, |x| x, |x| x, f64::to_bits);
impl_element!(f16, DType::F16, f16::to_f32, f16::from_f32, f16::to_f64, f16::from_f64, |x: f16| u64::from(x.to_bits()));
impl_element!(bf16, DType::BF16, bf16::to_f32, bf16::from_f32, bf16::to_f64, bf16::from_f64, |x: bf16| u64::from(
    x.to_bits()
));
