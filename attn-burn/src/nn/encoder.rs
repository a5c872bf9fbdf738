//! [`LongNetEncoderLayer`] and [`LongNetEncoder`] as burn modules: pre-LN layers
//! `x + attn(norm1(x))`, then `x + linear2(norm3(relu(linear1(norm2(x)))))`, with
//! dropout in training on the attention branch, the feed-forward hidden activation and
//! the feed-forward branch, as `attn-multihead`'s encoder computes them, under its
//! parameter names. The `forward_on` forwards run on a ring rank's rows as the multihead
//! layer's do.

use std::path::Path;
use std::sync::Arc;

use attn_core::{AttnError, ReferenceBackend, Result};
use attn_multihead::{DropoutSite, EncoderConfig, Mode, NamedParams, layer_mode, load_file};
use burn::module::Module;
use burn_tensor::activation::relu;
use burn_tensor::{DType, Device, Tensor};

use super::{LayerNorm, Linear, MultiheadDilatedAttention, ParamSource, SiteDropout};
use crate::compute::Compute;
use crate::options::AttnOptions;

/// One pre-LN LongNet encoder layer.
#[derive(Module, Debug)]
pub struct LongNetEncoderLayer {
    pub norm1: LayerNorm,
    pub self_attn: MultiheadDilatedAttention,
    pub norm2: LayerNorm,
    pub linear1: Linear,
    pub norm3: LayerNorm,
    pub linear2: Linear,
    /// The attention branch before its residual add.
    pub dropout1: SiteDropout,
    /// The feed-forward hidden activation, after ReLU.
    pub dropout_ff: SiteDropout,
    /// The feed-forward branch before its residual add.
    pub dropout2: SiteDropout,
}

impl LongNetEncoderLayer {
    /// The layer `config` describes, its parameters under `prefix` in `source`.
    pub fn from_source(config: &EncoderConfig, source: &ParamSource, prefix: &str) -> Result<Self> {
        config.validate()?;
        let eps = config.layer_norm_eps;
        let norm = |name: &str| LayerNorm::from_source(source, &format!("{prefix}{name}."), eps);
        let self_attn =
            MultiheadDilatedAttention::from_source(config.self_attention(), source, &format!("{prefix}self_attn."))?;
        Ok(LongNetEncoderLayer {
            norm1: norm("norm1")?,
            self_attn,
            norm2: norm("norm2")?,
            linear1: Linear::from_source(source, &format!("{prefix}linear1."))?,
            norm3: norm("norm3")?,
            linear2: Linear::from_source(source, &format!("{prefix}linear2."))?,
            dropout1: SiteDropout::new(config.dropout, DropoutSite::AttentionResidual)?,
            dropout_ff: SiteDropout::new(config.dropout, DropoutSite::FeedForwardHidden)?,
            dropout2: SiteDropout::new(config.dropout, DropoutSite::FeedForwardResidual)?,
        })
    }

    /// Fresh parameters drawn by `attn-multihead`'s MAGNETO initialisation from `seed`
    /// (`config.gamma_init` for v, out and `linear2`): those its layer draws.
    pub fn magneto(config: &EncoderConfig, seed: u64, device: &Device, dtype: DType) -> Result<Self> {
        let layer = attn_multihead::LongNetEncoderLayer::<f32>::new(config.clone(), seed, Arc::new(ReferenceBackend))?;
        Self::from_source(config, &ParamSource::of(&layer, device, dtype), "")
    }

    /// Self-attention of `x` `[batch, seq, d_model]` with `masks`, then the feed-forward,
    /// in evaluation.
    pub fn forward(&self, x: Tensor<3>, masks: &AttnOptions) -> Result<Tensor<3>> {
        self.forward_mode(x, masks, Mode::Eval)
    }

    /// [`Self::forward`] in `mode`: `Mode::Train { seed }` drops what `attn-multihead`'s
    /// layer drops for that seed, where the layer trains.
    pub fn forward_mode(&self, x: Tensor<3>, masks: &AttnOptions, mode: Mode) -> Result<Tensor<3>> {
        self.forward_on(x, masks, mode, &Compute::Kernels)
    }

