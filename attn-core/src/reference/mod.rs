//! The float64 reference: dense and dilated attention, forward and exact backward.
//!
//! Deliberately simple: for every query it lists the keys the mask admits (with
//! multiplicity across LongNet patterns), takes one softmax over them, and sums.
//! Every backend and ring strategy is judged against this module.

mod backend;
mod backward;

pub use backend::ReferenceBackend;
pub use backward::{
    dense_backward, dilated_backward, dilated_backward_lse, dilated_backward_masked, dilated_backward_with_magnitudes,
};

use crate::band::Band;
use crate::config::{Causality, DilatedConfig};
use crate::error::{AttnError, Result, TensorName};
use crate::masks::Masks;
use crate::shape::AttnShape;

/// Output `[batch, seq, heads, head_dim]` and LSE `[batch, seq, heads]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Forward {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
}

/// Gradients of `sum(out * grad_out)` with respect to q, k and v.
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// Each result's sum of absolute terms: `out_scale * sum_j p_j |v_j|` for the output,
/// `sum_i p_ij |grad_out_i|` for dv, and for dq (dk likewise with |q|)
/// `scale * sum_j p_j (|dp|_j + |D|) |k_j|` where `|dp|_j = sum_e |grad_out_e v_je|` and
/// `|D| = sum_j p_j |dp|_j` bound the terms of `ds_j = p_j (dp_j - D)`.
///
/// A kernel that rounds each product term once to a dtype with unit roundoff `u` (the
/// softmax weights before `P V`, `ds` before `dS K`, the stored output inside `D`) is
/// off by at most about `u` times these, however much the terms cancel: the scale of a
/// low-precision error where the result itself is near zero.
#[derive(Debug, Clone, PartialEq)]
pub struct Magnitudes {
    /// Per `[batch, seq, heads]` row: the largest `scale * sum_i |q_i k_i|` over the
    /// row's keys plus `ln` of their count (0 where the row has no key). A kernel that
    /// scores and sums in f32 gets the LSE right to a few f32 ulps of this.
    pub lse: Vec<f64>,
    pub out: Vec<f64>,
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    /// The part of `out`, `dq`, `dk`, `dv` from softmax weights below [`FLUSHED_WEIGHT`]:
    /// terms a kernel computing weights in f32 may drop (never a subnormal weight).
    pub flushable: Flushable,
    /// Per result element, the sum over its attended pairs of the factor that multiplies
    /// a softmax weight or a score gradient (`out_scale |v|` for the output, `|grad_out|`
    /// for dv, `scale |k|` for dq, `scale |q|` for dk): a kernel that rounds those weights
    /// to a format whose smallest step is `eta` (f16's subnormals: `2^-24`) is off by at
    /// most `eta / 2` times this, on top of the relative rounding the magnitudes bound.
    pub quantum: Flushable,
}

/// Softmax weights below `2^-125` lie under f32's normal range (with headroom for the
/// running maximum): the kernels compute them as 0, and a result made only of such
/// terms is a result of 0 (see [`Magnitudes::flushable`]).
pub const FLUSHED_WEIGHT: f64 = 2.350_988_701_644_575e-38;

/// Per-result-element sums for `out`, `dq`, `dk`, `dv`: of absolute terms of pairs whose
/// softmax weight is below [`FLUSHED_WEIGHT`] ([`Magnitudes::flushable`]), or of the
/// factors of rounded weights ([`Magnitudes::quantum`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Flushable {
    pub out: Vec<f64>,
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

impl Flushable {
    /// Zeros for results of `q` (out, dq) and `kv` (dk, dv) element counts.
    pub(crate) fn zeros(q: usize, kv: usize) -> Self {
        Flushable { out: vec![0.0; q], dq: vec![0.0; q], dk: vec![0.0; kv], dv: vec![0.0; kv] }
    }
}

/// Row-major index helper for `[batch, seq, heads, head_dim]`.
#[derive(Clone, Copy)]
pub(crate) struct Rows {
    pub seq: usize,
    pub heads: usize,
    pub d: usize,
}

impl Rows {
    #[inline]
    pub fn at(&self, b: usize, s: usize, h: usize) -> usize {
        ((b * self.seq + s) * self.heads + h) * self.d
    }
}

pub(crate) fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub(crate) fn check_len(tensor: TensorName, got: usize, expected: usize) -> Result<()> {
    if got != expected {
        return Err(AttnError::ShapeMismatch { tensor, expected: vec![expected], got: vec![got] });
    }
    Ok(())
}

fn check_qkv(shape: &AttnShape, [q, k, v]: [&[f64]; 3]) -> Result<()> {
    check_len(TensorName::Query, q.len(), shape.q.numel())?;
    check_len(TensorName::Key, k.len(), shape.kv.numel())?;
    check_len(TensorName::Value, v.len(), shape.kv.numel())
}

/// Who attends to whom: the config's patterns (`None`: dense attention), its band,
/// and the call's masks, over the call's shapes.
#[derive(Clone, Copy)]
pub(crate) struct KeyRule<'a> {
    pub cfg: Option<&'a DilatedConfig>,
    pub band: Band,
    pub masks: Masks<'a>,
    pub shape: AttnShape,
}

