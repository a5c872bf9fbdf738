//! What qk-LN's norms replace: q and k as projected, with the norms' row statistics
//! (`QkPre`, kept for the backward), and the in-place normalisation of a column range of
//! a projection buffer that produces it.

use std::ops::Range;

use attn_core::Result;

use crate::float::LayerFloat;
use crate::layer_norm::{LayerNorm, NormStats};

/// q and k as projected, before their LayerNorms, with the norms' row statistics: what
/// the backward of `q_ln` and `k_ln` reads.
#[derive(Debug, Clone)]
pub(crate) struct QkPre<F: LayerFloat> {
    /// q `[rows, embed]` and `q_ln`'s statistics.
    pub q: Vec<F>,
    pub q_stats: NormStats<F::Acc>,
    /// k `[kv_rows, kv_dim]` and `k_ln`'s statistics.
    pub k: Vec<F>,
    pub k_stats: NormStats<F::Acc>,
}

/// Normalise columns `cols` of every `stride`-wide row of `buf` with `norm`, in place;
/// returns those columns as they were (`[rows, cols.len()]`) and the statistics.
pub(crate) fn normalize_columns<F: LayerFloat>(
    norm: &LayerNorm<F>,
    buf: &mut [F],
    stride: usize,
    cols: Range<usize>,
) -> Result<(Vec<F>, NormStats<F::Acc>)> {
    let (rows, width) = (buf.len() / stride.max(1), cols.len());
    let mut pre = attn_kernels::zeroed_buffer(rows * width)?;
    for (p, r) in pre.chunks_exact_mut(width).zip(buf.chunks_exact(stride)) {
        p.copy_from_slice(&r[cols.clone()]);
    }
    let mut y = attn_kernels::zeroed_buffer(rows * width)?;
    let stats = norm.forward_into(&pre, &mut y)?;
    for (r, yr) in buf.chunks_exact_mut(stride).zip(y.chunks_exact(width)) {
        r[cols.clone()].copy_from_slice(yr);
    }
    Ok((pre, stats))
}

/// Statistics of rows `rows`.
pub(crate) fn stats_rows<A: Copy>(st: &NormStats<A>, rows: Range<usize>) -> NormStats<A> {
    NormStats { mean: st.mean[rows.clone()].to_vec(), rstd: st.rstd[rows].to_vec() }
}
