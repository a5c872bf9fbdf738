//! [`MultiheadDilatedAttention`] as a candle-nn module: projections (`q_proj`, `k_proj`
//! and `v_proj` with `num_kv_heads * head_dim` rows for grouped heads), the dilated
//! attention op, dropout (training), sub-LayerNorm (`norm`) and `out_proj`, per
//! docs/definition.md; or, under `NormLayout::QkLn`, `q_ln` over q and over the merged
//! heads and `k_ln` over k in place of `norm`.

use std::sync::Arc;

use attn_multihead::{DropoutSite, Mode, MultiheadConfig, NormLayout};
use candle_core::{Module, Result, Tensor};
use candle_nn::{Init, Linear, VarBuilder};

use super::LayerNorm;
use super::dropout::dropout;
use crate::error::to_candle;
use crate::host::AnyAttention;
use crate::options::AttnOptions;

/// The MAGNETO/LongNet multihead layer.
#[derive(Debug, Clone)]
pub struct MultiheadDilatedAttention {
    config: MultiheadConfig,
    options: AttnOptions,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    /// Over the merged heads: sub-LN's `norm`, or qk-LN's `q_ln` (which also normalises q).
    norm: Option<LayerNorm>,
    /// qk-LN's `k_ln` over k (`kv_dim` features).
    k_ln: Option<LayerNorm>,
    out_proj: Linear,
    /// The backend of host tensors; `None`: the process-wide CPU backend, and the CUDA
    /// kernels for tensors on a CUDA device.
    backend: Option<Arc<dyn AnyAttention>>,
}

/// A linear layer `[out, in]` under `vb`, fresh weights drawn as MAGNETO says
/// (xavier-normal with `gain`, zero bias).
pub(crate) fn magneto_linear(
    fan_in: usize,
    fan_out: usize,
    gain: f64,
    bias: bool,
    vb: VarBuilder<'_>,
) -> Result<Linear> {
    let stdev = gain * (2.0 / (fan_in + fan_out) as f64).sqrt();
    let weight = vb.get_with_hints((fan_out, fan_in), "weight", Init::Randn { mean: 0.0, stdev })?;
    let bias = match bias {
        true => Some(vb.get_with_hints(fan_out, "bias", Init::Const(0.0))?),
        false => None,
    };
    Ok(Linear::new(weight, bias))
}

impl MultiheadDilatedAttention {
    /// The layer `config` describes, its parameters read through `vb` or, where `vb`
    /// creates them (a `VarMap`), drawn as the definition's MAGNETO initialisation says.
    pub fn new(config: MultiheadConfig, vb: VarBuilder<'_>) -> Result<Self> {
        config.validate().map_err(to_candle)?;
        let dilated = config.attention.clone();
        let (e, kv, g) = (config.embed_dim, config.kv_dim(), config.gamma_init);
        let linear = |out: usize, gain: f64, name: &str| magneto_linear(e, out, gain, config.bias, vb.pp(name));
        let eps = config.layer_norm_eps;
        let (norm, k_ln) = match (config.layer_norm, config.norm_layout) {
            (false, _) => (None, None),
            (true, NormLayout::SubLn) => (Some(LayerNorm::new(e, eps, vb.pp("norm"))?), None),
            (true, NormLayout::QkLn) => {
                (Some(LayerNorm::new(e, eps, vb.pp("q_ln"))?), Some(LayerNorm::new(kv, eps, vb.pp("k_ln"))?))
            }
        };
        Ok(MultiheadDilatedAttention {
            q_proj: linear(e, 1.0, "q_proj")?,
            k_proj: linear(kv, 1.0, "k_proj")?,
            v_proj: linear(kv, g, "v_proj")?,
            out_proj: linear(e, g, "out_proj")?,
            norm,
            k_ln,
            options: AttnOptions::new(dilated),
            config,
            backend: None,
        })
    }

    /// The same layer computing its attention through `backend` (a ring rank, a CPU
    /// backend with its own threads or memory budget); host tensors only.
    pub fn with_backend(self, backend: Arc<dyn AnyAttention>) -> Self {
        MultiheadDilatedAttention { backend: Some(backend), ..self }
    }

