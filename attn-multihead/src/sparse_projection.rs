//! Row-sparse fused QKV projection for head-group mixing: each head group projects
//! only the rows its one pattern selects, because attention never reads the others.
//!
//! With head groups, head `h` of group `g` runs one pattern `(w_g, r_g, off_g)`, the
//! same for the whole group, and its output depends only on the q, k and v rows that
//! pattern selects (SPEC.md). A group with `r_g = 2` therefore needs half of its
//! projected rows, `r_g = 4` a quarter: at the config (rates 1, 2, 4 over
//! 3 + 3 + 2 heads) 5/8 of the dense projection's FLOPs. The rows left out stay zero
//! (finite, so whole-tensor scans such as the score-overflow check see nothing
//! unusual), and their gradients are zero, so the backward needs no change.

use attn_core::{DilatedConfig, HeadGroups, Mixing, Result, SegmentPattern};

use crate::float::LayerFloat;
use crate::matmul::{Mat, matmul};
use crate::projection::{LinearGrad, LinearRef, biased_product, linear_forward};

/// Rows `start, start + step, ...` (`count` of them) of one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowRun {
    start: usize,
    step: usize,
    count: usize,
}

/// The rows of a sequence of length `seq` that `p` selects, as arithmetic runs: one
/// run when segments are whole multiples of the rate (the selection is then every
/// `r`-th row from `off` across segment borders), else one run per segment.
fn selected_runs(p: &SegmentPattern, seq: usize) -> Vec<RowRun> {
    if p.r == 1 && p.off == 0 {
        return vec![RowRun { start: 0, step: 1, count: seq }];
    }
    if p.w.is_multiple_of(p.r) {
        // No run at all when the offset lies past a short sequence (a run with no rows
        // would still start past the buffers' ends).
        return match seq.checked_sub(p.off) {
            Some(rest) if rest > 0 => vec![RowRun { start: p.off, step: p.r, count: rest.div_ceil(p.r) }],
            _ => Vec::new(),
        };
    }
    (0..p.num_segments(seq))
        .map(|s| RowRun { start: p.segment_bounds(s, seq).start + p.off, step: p.r, count: p.count_in_segment(s, seq) })
        .filter(|run| run.count > 0)
        .collect()
}

/// The input of a self-attention projection: the config and head layout of the layer
/// and `x` `[batch, seq, heads * head_dim]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QkvInput<'a, F> {
    pub cfg: &'a DilatedConfig,
    pub heads: usize,
    pub head_dim: usize,
    pub x: &'a [F],
    pub batch: usize,
    pub seq: usize,
}

/// Whether [`project_qkv_backward`] ran, or left the work to the dense products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SparseBackward {
    Done,
    /// Not head-group mixing: nothing was touched.
    NotApplicable,
}

/// `qkv = x W^T + b` (`[batch, seq, 3, heads, head_dim]`, pre-zeroed; `weight` is
/// `[3 * embed, embed]`), projecting for each head group only the rows its pattern
/// selects. Other mixings (every head runs a pattern with rate 1, LongNet) take the
/// dense product.
pub(crate) fn project_qkv<F: LayerFloat>(
    input: &QkvInput<'_, F>,
    weight: &[F],
    bias: Option<&[F]>,
    qkv: &mut [F],
) -> Result<()> {
    let QkvInput { cfg, heads, head_dim, x, batch, seq } = *input;
    let e = heads * head_dim;
    if cfg.mixing() != Mixing::HeadGroups {
        return linear_forward(LinearRef { weight, bias, in_dim: e, out_dim: 3 * e }, x, batch * seq, qkv, 3 * e);
    }
    let groups = HeadGroups::new(heads, cfg.num_patterns());
    for g in 0..cfg.num_patterns() {
        let hs = groups.range(g);
        if hs.is_empty() {
            continue;
        }
        let (_, pattern) = cfg.head_patterns(heads, hs.start).patterns[0];
        let cols = hs.len() * head_dim;
        for run in selected_runs(&pattern, seq) {
            for b in 0..batch {
                let row0 = b * seq + run.start;
                let lhs = Mat::rows(&x[row0 * e..], run.count, e, run.step * e);
                for part in 0..3 {
                    // Output columns (and weight rows) of this group's heads in q, k or v.
                    let c0 = part * e + hs.start * head_dim;
                    let dst = &mut qkv[row0 * 3 * e + c0..];
                    let rhs = Mat::transposed(&weight[c0 * e..], cols, e, e);
                    biased_product(dst, run.step * 3 * e, lhs, rhs, bias.map(|b| &b[c0..c0 + cols]))?;
                }
            }
        }
    }
    Ok(())
}

