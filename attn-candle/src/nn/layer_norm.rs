//! [`LayerNorm`] over the last dimension, composed of candle tensor ops so that
//! gradients reach its input, weight and bias. candle-nn's `LayerNorm` with a bias
//! runs a fused op without a backward on contiguous input, which would cut every
//! pre-LN residual branch (and the norms' own parameters) out of training.

use candle_core::{D, DType, Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

/// `(x - mean) / sqrt(var + eps) * weight + bias`, variance without Bessel's correction.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// `weight` (init 1) and `bias` (init 0) of length `size` under `vb`.
    pub fn new(size: usize, eps: f64, vb: VarBuilder<'_>) -> Result<Self> {
        Ok(LayerNorm {
            weight: vb.get_with_hints(size, "weight", Init::Const(1.0))?,
            bias: vb.get_with_hints(size, "bias", Init::Const(0.0))?,
            eps,
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        // Half-precision inputs are normalised in f32, as candle-nn does.
        let xf = match dtype {
            DType::F16 | DType::BF16 => x.to_dtype(DType::F32)?,
            _ => x.clone(),
        };
        let centred = xf.broadcast_sub(&xf.mean_keepdim(D::Minus1)?)?;
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centred.broadcast_div(&(var + self.eps)?.sqrt()?)?.to_dtype(dtype)?;
        normed.broadcast_mul(&self.weight)?.broadcast_add(&self.bias)
    }
}
