//! [`MultiheadDilatedAttention`] as a burn module: projections (`q_proj`, and `k_proj`,
//! `v_proj` with `num_kv_heads * head_dim` rows for grouped heads), the dilated
//! attention op, dropout of the merged output in training, sub-LayerNorm (`norm`) and
//! `out_proj`, per docs/definition.md and as `attn-multihead`'s layer computes them.
//! The `_on` forwards compute the op where a [`Compute`] says: on a ring rank each rank
//! passes its own rows and gets the single-device rows back (projections, LayerNorm and
//! dropout act row by row; dropout at the rows' global positions).

use std::path::Path;

use attn_core::{AttnError, Result};
use attn_multihead::{DropoutSite, Mode, MultiheadConfig, MultiheadWeights, load_file};
use burn::module::Module;
use burn_tensor::{DType, Device, Tensor};

use super::{LayerNorm, Linear, ParamSource, SiteDropout};
use crate::compute::Compute;
use crate::options::AttnOptions;
use crate::route::route;

/// The MAGNETO/LongNet multihead layer.
#[derive(Module, Debug)]
pub struct MultiheadDilatedAttention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    /// `config.dropout` on the merged attention output.
    pub dropout: SiteDropout,
    pub norm: Option<LayerNorm>,
    pub out_proj: Linear,
    #[module(skip)]
    config: MultiheadConfig,
}

impl MultiheadDilatedAttention {
    /// The layer `config` describes, its parameters under `prefix` in `source`.
    /// The qk-LN layout (`NormLayout::QkLn` with `layer_norm`) is not built here: a typed
    /// `Unsupported` error, never a layer of the other layout.
    pub fn from_source(config: MultiheadConfig, source: &ParamSource, prefix: &str) -> Result<Self> {
        config.validate()?;
        if config.qk_ln() {
            return Err(AttnError::Unsupported {
                backend: "attn-burn MultiheadDilatedAttention",
                feature: attn_core::Feature::Other("norm_layout qk_ln"),
            });
        }
        let linear = |name: &str| Linear::from_source(source, &format!("{prefix}{name}."));
        let norm = match config.layer_norm {
            true => Some(LayerNorm::from_source(source, &format!("{prefix}norm."), config.layer_norm_eps)?),
            false => None,
        };
        let layer = MultiheadDilatedAttention {
            q_proj: linear("q_proj")?,
            k_proj: linear("k_proj")?,
            v_proj: linear("v_proj")?,
            dropout: SiteDropout::new(config.dropout, DropoutSite::Attention)?,
            norm,
            out_proj: linear("out_proj")?,
            config,
        };
        Ok(layer)
    }

    /// The layer with `weights` (their layout checked against `config`), on `device` in
    /// `dtype`.
    pub fn from_weights(
        config: MultiheadConfig,
        weights: &MultiheadWeights<f32>,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        // `attn-multihead`'s layer checks the weights' layout against the config.
        let backend = std::sync::Arc::new(attn_core::ReferenceBackend);
        attn_multihead::MultiheadDilatedAttention::<f32>::from_weights(config.clone(), weights.clone(), backend)?;
        Self::from_source(config, &ParamSource::of(weights, device, dtype), "")
    }

    /// Fresh parameters drawn by `attn-multihead`'s MAGNETO initialisation from `seed`
    /// (xavier-normal, gain 1 for q and k, `gamma_init` for v and out; zero biases;
    /// LayerNorm weight 1, bias 0): the weights its layer draws for the same seed.
    pub fn magneto(config: MultiheadConfig, seed: u64, device: &Device, dtype: DType) -> Result<Self> {
        config.validate()?;
        let weights = MultiheadWeights::magneto(&config, seed);
        Self::from_weights(config, &weights, device, dtype)
    }

    /// Parameters read from a safetensors state_dict (PyTorch names; every parameter
    /// present with its shape, no other tensor).
    pub fn load_file(config: MultiheadConfig, path: impl AsRef<Path>, device: &Device, dtype: DType) -> Result<Self> {
        config.validate()?;
        let mut weights = MultiheadWeights::magneto(&config, 0);
        load_file(&mut weights, path)?;
        Self::from_weights(config, &weights, device, dtype)
    }