    pub fn config(&self) -> &MultiheadConfig {
        &self.config
    }

    /// The layer on `query` `[batch, seq, embed]` as `call` says: self-attention, or
    /// attention over its `cross` key/value (`[batch, kv_seq, embed]`); its masks (key
    /// padding, packed sequences; the config's own patterns replace `masks.config`);
    /// `Mode::Train { seed }` applies the config's dropout to the merged attention output
    /// with the mask `attn-multihead`'s layer draws for that seed (a fresh seed a step).
    pub fn forward_with(&self, query: &Tensor, call: &LayerCall<'_>) -> Result<Tensor> {
        let (key, value) = call.cross.unwrap_or((query, query));
        let masks = call.masks.unwrap_or(&self.options);
        let mode = call.mode;
        let (b, n, e) = query.dims3()?;
        let (_, m, _) = key.dims3()?;
        let (h, kvh, d) = (self.config.num_heads, self.config.num_kv_heads, self.config.head_dim());
        let (mut q, mut k) = (self.q_proj.forward(query)?, self.k_proj.forward(key)?);
        if let (Some(q_ln), Some(k_ln)) = (&self.norm, &self.k_ln) {
            (q, k) = (q_ln.forward(&q)?, k_ln.forward(&k)?);
        }
        let q = q.reshape((b, n, h, d))?;
        let k = k.reshape((b, m, kvh, d))?;
        let v = self.v_proj.forward(value)?.reshape((b, m, kvh, d))?;
        let options = AttnOptions { config: self.options.config.clone(), ..masks.clone() };
        let a = match &self.backend {
            None => crate::dilated_attention(&q, &k, &v, &options)?,
            Some(backend) => {
                let op = crate::DilatedAttentionOp::new(backend.clone(), std::sync::Arc::new(options.clone()));
                crate::op::attend_output(op, &q, &k, &v)?
            }
        };
        let a = a.reshape((b, n, e))?;
        let a = dropout(&a, mode, self.config.dropout, DropoutSite::Attention, &self.query_positions(mode, n)?)?;
        let a = match &self.norm {
            Some(norm) => norm.forward(&a)?,
            None => a,
        };
        self.out_proj.forward(&a)
    }

    /// The global positions of `seq` local query rows (for dropout masks; none needed
    /// in evaluation): the backend's, `0..seq` on one device.
    pub(crate) fn query_positions(&self, mode: Mode, seq: usize) -> Result<Vec<usize>> {
        match (mode, &self.backend) {
            (Mode::Eval, _) => Ok((0..seq).collect()),
            (Mode::Train { .. }, None) => Ok((0..seq).collect()),
            (Mode::Train { .. }, Some(b)) => {
                attn_core::Attention::<f32>::query_positions(b.as_ref(), seq).map_err(to_candle)
            }
        }
    }
}

impl Module for MultiheadDilatedAttention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, &LayerCall::new())
    }
}

/// What one call of [`MultiheadDilatedAttention::forward_with`] takes beside the query:
/// masks, cross-attention inputs and the mode; `LayerCall::new()` is self-attention
/// without masks in evaluation (what `Module::forward` runs).
#[derive(Debug, Clone, Copy, Default)]
pub struct LayerCall<'a> {
    masks: Option<&'a AttnOptions>,
    cross: Option<(&'a Tensor, &'a Tensor)>,
    mode: Mode,
}

impl<'a> LayerCall<'a> {
    pub fn new() -> Self {
        LayerCall::default()
    }
    /// Key padding and packed sequences (the layer's own patterns are kept).
    pub fn masks(self, masks: &'a AttnOptions) -> Self {
        LayerCall { masks: Some(masks), ..self }
    }
    /// Attention over `key` and `value` in place of the query.
    pub fn cross(self, key: &'a Tensor, value: &'a Tensor) -> Self {
        LayerCall { cross: Some((key, value)), ..self }
    }
    pub fn mode(self, mode: Mode) -> Self {
        LayerCall { mode, ..self }
    }
}