    /// [`Self::forward_mode`] with the attention computed where `compute` says: on a ring
    /// rank, `x` holds the rank's rows (see `MultiheadDilatedAttention::forward_on`).
    pub fn forward_on(&self, x: Tensor<3>, masks: &AttnOptions, mode: Mode, compute: &Compute) -> Result<Tensor<3>> {
        let h = self.norm1.forward(x.clone());
        let x = x + self.dropout1.forward_on(self.self_attn.forward_on(h, masks, mode, compute)?, mode, compute)?;
        let hidden = relu(self.linear1.forward(self.norm2.forward(x.clone())));
        let f = self.dropout_ff.forward_on(hidden, mode, compute)?;
        Ok(x + self.dropout2.forward_on(self.linear2.forward(self.norm3.forward(f)), mode, compute)?)
    }
}

/// A stack of encoder layers (`layers.{i}.*`).
#[derive(Module, Debug)]
pub struct LongNetEncoder {
    pub layers: Vec<LongNetEncoderLayer>,
}

impl LongNetEncoder {
    /// `num_layers` layers from `source` (`layers.{i}.*`).
    pub fn from_source(config: &EncoderConfig, num_layers: usize, source: &ParamSource) -> Result<Self> {
        if num_layers == 0 {
            return Err(AttnError::InvalidArgument("an encoder needs at least one layer".into()));
        }
        let layers = (0..num_layers)
            .map(|i| LongNetEncoderLayer::from_source(config, source, &format!("layers.{i}.")))
            .collect::<Result<Vec<_>>>()?;
        Ok(LongNetEncoder { layers })
    }

    /// The parameters of `attn-multihead`'s stack (`encoder`), on `device` in `dtype`.
    pub fn from_encoder(
        encoder: &attn_multihead::LongNetEncoder<f32>,
        config: &EncoderConfig,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let num_layers = encoder.params().iter().filter(|p| p.name.ends_with("norm1.weight")).count();
        Self::from_source(config, num_layers, &ParamSource::of(encoder, device, dtype))
    }

    /// Fresh parameters with the encoder-only MAGNETO gain `sqrt(log(2 * num_layers))`
    /// (in place of `config.gamma_init`), those `attn-multihead`'s `LongNetEncoder::new`
    /// draws for `seed`.
    pub fn magneto(
        config: &EncoderConfig,
        num_layers: usize,
        seed: u64,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let backend = Arc::new(ReferenceBackend);
        let encoder = attn_multihead::LongNetEncoder::<f32>::new(config.clone(), num_layers, seed, backend)?;
        Self::from_encoder(&encoder, config, device, dtype)
    }

    /// `num_layers` layers read from a safetensors state_dict (PyTorch names, every
    /// parameter present with its shape, no other tensor).
    pub fn load_file(
        config: &EncoderConfig,
        num_layers: usize,
        path: impl AsRef<Path>,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let backend = Arc::new(ReferenceBackend);
        let mut encoder = attn_multihead::LongNetEncoder::<f32>::new(config.clone(), num_layers, 0, backend)?;
        load_file(&mut encoder, path)?;
        Self::from_encoder(&encoder, config, device, dtype)
    }

    /// Every layer in turn, `masks` in each self-attention, in evaluation.
    pub fn forward(&self, x: Tensor<3>, masks: &AttnOptions) -> Result<Tensor<3>> {
        self.forward_mode(x, masks, Mode::Eval)
    }

    /// [`Self::forward`] in `mode`; layer `i` draws its dropout masks in
    /// `attn_multihead::layer_mode(mode, i)`, as `attn-multihead`'s stack does.
    pub fn forward_mode(&self, x: Tensor<3>, masks: &AttnOptions, mode: Mode) -> Result<Tensor<3>> {
        self.forward_on(x, masks, mode, &Compute::Kernels)
    }

    /// [`Self::forward_mode`] with the attention computed where `compute` says: on a ring
    /// rank, `x` holds the rank's rows (see `MultiheadDilatedAttention::forward_on`).
    pub fn forward_on(&self, x: Tensor<3>, masks: &AttnOptions, mode: Mode, compute: &Compute) -> Result<Tensor<3>> {
        let mut layers = self.layers.iter().enumerate();
        layers.try_fold(x, |x, (i, layer)| layer.forward_on(x, masks, layer_mode(mode, i), compute))
    }
}