    pub fn config(&self) -> &MultiheadConfig {
        &self.config
    }

    /// Self-attention of `x` `[batch, seq, embed]` with `masks`' key padding, packed
    /// sequences and block mask (the layer's own patterns replace `masks.config`), in
    /// evaluation (no dropout).
    pub fn forward(&self, x: Tensor<3>, masks: &AttnOptions) -> Result<Tensor<3>> {
        self.forward_mode(x, masks, Mode::Eval)
    }

    /// [`Self::forward`] in `mode`: `Mode::Train { seed }` drops what `attn-multihead`'s
    /// layer drops for that seed, where the layer trains ([`SiteDropout`]).
    pub fn forward_mode(&self, x: Tensor<3>, masks: &AttnOptions, mode: Mode) -> Result<Tensor<3>> {
        self.forward_cross_mode([x.clone(), x.clone(), x], masks, mode)
    }

    /// Attention of `query` `[batch, seq, embed]` over `key` and `value` `[batch, kv_seq,
    /// embed]`, in evaluation.
    pub fn forward_cross(
        &self,
        query: Tensor<3>,
        key: Tensor<3>,
        value: Tensor<3>,
        masks: &AttnOptions,
    ) -> Result<Tensor<3>> {
        self.forward_cross_mode([query, key, value], masks, Mode::Eval)
    }

    /// [`Self::forward_cross`] in `mode`.
    pub fn forward_cross_mode(&self, qkv: [Tensor<3>; 3], masks: &AttnOptions, mode: Mode) -> Result<Tensor<3>> {
        self.forward_cross_on(qkv, masks, mode, &Compute::Kernels)
    }

    /// [`Self::forward_mode`] with the op computed where `compute` says. With a ring rank
    /// (`Compute::On` an `attn_ring::RingBackend`) `x` holds the rank's rows
    /// (`RingBackend::positions`), `masks`' key padding covers them, and the result is
    /// the single-device layer's rows; every rank runs `backward()`, and each parameter's
    /// gradient is the sum of the ranks' gradients.
    pub fn forward_on(&self, x: Tensor<3>, masks: &AttnOptions, mode: Mode, compute: &Compute) -> Result<Tensor<3>> {
        self.forward_cross_on([x.clone(), x.clone(), x], masks, mode, compute)
    }

    /// [`Self::forward_cross_mode`] with the op computed where `compute` says (on a ring,
    /// keys and values have the queries' rows).
    pub fn forward_cross_on(
        &self,
        qkv: [Tensor<3>; 3],
        masks: &AttnOptions,
        mode: Mode,
        compute: &Compute,
    ) -> Result<Tensor<3>> {
        let [query, key, value] = qkv;
        let [b, n, e] = query.dims();
        let [kb, m, ke] = key.dims();
        if e != self.config.embed_dim || ke != e || kb != b || value.dims() != key.dims() {
            return Err(AttnError::InvalidArgument(format!(
                "query {:?}, key {:?} and value {:?} do not fit a layer of embed_dim {}",
                query.dims(),
                key.dims(),
                value.dims(),
                self.config.embed_dim
            )));
        }
        let (h, kvh, d) = (self.config.num_heads, self.config.num_kv_heads, self.config.head_dim());
        let q = self.q_proj.forward(query).reshape([b, n, h, d]);
        let k = self.k_proj.forward(key).reshape([b, m, kvh, d]);
        let v = self.v_proj.forward(value).reshape([b, m, kvh, d]);
        let options = AttnOptions { config: self.config.attention.clone(), masks: masks.masks.clone() };
        let a = route([q, k, v], &options, compute)?.out.reshape([b, n, e]);
        let a = self.dropout.forward_on(a, mode, compute)?;
        let a = match &self.norm {
            Some(norm) => norm.forward(a),
            None => a,
        };
        Ok(self.out_proj.forward(a))
    }
}
