//! The layer config a conformance or checkpoint file describes in its safetensors metadata (`embed_dim`, `num_heads`, the pattern, ...).

use std::collections::BTreeMap;

use attn_core::{AttnError, DilatedConfig, Mixing, Result};

use crate::config::{MultiheadConfig, NormLayout};
use crate::projection::Bias;

/// The trimmed value of `key`, or a `Format` error naming the missing key.
pub fn text<'a>(m: &'a BTreeMap<String, String>, key: &str) -> Result<&'a str> {
    m.get(key).map(|s| s.trim()).ok_or_else(|| AttnError::Format(format!("missing metadata `{key}`")))
}

fn parse<T: std::str::FromStr>(m: &BTreeMap<String, String>, key: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    let s = text(m, key)?;
    s.parse().map_err(|e| AttnError::Format(format!("metadata `{key}` = `{s}`: {e}")))
}

/// The flag `key` (`true`/`1` or `false`/`0`).
pub fn flag(m: &BTreeMap<String, String>, key: &str) -> Result<bool> {
    match text(m, key)?.to_ascii_lowercase().as_str() {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        other => Err(AttnError::Format(format!("metadata `{key}` = `{other}` is not a bool"))),
    }
}

fn parse_list(m: &BTreeMap<String, String>, key: &str) -> Result<Vec<usize>> {
    let s = text(m, key)?;
    s.split(',')
        .map(|x| x.trim().parse().map_err(|e| AttnError::Format(format!("metadata `{key}` = `{s}`: {e}"))))
        .collect()
}

/// The layer config a golden file describes (`embed_dim`, `num_heads`, `segment_lengths`,
/// `dilation_rates`, `mixing`, `causal`, `layer_norm`, optional `num_kv_heads`,
/// `layer_norm_eps`, `norm_layout` (`sub_ln` where absent, or `qk_ln`) and `scale`).
/// `bias` says whether the file has biases (`q_proj.bias`).
pub fn config_from_metadata(m: &BTreeMap<String, String>, bias: Bias) -> Result<MultiheadConfig> {
    let scale = match m.get("scale").map(|s| s.trim().to_ascii_lowercase()) {
        None => None,
        Some(s) if ["", "none", "null", "default"].contains(&s.as_str()) => None,
        Some(_) => Some(parse(m, "scale")?),
    };
    let attention = DilatedConfig::builder()
        .segments(&parse_list(m, "segment_lengths")?)
        .dilations(&parse_list(m, "dilation_rates")?)
        .mixing(Mixing::parse(text(m, "mixing")?)?)
        .causality(flag(m, "causal")?.into())
        .maybe_scale(scale)
        .build()?;
    let mut cfg = MultiheadConfig::new(parse(m, "embed_dim")?, parse(m, "num_heads")?, attention)
        .with_layer_norm(flag(m, "layer_norm")?.into())
        .with_bias(bias);
    if m.contains_key("layer_norm_eps") {
        cfg.layer_norm_eps = parse(m, "layer_norm_eps")?;
    }
    if m.contains_key("norm_layout") {
        cfg.norm_layout = NormLayout::parse(text(m, "norm_layout")?)?;
    }
    if m.contains_key("num_kv_heads") {
        cfg.num_kv_heads = parse(m, "num_kv_heads")?;
    }
    cfg.validate()?;
    Ok(cfg)
}
