//! Dilated attention written as a plain burn composition, from docs/definition.md and
//! independent of the kernels: per (batch, head) the scores `q kᵀ · scale`, one explicit
//! boolean mask per pattern (segment, selection, causality, window, padding, packed
//! sequence) applied with `mask_fill`, the patterns' masked scores side by side under one
//! softmax (LongNet's concatenation of key sets; one pattern and a 1/G factor in head
//! groups), and the weights times the values. Differentiable by burn's own autodiff.

use attn_core::{DilatedConfig, Mixing};
use burn_tensor::activation::softmax;
use burn_tensor::{Bool, Tensor, TensorData};

use super::{Attended, values};

/// A score that stands for "not allowed": its softmax weight is exactly 0 in f32.
const MASKED: f32 = -1e30;

/// The masks of a call: key padding (`[batch, key_seq]` flags) and packed sequences.
#[derive(Debug, Clone, Default)]
pub struct Masking {
    pub padding: Option<Vec<bool>>,
    pub cu_seqlens: Option<Vec<usize>>,
}

/// A dilated pattern: segment length, rate, offset.
type Pattern = (usize, usize, usize);

/// The patterns query head `j` of `heads` runs (`None`: the window) and its factor.
fn head_patterns(cfg: &DilatedConfig, heads: usize, j: usize) -> (Vec<Option<Pattern>>, f32) {
    let (w, r) = (cfg.segment_lengths(), cfg.dilation_rates());
    let g = w.len();
    match cfg.mixing() {
        Mixing::Window => (vec![None], 1.0),
        Mixing::LongNet => ((0..g).map(|i| Some((w[i], r[i], j % r[i]))).collect(), 1.0),
        Mixing::HeadGroups => {
            let (b, e) = (heads / g, heads % g);
            // Groups 0..e hold b + 1 heads, the others b.
            let sizes = (0..g).map(|i| if i < e { b + 1 } else { b });
            let ends: Vec<usize> = sizes.scan(0, |acc, s| Some(*acc + s).inspect(|&x| *acc = x)).collect();
            let i = ends.iter().position(|&end| j < end).expect("head in a group");
            (vec![Some((w[i], r[i], i % r[i]))], 1.0 / g as f32)
        }
    }
}

/// Whether query `p` of batch row `b` may attend key `t` (global positions).
fn allowed(cfg: &DilatedConfig, pattern: Option<Pattern>, m: &Masking, key_seq: usize, [b, p, t]: [usize; 3]) -> bool {
    if m.padding.as_ref().is_some_and(|f| f[b * key_seq + t]) {
        return false;
    }
    // Positions relative to the packed sequence holding them.
    let (mut pp, mut tt) = (p, t);
    if let Some(cu) = &m.cu_seqlens {
        let seq_of = |x: usize| cu.iter().rposition(|&c| c <= x).expect("cu_seqlens starts at 0");
        if seq_of(p) != seq_of(t) {
            return false;
        }
        let start = cu[seq_of(p)];
        (pp, tt) = (p - start, t - start);
    }
    if cfg.causal() && tt > pp {
        return false;
    }
    match pattern {
        None => {
            let win = cfg.window().expect("window mode");
            tt + win.left >= pp && tt <= pp + win.right
        }
        Some((w, r, off)) => {
            let selected = |x: usize| x % w >= off && (x % w - off).is_multiple_of(r);
            pp / w == tt / w && selected(pp) && selected(tt)
        }
    }
}

/// How the composition scales scores: the config's scale, or a planted wrong one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scale {
    Config,
    Planted(f64),
}

/// Out and LSE of q `[b, n, h, d]` against k, v `[b, m, kv_heads, d]`, both
/// differentiable (the LSE `[b, n, h]` as a log of summed exponentials; 0 and no gradient
/// on rows without a key), with the LSE's values summed in f64 (`-inf` on those rows).
pub fn compose(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, cfg: &DilatedConfig, m: &Masking, scale: Scale) -> Attended {
    let [batch, n, heads, d] = q.dims();
    let [_, key_seq, kv_heads, _] = k.dims();
    let device = q.device();
    let per_kv = heads / kv_heads;
    let scale = match scale {
        Scale::Config => cfg.scale_for(d),
        Scale::Planted(s) => s,
    };
    let mut lse = vec![f32::NEG_INFINITY; batch * n * heads];
    let mut rows = Vec::with_capacity(batch);
    let mut lse_rows = Vec::with_capacity(batch);
    let head = |t: &Tensor<4>, b: usize, h: usize, len: usize| {
        t.clone().slice([b..b + 1, 0..len, h..h + 1, 0..d]).reshape([len, d])
    };
    for b in 0..batch {
        let mut outs = Vec::with_capacity(heads);
        let mut lses = Vec::with_capacity(heads);
        for j in 0..heads {
            let (qh, kh, vh) = (head(&q, b, j, n), head(&k, b, j / per_kv, key_seq), head(&v, b, j / per_kv, key_seq));
            let scores = qh.matmul(kh.transpose()) * scale;
            let (patterns, factor) = head_patterns(cfg, heads, j);
            let mut any = vec![0f32; n];
            let mut blocks = Vec::with_capacity(patterns.len());
            for &pattern in &patterns {
                let mut refused = vec![false; n * key_seq];
                for p in 0..n {
                    for t in 0..key_seq {
                        if allowed(cfg, pattern, m, key_seq, [b, p, t]) {
                            any[p] = 1.0;
                        } else {
                            refused[p * key_seq + t] = true;
                        }
                    }
                }
                let mask = Tensor::<2, Bool>::from_data(TensorData::new(refused, [n, key_seq]), &device);
                blocks.push(scores.clone().mask_fill(mask, MASKED));
            }
            let s = Tensor::cat(blocks, 1);
            let vals = Tensor::cat(vec![vh; patterns.len()], 0);
            let weights = softmax(s.clone(), 1);
            // A query with no key anywhere has output 0 (and lse -inf).
            let any_t = Tensor::<2>::from_data(TensorData::new(any.clone(), [n, 1]), &device);
            outs.push((weights * any_t).matmul(vals).mul_scalar(factor).reshape([1, n, 1, d]));
            let row_max = s.clone().max_dim(1);
            let lse_t = (s.clone() - row_max.clone()).exp().sum_dim(1).log() + row_max;
            let none = any.iter().map(|&a| a == 0.0).collect::<Vec<_>>();
            let none = Tensor::<2, Bool>::from_data(TensorData::new(none, [n, 1]), &device);
            lses.push(lse_t.mask_fill(none, 0.0).reshape([1, n, 1]));
            let width = s.dims()[1];
            for (p, row) in values(s).chunks(width).enumerate() {
                if any[p] > 0.0 {
                    let live: Vec<f64> = row.iter().filter(|&&x| x > MASKED / 2.0).map(|&x| f64::from(x)).collect();
                    let mx = live.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    lse[(b * n + p) * heads + j] = (mx + live.iter().map(|x| (x - mx).exp()).sum::<f64>().ln()) as f32;
                }
            }
        }
        rows.push(Tensor::cat(outs, 2));
        lse_rows.push(Tensor::cat(lses, 2));
    }
    Attended { out: Tensor::cat(rows, 0), lse: Tensor::cat(lse_rows, 0), lse_values: lse }
}
