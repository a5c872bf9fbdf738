//! Block attention on rows that carry global positions, in f32: the forward
//! merges a key block into running `(out, lse)` accumulators by the LSE merge,
//! the backward adds a key block's share of dq/dk/dv given the final lse.
//!
//! Keys of a block are the selected rows of one pattern, ascending, so the keys
//! a query sees (same segment, and `<=` it when causal) are one contiguous run.

use attn_core::{LseMerge, SegmentPattern};

/// Rows of one (batch, head): `data` is `[rows, d]`, `pos` the global position of each row.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows<'a> {
    pub pos: &'a [usize],
    pub data: &'a [f32],
}

/// A key/value block: selected positions of one pattern, ascending.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyBlock<'a> {
    pub pos: &'a [usize],
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// Mask parameters of one call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mask {
    pub pat: SegmentPattern,
    pub causal: bool,
    pub scale: f32,
    pub d: usize,
}

impl Mask {
    /// The run of keys query position `qp` attends.
    #[inline]
    fn key_run(&self, qp: usize, kpos: &[usize]) -> std::ops::Range<usize> {
        let s = qp / self.pat.w;
        let seg_lo = s * self.pat.w;
        let seg_hi = seg_lo.saturating_add(self.pat.w);
        let hi_excl = if self.causal { seg_hi.min(qp + 1) } else { seg_hi };
        let lo = kpos.partition_point(|&k| k < seg_lo);
        let hi = kpos.partition_point(|&k| k < hi_excl);
        lo..hi.max(lo)
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Merge the attention of queries `q_idx` (rows of `q`) onto `keys` into `acc_o`/`acc_lse`
/// (indexed like `q`).
pub(crate) fn attend_forward(
    q: Rows<'_>,
    q_idx: &[usize],
    keys: KeyBlock<'_>,
    m: Mask,
    acc_o: &mut [f32],
    acc_lse: &mut [f32],
) {
    let d = m.d;
    let mut scores = Vec::new();
    let mut o = vec![0.0f32; d];
    for &qi in q_idx {
        let run = m.key_run(q.pos[qi], keys.pos);
        if run.is_empty() {
            continue;
        }
        let qr = &q.data[qi * d..(qi + 1) * d];
        scores.clear();
        scores.extend(run.clone().map(|j| m.scale * dot(qr, &keys.k[j * d..(j + 1) * d])));
        let mx = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        o.iter_mut().for_each(|x| *x = 0.0);
        let mut sum = 0.0f32;
        for (s, j) in scores.iter().zip(run) {
            let pj = (s - mx).exp();
            sum += pj;
            for (x, &vv) in o.iter_mut().zip(&keys.v[j * d..(j + 1) * d]) {
                *x += pj * vv;
            }
        }
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|x| *x *= inv);
        LseMerge::merge_into(&mut acc_o[qi * d..(qi + 1) * d], &mut acc_lse[qi], &o, mx + sum.ln());
    }
}

/// Per-query inputs of the backward: final lse, `g = out_scale * grad_out`, `delta = grad_out . out`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GradRows<'a> {
    pub lse: &'a [f32],
    pub g: &'a [f32],
    pub delta: &'a [f32],
}

/// Add the share of `keys` in the gradients: `dq` (indexed like `q`), `dk`/`dv` (like `keys`).
pub(crate) fn attend_backward(
    q: Rows<'_>,
    q_idx: &[usize],
    keys: KeyBlock<'_>,
    m: Mask,
    gr: GradRows<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    let d = m.d;
    for &qi in q_idx {
        let run = m.key_run(q.pos[qi], keys.pos);
        if run.is_empty() {
            continue;
        }
        let (qr, g) = (&q.data[qi * d..(qi + 1) * d], &gr.g[qi * d..(qi + 1) * d]);
        let (lse, delta) = (gr.lse[qi], gr.delta[qi]);
        let dqr = &mut dq[qi * d..(qi + 1) * d];
        for j in run {
            let kr = &keys.k[j * d..(j + 1) * d];
            let p = (m.scale * dot(qr, kr) - lse).exp();
            let dp = dot(g, &keys.v[j * d..(j + 1) * d]);
            let ds = p * (dp - delta) * m.scale;
            for e in 0..d {
                dv[j * d + e] += p * g[e];
                dk[j * d + e] += ds * qr[e];
                dqr[e] += ds * kr[e];
            }
        }
    }
}
