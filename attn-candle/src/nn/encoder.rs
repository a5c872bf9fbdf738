//! [`LongNetEncoderLayer`] and [`LongNetEncoder`] as candle-nn modules: pre-LN layers
//! `x + drop(attn(norm1(x)))`, then `x + drop(linear2(norm3(drop(relu(linear1(norm2(x)))))))`,
//! as `attn-multihead`'s encoder computes them (dropout only in training, with its
//! masks), under its parameter names.

use std::sync::Arc;

use attn_multihead::{DropoutSite, EncoderConfig, MagnetoGains, Mode, layer_mode};
use candle_core::{Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};

use super::dropout::dropout;
use super::multihead::magneto_linear;
use super::{LayerCall, LayerNorm, MultiheadDilatedAttention};
use crate::host::AnyAttention;

/// One pre-LN LongNet encoder layer.
#[derive(Debug, Clone)]
pub struct LongNetEncoderLayer {
    norm1: LayerNorm,
    self_attn: MultiheadDilatedAttention,
    norm2: LayerNorm,
    linear1: Linear,
    norm3: LayerNorm,
    linear2: Linear,
    dropout: f64,
}

impl LongNetEncoderLayer {
    /// The layer `config` describes; fresh weights are drawn with MAGNETO gains
    /// (`config.gamma_init` for v, out and `linear2`).
    pub fn new(config: &EncoderConfig, vb: VarBuilder<'_>) -> Result<Self> {
        config.validate().map_err(crate::to_candle)?;
        let (e, ff) = (config.d_model, config.dim_feedforward);
        let eps = config.layer_norm_eps;
        Ok(LongNetEncoderLayer {
            norm1: LayerNorm::new(e, eps, vb.pp("norm1"))?,
            self_attn: MultiheadDilatedAttention::new(config.self_attention(), vb.pp("self_attn"))?,
            norm2: LayerNorm::new(e, eps, vb.pp("norm2"))?,
            linear1: magneto_linear(e, ff, 1.0, true, vb.pp("linear1"))?,
            norm3: LayerNorm::new(ff, eps, vb.pp("norm3"))?,
            linear2: magneto_linear(ff, e, config.gamma_init, true, vb.pp("linear2"))?,
            dropout: config.dropout,
        })
    }

    /// The same layer computing its attention through `backend` (host tensors only).
    pub fn with_backend(self, backend: Arc<dyn AnyAttention>) -> Self {
        LongNetEncoderLayer { self_attn: self.self_attn.with_backend(backend), ..self }
    }

    /// The layer in `mode`: `Mode::Train { seed }` applies the config's dropout with the
    /// masks `attn-multihead`'s layer draws for that seed.
    pub fn forward_with_mode(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let (_, seq, _) = x.dims3()?;
        let at = self.self_attn.query_positions(mode, seq)?;
        let drop = |t: &Tensor, site| dropout(t, mode, self.dropout, site, &at);
        let h = self.norm1.forward(x)?;
        let a = self.self_attn.forward_with(&h, &LayerCall::new().mode(mode))?;
        let x = (x + drop(&a, DropoutSite::AttentionResidual)?)?;
        let f = self.linear1.forward(&self.norm2.forward(&x)?)?.relu()?;
        let f = drop(&f, DropoutSite::FeedForwardHidden)?;
        let f = self.linear2.forward(&self.norm3.forward(&f)?)?;
        &x + drop(&f, DropoutSite::FeedForwardResidual)?
    }
}

impl Module for LongNetEncoderLayer {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with_mode(x, Mode::Eval)
    }
}

/// A stack of encoder layers (`layers.{i}.*`).
#[derive(Debug, Clone)]
pub struct LongNetEncoder {
    layers: Vec<LongNetEncoderLayer>,
}

impl LongNetEncoder {
    /// `num_layers` layers; fresh weights get the encoder-only MAGNETO gain
    /// `sqrt(log(2 * num_layers))` (in place of `config.gamma_init`), as
    /// `attn-multihead`'s `LongNetEncoder::new` draws them.
    pub fn new(config: &EncoderConfig, num_layers: usize, vb: VarBuilder<'_>) -> Result<Self> {
        let config = EncoderConfig { gamma_init: MagnetoGains::encoder_only(num_layers).encoder, ..config.clone() };
        let layers = (0..num_layers)
            .map(|i| LongNetEncoderLayer::new(&config, vb.pp(format!("layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(LongNetEncoder { layers })
    }

    /// The same stack computing its attention through `backend` (host tensors only).
    pub fn with_backend(self, backend: Arc<dyn AnyAttention>) -> Self {
        LongNetEncoder { layers: self.layers.into_iter().map(|l| l.with_backend(backend.clone())).collect() }
    }

    /// The stack in `mode`: layer `i` runs in `attn_multihead::layer_mode(mode, i)`, so
    /// its dropout masks are those of `attn-multihead`'s stack for the same seed.
    pub fn forward_with_mode(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        self.layers.iter().enumerate().try_fold(x.clone(), |x, (i, l)| l.forward_with_mode(&x, layer_mode(mode, i)))
    }
}

impl Module for LongNetEncoder {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with_mode(x, Mode::Eval)
    }
}
