//! `LayerFloat`: the element types a layer computes in (f32 for speed, f64 for gradient checks).

use attn_core::Element;
use num_traits::Float;

/// A float a multihead layer runs in: an attention [`Element`] that `gemm` multiplies
/// and `num_traits` does arithmetic on.
pub trait LayerFloat: Element + Float + std::iter::Sum + std::ops::AddAssign + std::ops::MulAssign {
    /// Convert from f64 (rounding for f32).
    fn of(x: f64) -> Self {
        <Self as Element>::from_f64(x)
    }
    /// Safetensors dtype of this float.
    const SAFETENSORS_DTYPE: safetensors::Dtype;
    /// Decode little-endian bytes of one element.
    fn from_le(bytes: &[u8]) -> Self;
    /// Append the little-endian bytes of `self`.
    fn push_le(self, out: &mut Vec<u8>);
}

impl LayerFloat for f32 {
    const SAFETENSORS_DTYPE: safetensors::Dtype = safetensors::Dtype::F32;
    fn from_le(bytes: &[u8]) -> Self {
        let mut b = [0u8; 4];
        b.copy_from_slice(&bytes[..4]);
        f32::from_le_bytes(b)
    }
    fn push_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl LayerFloat for f64 {
    const SAFETENSORS_DTYPE: safetensors::Dtype = safetensors::Dtype::F64;
    fn from_le(bytes: &[u8]) -> Self {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[..8]);
        f64::from_le_bytes(b)
    }
    fn push_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}
