//! The building blocks as burn modules under PyTorch's names and layouts: [`Linear`]
//! (`weight` `[out, in]`, optional `bias`) and [`LayerNorm`] over the last dimension
//! (`weight`, `bias`; variance without Bessel's correction, half-precision inputs
//! normalised in f32).

use attn_core::Result;
use burn::module::{Module, Param};
use burn_tensor::{DType, Tensor};

use super::ParamSource;

/// `x Wᵀ + b` over the last dimension.
#[derive(Module, Debug)]
pub struct Linear {
    pub weight: Param<Tensor<2>>,
    pub bias: Option<Param<Tensor<1>>>,
}

impl Linear {
    /// `{prefix}weight` and, where the source has it, `{prefix}bias`.
    pub fn from_source(source: &ParamSource, prefix: &str) -> Result<Self> {
        let bias_name = format!("{prefix}bias");
        let bias = if source.has(&bias_name) { Some(source.param(&bias_name)?) } else { None };
        Ok(Linear { weight: source.param(&format!("{prefix}weight"))?, bias })
    }

    /// `x` `[batch, seq, in]` to `[batch, seq, out]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, n, i] = x.dims();
        let w = self.weight.val();
        let out = w.dims()[0];
        let y = x.reshape([b * n, i]).matmul(w.transpose());
        let y = match &self.bias {
            Some(bias) => y + bias.val().unsqueeze_dim::<2>(0),
            None => y,
        };
        y.reshape([b, n, out])
    }
}

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dimension.
#[derive(Module, Debug)]
pub struct LayerNorm {
    pub weight: Param<Tensor<1>>,
    pub bias: Param<Tensor<1>>,
    pub eps: f64,
}

impl LayerNorm {
    /// `{prefix}weight` and `{prefix}bias`.
    pub fn from_source(source: &ParamSource, prefix: &str, eps: f64) -> Result<Self> {
        Ok(LayerNorm {
            weight: source.param(&format!("{prefix}weight"))?,
            bias: source.param(&format!("{prefix}bias"))?,
            eps,
        })
    }

    /// `x` `[batch, seq, dim]` normalised row by row.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let dtype = x.dtype();
        let xf = match dtype {
            DType::BF16 | DType::F16 => x.cast(DType::F32),
            _ => x,
        };
        let centred = xf.clone() - xf.mean_dim(2);
        let var = centred.clone().square().mean_dim(2);
        let normed = (centred / (var + self.eps).sqrt()).cast(dtype);
        normed * self.weight.val().unsqueeze::<3>() + self.bias.val().unsqueeze::<3>()
    }
}