impl KeyRule<'_> {
    /// The keys (with multiplicity across LongNet patterns) that query `i` of head `h`
    /// of batch `b` attends, as global key positions, and the head's output scale.
    /// Patterns, causality and windows apply to positions inside the query's packed
    /// sequence; padded keys and keys in a tile the block mask removes are dropped.
    pub fn keys(&self, b: usize, h: usize, i: usize) -> (Vec<usize>, f64) {
        let kv_len = self.shape.kv.seq;
        let seq = self.masks.sequence_bounds(i, kv_len);
        let (start, n, rel) = (seq.start, seq.len(), i - seq.start);
        let admitted = |k: &usize| {
            self.band.admits(rel, *k)
                && !self.masks.is_padding(b, start + k)
                && self.masks.block_keeps(b, h, i, start + k)
        };
        let (rel_keys, out_scale): (Vec<usize>, f64) = match self.cfg {
            None => ((0..n).filter(admitted).collect(), 1.0),
            Some(cfg) => {
                let hp = cfg.head_patterns(self.shape.q.heads, h);
                let keys = hp.patterns.iter().flat_map(|(_, p)| p.keys_of(rel, n, Causality::Full).filter(admitted));
                (keys.collect(), hp.out_scale)
            }
        };
        (rel_keys.into_iter().map(|k| start + k).collect(), out_scale)
    }
}

/// Softmax weights `p_j = exp(s_j - lse)` and the LSE for scores `s` (`-inf` if empty).
/// A NaN score (from a NaN in q or k) makes the whole row NaN: it is never
/// dropped into a plausible zero.
pub(crate) fn softmax(scores: &[f64]) -> (Vec<f64>, f64) {
    if scores.iter().any(|s| s.is_nan()) {
        return (vec![f64::NAN; scores.len()], f64::NAN);
    }
    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return (vec![0.0; scores.len()], f64::NEG_INFINITY);
    }
    let lse = m + scores.iter().map(|s| (s - m).exp()).sum::<f64>().ln();
    (scores.iter().map(|s| (s - lse).exp()).collect(), lse)
}

pub(crate) fn forward_impl(rule: KeyRule<'_>, scale: f64, [q, k, v]: [&[f64]; 3]) -> Result<Forward> {
    // `AttnShape` has public fields: re-check what `AttnShape::check` guarantees (valid
    // dims, k/v matching q in batch and head_dim, kv heads dividing heads) before
    // indexing by it.
    let shape = rule.shape.rechecked()?;
    rule.masks.check(&shape)?;
    let rule = KeyRule { shape, ..rule };
    check_qkv(&shape, [q, k, v])?;
    let (qs, kvs) = (shape.q, shape.kv);
    let d = qs.head_dim;
    let qr = Rows { seq: qs.seq, heads: qs.heads, d };
    let kr = Rows { seq: kvs.seq, heads: kvs.heads, d };
    let mut out = vec![0.0; qs.numel()];
    let mut lse = vec![f64::NEG_INFINITY; qs.lse_len()];
    for b in 0..qs.batch {
        for h in 0..qs.heads {
            let hk = shape.kv_head(h);
            for i in 0..qs.seq {
                let (keys, out_scale) = rule.keys(b, h, i);
                let qi = &q[qr.at(b, i, h)..][..d];
                let scores: Vec<f64> = keys.iter().map(|&j| scale * dot(qi, &k[kr.at(b, j, hk)..][..d])).collect();
                let (p, l) = softmax(&scores);
                lse[(b * qs.seq + i) * qs.heads + h] = l;
                let o = &mut out[qr.at(b, i, h)..][..d];
                for (&j, &pj) in keys.iter().zip(&p) {
                    for (oe, ve) in o.iter_mut().zip(&v[kr.at(b, j, hk)..][..d]) {
                        *oe += out_scale * pj * ve;
                    }
                }
            }
        }
    }
    Ok(Forward { out, lse })
}

/// Dilated attention (both mixing modes, or a sliding window) in float64. LSE is per
/// head: for HeadGroups the LSE of the head's pattern, for LongNet the merged LSE.
pub fn dilated_forward(cfg: &DilatedConfig, shape: AttnShape, q: &[f64], k: &[f64], v: &[f64]) -> Result<Forward> {
    dilated_forward_masked(cfg, shape, Masks::NONE, [q, k, v])
}

/// [`dilated_forward`] with key padding, packed sequences and a block mask.
pub fn dilated_forward_masked(
    cfg: &DilatedConfig,
    shape: AttnShape,
    masks: Masks<'_>,
    qkv: [&[f64]; 3],
) -> Result<Forward> {
    cfg.validate_heads(shape.q.heads)?;
    let rule = KeyRule { cfg: Some(cfg), band: cfg.band(), masks, shape };
    forward_impl(rule, cfg.scale_for(shape.q.head_dim), qkv)
}

/// Plain softmax attention over all keys (causal: keys at positions `<=` the query's).
pub fn dense_forward(
    shape: AttnShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    scale: f64,
    causality: Causality,
) -> Result<Forward> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(AttnError::InvalidScale(scale));
    }
    let band = if causality.is_causal() { Band::CAUSAL } else { Band::FULL };
    forward_impl(KeyRule { cfg: None, band, masks: Masks::NONE, shape }, scale, [q, k, v])
}
