//! Dilated attention (head-group mixing) composed from burn's own `attention` op, the way
//! `attn-bench/torch/torch_dilated.py` composes it from PyTorch's SDPA: per head group,
//! take each segment's dilated rows, run `attention` on them, put the rows back in place
//! (zeros elsewhere) and divide the sum over groups by their number. Differentiable by
//! burn's autodiff (its `attention` backward is burn's fallback composition).

use attn_core::{AttnError, Causality, DilatedConfig, Feature, Mixing, Result, TensorName};
use burn_tensor::Tensor;
use burn_tensor::module::attention;
use burn_tensor::ops::AttentionModuleOptions;

/// What the composition is called in its errors.
const NAME: &str = "the burn `attention` composition";

/// A feature the composition leaves out, as a typed error.
fn unsupported(feature: Feature) -> AttnError {
    AttnError::Unsupported { backend: NAME, feature }
}

/// The config's patterns, checked against the composition's reach: head-group mixing,
/// every segment dividing the sequence and every rate dividing its segment.
fn patterns(cfg: &DilatedConfig, seq: usize, heads: usize) -> Result<Vec<(usize, usize)>> {
    match cfg.mixing() {
        Mixing::HeadGroups => {}
        Mixing::Window => return Err(unsupported(Feature::Window)),
        Mixing::LongNet => return Err(unsupported(Feature::Other("LongNet mixing"))),
    }
    cfg.validate_heads(heads)?;
    let pairs: Vec<(usize, usize)> =
        cfg.segment_lengths().iter().copied().zip(cfg.dilation_rates().iter().copied()).collect();
    for &(w, r) in &pairs {
        if !seq.is_multiple_of(w) {
            return Err(unsupported(Feature::Other("a sequence that is not a multiple of every segment length")));
        }
        if !w.is_multiple_of(r) {
            return Err(unsupported(Feature::Other("a segment length that is not a multiple of its rate")));
        }
    }
    Ok(pairs)
}

/// Dilated attention of q, k, v `[batch, seq, heads, head_dim]` (k and v of q's shape)
/// under `cfg` (head-group mixing, either causality), from burn's `attention`.
pub fn composed_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, cfg: &DilatedConfig) -> Result<Tensor<4>> {
    let [b, n, h, d] = q.dims();
    for (tensor, t) in [(TensorName::Key, &k), (TensorName::Value, &v)] {
        if t.dims() != [b, n, h, d] {
            return Err(AttnError::ShapeMismatch { tensor, expected: vec![b, n, h, d], got: t.dims().to_vec() });
        }
    }
    let pairs = patterns(cfg, n, h)?;
    let groups = pairs.len();
    let options = AttentionModuleOptions {
        scale: Some(cfg.scale_for(d)),
        softcap: None,
        is_causal: cfg.causality() == Causality::Causal,
    };
    let mut outs = Vec::with_capacity(groups);
    let mut h0 = 0;
    for (i, &(w, r)) in pairs.iter().enumerate() {
        // Groups 0..h % G hold one head more than the others.
        let g = h / groups + usize::from(i < h % groups);
        let (off, m, blocks) = (i % r, w / r, n / w);
        // [b, n, g, d] -> the rows `off, off + r, ...` of each segment, as
        // [b * blocks, g, m, d].
        let rows = |t: &Tensor<4>| {
            t.clone()
                .slice([0..b, 0..n, h0..h0 + g, 0..d])
                .reshape([b * blocks, m, r, g * d])
                .slice([0..b * blocks, 0..m, off..off + 1, 0..g * d])
                .reshape([b * blocks, m, g, d])
                .swap_dims(1, 2)
        };
        let x = attention(rows(&q), rows(&k), rows(&v), None, None, options).swap_dims(1, 2);
        // Back in place: zeros on the rows of the other offsets.
        let x = x.reshape([b * blocks, m, 1, g * d]);
        let zeros = |width: usize| Tensor::<4>::zeros([b * blocks, m, width, g * d], (&q.device(), q.dtype()));
        let mut parts = Vec::with_capacity(3);
        if off > 0 {
            parts.push(zeros(off));
        }
        parts.push(x);
        if off + 1 < r {
            parts.push(zeros(r - off - 1));
        }
        outs.push(Tensor::cat(parts, 2).reshape([b, n, g, d]));
        h0 += g;
    }
    Ok(Tensor::cat(outs, 2).div_scalar(groups as f64))
}
