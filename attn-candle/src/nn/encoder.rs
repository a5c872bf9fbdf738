//! [`LongNetEncoderLayer`] and [`LongNetEncoder`] as candle-nn modules: pre-LN layers
//! `x + attn(norm1(x))`, then `x + linear2(norm3(relu(linear1(norm2(x)))))`, as
//! `attn-multihead`'s encoder computes them in eval mode, under its parameter names.

use attn_multihead::EncoderConfig;
use candle_core::{Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};

use super::{LayerNorm, MultiheadDilatedAttention};

/// One pre-LN LongNet encoder layer.
#[derive(Debug, Clone)]
pub struct LongNetEncoderLayer {
    norm1: LayerNorm,
    self_attn: MultiheadDilatedAttention,
    norm2: LayerNorm,
    linear1: Linear,
    norm3: LayerNorm,
    linear2: Linear,
}

impl LongNetEncoderLayer {
    pub fn new(config: &EncoderConfig, vb: VarBuilder<'_>) -> Result<Self> {
        config.validate().map_err(crate::to_candle)?;
        let (e, ff) = (config.d_model, config.dim_feedforward);
        let eps = config.layer_norm_eps;
        Ok(LongNetEncoderLayer {
            norm1: LayerNorm::new(e, eps, vb.pp("norm1"))?,
            self_attn: MultiheadDilatedAttention::new(config.attention(), vb.pp("self_attn"))?,
            norm2: LayerNorm::new(e, eps, vb.pp("norm2"))?,
            linear1: candle_nn::linear(e, ff, vb.pp("linear1"))?,
            norm3: LayerNorm::new(ff, eps, vb.pp("norm3"))?,
            linear2: candle_nn::linear(ff, e, vb.pp("linear2"))?,
        })
    }
}

impl Module for LongNetEncoderLayer {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + self.self_attn.forward(&self.norm1.forward(x)?)?)?;
        let f = self.linear1.forward(&self.norm2.forward(&x)?)?.relu()?;
        &x + self.linear2.forward(&self.norm3.forward(&f)?)?
    }
}

/// A stack of encoder layers (`layers.{i}.*`).
#[derive(Debug, Clone)]
pub struct LongNetEncoder {
    layers: Vec<LongNetEncoderLayer>,
}

impl LongNetEncoder {
    pub fn new(config: &EncoderConfig, num_layers: usize, vb: VarBuilder<'_>) -> Result<Self> {
        let layers = (0..num_layers)
            .map(|i| LongNetEncoderLayer::new(config, vb.pp(format!("layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(LongNetEncoder { layers })
    }
}

impl Module for LongNetEncoder {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.layers.iter().try_fold(x.clone(), |x, l| l.forward(&x))
    }
}
