//! [`MultiheadDilatedAttention`] as a candle-nn module: projections (`q_proj`, `k_proj`
//! and `v_proj` with `num_kv_heads * head_dim` rows for grouped heads), the dilated
//! attention op, sub-LayerNorm (`norm`) and `out_proj`, per docs/definition.md.

use attn_multihead::MultiheadConfig;
use candle_core::{Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};

use super::LayerNorm;
use crate::error::to_candle;
use crate::options::AttnOptions;

/// The MAGNETO/LongNet multihead layer.
#[derive(Debug, Clone)]
pub struct MultiheadDilatedAttention {
    config: MultiheadConfig,
    options: AttnOptions,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    norm: Option<LayerNorm>,
    out_proj: Linear,
}

impl MultiheadDilatedAttention {
    /// The layer `config` describes, its parameters read (or created) through `vb`.
    pub fn new(config: MultiheadConfig, vb: VarBuilder<'_>) -> Result<Self> {
        let dilated = config.validate().map_err(to_candle)?;
        let (e, kv) = (config.embed_dim, config.kv_dim());
        let linear = |out: usize, name: &str| match config.bias {
            true => candle_nn::linear(e, out, vb.pp(name)),
            false => candle_nn::linear_no_bias(e, out, vb.pp(name)),
        };
        let norm = match config.layer_norm {
            true => Some(LayerNorm::new(e, config.layer_norm_eps, vb.pp("norm"))?),
            false => None,
        };
        Ok(MultiheadDilatedAttention {
            q_proj: linear(e, "q_proj")?,
            k_proj: linear(kv, "k_proj")?,
            v_proj: linear(kv, "v_proj")?,
            out_proj: linear(e, "out_proj")?,
            norm,
            options: AttnOptions::new(dilated),
            config,
        })
    }

    pub fn config(&self) -> &MultiheadConfig {
        &self.config
    }

    /// Self-attention of `x` `[batch, seq, embed]` with `masks` (key padding, packed
    /// sequences; the config's own patterns replace `masks.config`).
    pub fn forward_masked(&self, x: &Tensor, masks: &AttnOptions) -> Result<Tensor> {
        self.forward_cross(x, x, x, masks)
    }

    /// Attention of `query` over `key`/`value` (`[batch, kv_seq, embed]`).
    pub fn forward_cross(&self, query: &Tensor, key: &Tensor, value: &Tensor, masks: &AttnOptions) -> Result<Tensor> {
        let (b, n, e) = query.dims3()?;
        let (_, m, _) = key.dims3()?;
        let (h, kvh, d) = (self.config.num_heads, self.config.num_kv_heads, self.config.head_dim());
        let q = self.q_proj.forward(query)?.reshape((b, n, h, d))?;
        let k = self.k_proj.forward(key)?.reshape((b, m, kvh, d))?;
        let v = self.v_proj.forward(value)?.reshape((b, m, kvh, d))?;
        let options = AttnOptions { config: self.options.config.clone(), ..masks.clone() };
        let a = crate::dilated_attention(&q, &k, &v, &options)?.reshape((b, n, e))?;
        let a = match &self.norm {
            Some(norm) => norm.forward(&a)?,
            None => a,
        };
        self.out_proj.forward(&a)
    }
}

impl Module for MultiheadDilatedAttention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_masked(x, &self.options)
    }
}
