//! Running a `kind=multihead` conformance case (metadata + tensors) through the layer on any backend.

use std::collections::BTreeMap;
use std::sync::Arc;

use attn_core::{AttnError, Mixing, Result};

use crate::backend::AttentionBackend;
use crate::config::MultiheadConfig;
use crate::dropout::Mode;
use crate::float::LayerFloat;
use crate::layer::MultiheadDilatedAttention;
use crate::weights::MultiheadWeights;
use crate::weights_io::{ExtraTensors, TensorSource, load_params};

fn meta<'a>(m: &'a BTreeMap<String, String>, key: &str) -> Result<&'a str> {
    m.get(key).map(|s| s.trim()).ok_or_else(|| AttnError::Format(format!("missing metadata `{key}`")))
}

fn parse<T: std::str::FromStr>(m: &BTreeMap<String, String>, key: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    let s = meta(m, key)?;
    s.parse().map_err(|e| AttnError::Format(format!("metadata `{key}` = `{s}`: {e}")))
}

fn parse_bool(m: &BTreeMap<String, String>, key: &str) -> Result<bool> {
    match meta(m, key)?.to_ascii_lowercase().as_str() {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        other => Err(AttnError::Format(format!("metadata `{key}` = `{other}` is not a bool"))),
    }
}

fn parse_list(m: &BTreeMap<String, String>, key: &str) -> Result<Vec<usize>> {
    let s = meta(m, key)?;
    s.split(',')
        .map(|x| x.trim().parse().map_err(|e| AttnError::Format(format!("metadata `{key}` = `{s}`: {e}"))))
        .collect()
}

/// The layer config a golden file describes (`embed_dim`, `num_heads`, `segment_lengths`,
/// `dilation_rates`, `mixing`, `causal`, `layer_norm`, optional `layer_norm_eps`).
/// Biases are present when the file has `q_proj.bias`.
pub fn config_from_metadata(m: &BTreeMap<String, String>, has_bias: bool) -> Result<MultiheadConfig> {
    let mut cfg = MultiheadConfig::new(
        parse(m, "embed_dim")?,
        parse(m, "num_heads")?,
        &parse_list(m, "segment_lengths")?,
        &parse_list(m, "dilation_rates")?,
    )
    .with_mixing(Mixing::parse(meta(m, "mixing")?)?)
    .with_causal(parse_bool(m, "causal")?)
    .with_layer_norm(parse_bool(m, "layer_norm")?)
    .with_bias(has_bias);
    if m.contains_key("layer_norm_eps") {
        cfg.layer_norm_eps = parse(m, "layer_norm_eps")?;
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Run a `kind=multihead` case: build the layer from the metadata, load its weights
/// from `tensors` (PyTorch names), and return the output for `query` (and `key`,
/// `value` when `cross_attention` is true), `[batch, seq, embed]`.
pub fn forward_case<F: LayerFloat>(
    m: &BTreeMap<String, String>,
    tensors: &impl TensorSource,
    backend: Arc<dyn AttentionBackend<F>>,
) -> Result<Vec<F>> {
    let kind = meta(m, "kind")?;
    if kind != "multihead" {
        return Err(AttnError::Format(format!("kind=`{kind}` is not a multihead case")));
    }
    let cfg = config_from_metadata(m, tensors.tensor_shape("q_proj.bias").is_some())?;
    let mut weights = MultiheadWeights::<F>::magneto(&cfg, 0);
    load_params(&mut weights, tensors, ExtraTensors::Ignore)?;
    let layer = MultiheadDilatedAttention::from_weights(cfg.clone(), weights, backend)?;
    let (qshape, query) = tensors.read_tensor::<F>("query")?;
    let dims = |s: &[usize], name: &str| -> Result<(usize, usize)> {
        match s {
            [b, n, e] if *e == cfg.embed_dim => Ok((*b, *n)),
            _ => Err(AttnError::Format(format!("`{name}` has shape {s:?}, expected [batch, seq, {}]", cfg.embed_dim))),
        }
    };
    let (batch, q_seq) = dims(&qshape, "query")?;
    let cross = m.get("cross_attention").map(|_| parse_bool(m, "cross_attention")).transpose()?.unwrap_or(false);
    if !cross {
        return layer.forward(&query, batch, q_seq, Mode::Eval);
    }
    let (kshape, key) = tensors.read_tensor::<F>("key")?;
    let (vshape, value) = tensors.read_tensor::<F>("value")?;
    let (kb, kv_seq) = dims(&kshape, "key")?;
    if kb != batch || vshape != kshape {
        return Err(AttnError::Format(format!("key {kshape:?} / value {vshape:?} disagree with query {qshape:?}")));
    }
    Ok(layer.forward_cross(&query, &key, &value, batch, q_seq, kv_seq, Mode::Eval)?.0)
}