/// The backward of [`project_qkv`] for self-attention under head-group mixing:
/// `dweight += dy^T x`, `dbias += sum dy`, `dx += dy W` over only the rows each group
/// selects (its rows of `dq`, `dk`, `dv` elsewhere are zero: attention never read
/// them). `grads` are `dq`, `dk`, `dv` (`[batch, seq, heads, head_dim]`); `dx` is
/// `[batch, seq, embed]` and accumulated into; `grad` holds `dweight` and `dbias`.
/// Other mixings touch nothing and return `NotApplicable` (the caller runs the dense
/// products).
pub(crate) fn project_qkv_backward<F: LayerFloat>(
    input: &QkvInput<'_, F>,
    weight: &[F],
    grads: [&[F]; 3],
    grad: LinearGrad<'_, F>,
    dx: &mut [F],
) -> Result<SparseBackward> {
    let QkvInput { cfg, heads, head_dim, x, batch, seq } = *input;
    let LinearGrad { dweight, mut dbias, .. } = grad;
    if cfg.mixing() != Mixing::HeadGroups {
        return Ok(SparseBackward::NotApplicable);
    }
    let e = heads * head_dim;
    let groups = HeadGroups::new(heads, cfg.num_patterns());
    let mut ones = Vec::new();
    for g in 0..cfg.num_patterns() {
        let hs = groups.range(g);
        if hs.is_empty() {
            continue;
        }
        let (_, pattern) = cfg.head_patterns(heads, hs.start).patterns[0];
        let (g0, cols) = (hs.start * head_dim, hs.len() * head_dim);
        for run in selected_runs(&pattern, seq) {
            ones.resize(run.count, F::one());
            for b in 0..batch {
                let row0 = b * seq + run.start;
                let xs = Mat::rows(&x[row0 * e..], run.count, e, run.step * e);
                for (part, dy) in grads.iter().enumerate() {
                    let c0 = part * e + g0;
                    let dys = Mat::rows(&dy[row0 * e + g0..], run.count, cols, run.step * e);
                    let dyt = Mat::transposed(&dy[row0 * e + g0..], run.count, cols, run.step * e);
                    matmul(&mut dweight[c0 * e..], e, true, dyt, xs)?;
                    if let Some(db) = dbias.as_deref_mut() {
                        matmul(&mut db[c0..], 1, true, dyt, Mat::rows(&ones, run.count, 1, 1))?;
                    }
                    matmul(&mut dx[row0 * e..], run.step * e, true, dys, Mat::rows(&weight[c0 * e..], cols, e, e))?;
                }
            }
        }
    }
    Ok(SparseBackward::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_cover_exactly_the_selected_rows() {
        for (w, r, off) in [(8, 1, 0), (8, 2, 1), (8, 4, 2), (6, 4, 3), (5, 2, 1), (7, 3, 0), (16, 16, 15)] {
            let p = SegmentPattern::new(w, r, off);
            for seq in [1, 3, 7, 8, 13, 33] {
                let mut rows: Vec<usize> = selected_runs(&p, seq)
                    .iter()
                    .flat_map(|run| (0..run.count).map(move |i| run.start + i * run.step))
                    .collect();
                rows.sort_unstable();
                let want: Vec<usize> = (0..seq).filter(|&q| p.is_selected(q)).collect();
                assert_eq!(rows, want, "w {w} r {r} off {off} seq {seq}");
            }
        }
    }

    /// Every row a group's pattern selects equals the dense projection's (f64, so the
    /// different GEMM blockings agree to rounding); every other row of the group's
    /// columns is zero. Ragged segments (w % r != 0), batch 2, with and without bias,
    /// and LongNet mixing (dense) too.
    #[test]
    fn selected_rows_equal_the_dense_projection_and_the_rest_are_zero() {
        let (heads, hd, batch) = (5usize, 3usize, 2usize);
        // 1, 2, 3: sequences shorter than some group offsets (no rows selected there).
        for seq in [23usize, 1, 2, 3] {
            let e = heads * hd;
            let x: Vec<f64> = (0..batch * seq * e).map(|i| ((i * 37 % 101) as f64 - 50.0) / 17.0).collect();
            let weight: Vec<f64> = (0..3 * e * e).map(|i| ((i * 53 % 97) as f64 - 48.0) / 41.0).collect();
            let bias: Vec<f64> = (0..3 * e).map(|i| i as f64 / 7.0 - 1.0).collect();
            for (segments, rates, mixing) in [
                (vec![6, 9, 12], vec![1, 2, 4], Mixing::HeadGroups),
                (vec![8, 16], vec![2, 4], Mixing::HeadGroups),
                (vec![5, 10], vec![1, 3], Mixing::LongNet),
            ] {
                let cfg =
                    DilatedConfig::builder().segments(&segments).dilations(&rates).mixing(mixing).build().unwrap();
                for b in [None, Some(&bias[..])] {
                    let mut dense = vec![0.0; batch * seq * 3 * e];
                    linear_forward(
                        LinearRef { weight: &weight, bias: b, in_dim: e, out_dim: 3 * e },
                        &x,
                        batch * seq,
                        &mut dense,
                        3 * e,
                    )
                    .unwrap();
                    let mut sparse = vec![0.0; batch * seq * 3 * e];
                    let input = QkvInput { cfg: &cfg, heads, head_dim: hd, x: &x, batch, seq };
                    project_qkv(&input, &weight, b, &mut sparse).unwrap();
                    for bi in 0..batch {
                        for p in 0..seq {
                            for h in 0..heads {
                                let pats = cfg.head_patterns(heads, h).patterns;
                                let used = mixing == Mixing::LongNet || pats.iter().any(|(_, pat)| pat.is_selected(p));
                                for part in 0..3 {
                                    for j in 0..hd {
                                        let at = (bi * seq + p) * 3 * e + part * e + h * hd + j;
                                        if used {
                                            assert!((sparse[at] - dense[at]).abs() <= 1e-9 * dense[at].abs().max(1.0));
                                        } else {
                                            assert_eq!(sparse[at], 0.0, "row {p} head {h} not selected");
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The sparse backward gives the dense products' weight, bias and input gradients
    /// when the gradients of q, k, v vanish outside each group's rows (what attention
    /// produces); LongNet mixing is declined.
    #[test]
    fn sparse_backward_equals_the_dense_products() {
        use crate::projection::{LinearGrad, linear_backward_input, linear_backward_params};
        let (heads, hd, batch) = (5usize, 3usize, 2usize);
        // 1, 2, 3: sequences shorter than some group offsets (no rows selected there).
        for seq in [23usize, 1, 2, 3] {
            let e = heads * hd;
            let x: Vec<f64> = (0..batch * seq * e).map(|i| ((i * 37 % 101) as f64 - 50.0) / 17.0).collect();
            let weight: Vec<f64> = (0..3 * e * e).map(|i| ((i * 53 % 97) as f64 - 48.0) / 41.0).collect();
            for (segments, rates) in [(vec![6, 9, 12], vec![1, 2, 4]), (vec![8, 16], vec![2, 4])] {
                let cfg = DilatedConfig::builder().segments(&segments).dilations(&rates).build().unwrap();
                // dq, dk, dv: arbitrary on selected rows, zero elsewhere.
                let grads: Vec<Vec<f64>> = (0..3)
                    .map(|part| {
                        (0..batch * seq * e)
                            .map(|i| {
                                let (p, h) = ((i / e) % seq, (i % e) / hd);
                                let sel =
                                    cfg.head_patterns(heads, h).patterns.iter().any(|(_, pat)| pat.is_selected(p));
                                if sel { ((i * 31 + part * 7) % 89) as f64 / 13.0 - 3.0 } else { 0.0 }
                            })
                            .collect()
                    })
                    .collect();
                let (mut dw_dense, mut db_dense, mut dx_dense) =
                    (vec![0.5; 3 * e * e], vec![0.25; 3 * e], vec![0.0; batch * seq * e]);
                for part in 0..3 {
                    let (dw, db) =
                        (&mut dw_dense[part * e * e..(part + 1) * e * e], &mut db_dense[part * e..(part + 1) * e]);
                    linear_backward_params(
                        LinearGrad { dweight: dw, dbias: Some(db), in_dim: e, out_dim: e },
                        (&grads[part], e),
                        batch * seq,
                        &x,
                    )
                    .unwrap();
                    let wpart = &weight[part * e * e..(part + 1) * e * e];
                    linear_backward_input(
                        LinearRef { weight: wpart, bias: None, in_dim: e, out_dim: e },
                        (&grads[part], e),
                        batch * seq,
                        &mut dx_dense,
                        part > 0,
                    )
                    .unwrap();
                }
                let (mut dw, mut db, mut dx) = (vec![0.5; 3 * e * e], vec![0.25; 3 * e], vec![0.0; batch * seq * e]);
                let g3 = [&grads[0][..], &grads[1][..], &grads[2][..]];
                let input = QkvInput { cfg: &cfg, heads, head_dim: hd, x: &x, batch, seq };
                let grad = LinearGrad { dweight: &mut dw, dbias: Some(&mut db), in_dim: e, out_dim: 3 * e };
                let done = project_qkv_backward(&input, &weight, g3, grad, &mut dx);
                assert_eq!(done.unwrap(), SparseBackward::Done);
                for (got, want) in [(&dw, &dw_dense), (&db, &db_dense), (&dx, &dx_dense)] {
                    for (a, b) in got.iter().zip(want.iter()) {
                        assert!((a - b).abs() <= 1e-9 * b.abs().max(1.0), "{a} vs {b}");
                    }
                }
            }
            let longnet =
                DilatedConfig::builder().segments(&[4]).dilations(&[2]).mixing(Mixing::LongNet).build().unwrap();
            let (mut dw, mut dx) = (vec![0.0; 3 * e * e], vec![0.0; batch * seq * e]);
            let zeros = vec![0.0; batch * seq * e];
            let g3 = [&zeros[..], &zeros[..], &zeros[..]];
            let input = QkvInput { cfg: &longnet, heads, head_dim: hd, x: &x, batch, seq };
            let grad = LinearGrad { dweight: &mut dw, dbias: None, in_dim: e, out_dim: 3 * e };
            let done = project_qkv_backward(&input, &weight, g3, grad, &mut dx).unwrap();
            assert_eq!(done, SparseBackward::NotApplicable);
        }
    }
}
