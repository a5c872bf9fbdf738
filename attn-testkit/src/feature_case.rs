//! proptest strategy for the attention features: grouped key/value heads, key padding,
//! packed sequences and sliding windows, mixed with every mode, causal or not.

use attn_core::{AttnShape, DilatedConfig, DilatedConfigBuilder, KeyPadding, Masks, Mixing, PackedSequences, Shape4};
use proptest::prelude::*;

use crate::problem::Problem;
use crate::rng::random_vec;

/// A valid feature case: config, shapes (k/v may have fewer heads), an optional key
/// padding mask (`[batch, seq]`), optional packed sequences, and an input seed.
#[derive(Debug, Clone)]
pub struct FeatureCase {
    pub cfg: DilatedConfig,
    pub shape: AttnShape,
    pub padding: Option<Vec<bool>>,
    pub cu_seqlens: Option<Vec<usize>>,
    pub seed: u64,
}

impl FeatureCase {
    /// The case's masks (borrowing its mask data).
    pub fn masks(&self) -> Masks<'_> {
        let s = self.shape.kv;
        let key_padding = self.padding.as_deref().map(|f| KeyPadding::new(f, s.batch, s.seq).expect("sized mask"));
        let packing = self.cu_seqlens.as_deref().map(|c| PackedSequences::new(c).expect("valid cu_seqlens"));
        Masks { key_padding, packing, ..Masks::NONE }
    }

    /// The problem the case describes.
    pub fn problem(&self) -> Problem<'_> {
        Problem::new(&self.cfg, self.shape).with_masks(self.masks())
    }

    /// A seeded gradient into the LSE (`[batch, seq, heads]`, standard normal).
    pub fn grad_lse(&self) -> Vec<f32> {
        random_vec(self.seed ^ 0x9e37_79b9_7f4a_7c15, self.shape.q.lse_len())
    }

    /// Seeded q, k, v (k and v of the key/value shape), grad_out (standard normal).
    pub fn inputs(&self) -> [Vec<f32>; 4] {
        let (nq, nk) = (self.shape.q.numel(), self.shape.kv.numel());
        [nq, nk, nk, nq]
            .iter()
            .enumerate()
            .map(|(i, &n)| random_vec(self.seed.wrapping_mul(4) + i as u64, n))
            .collect::<Vec<_>>()
            .try_into()
            .expect("four inputs")
    }
}

/// Which attention a case runs.
#[derive(Debug, Clone, Copy)]
enum Mode {
    Dilated(Mixing),
    Window(usize, usize),
}

fn mode(max_w: usize) -> impl Strategy<Value = (Mode, Vec<(usize, usize)>)> {
    let pats = prop::collection::vec((1..=max_w).prop_flat_map(|w| (Just(w), 1..=w.min(4))), 1..=3);
    prop_oneof![
        (pats.clone(), any::<bool>())
            .prop_map(|(p, ln)| { (Mode::Dilated(if ln { Mixing::LongNet } else { Mixing::HeadGroups }), p) }),
        (0..=max_w, 0..=max_w).prop_map(|(l, r)| (Mode::Window(l, r), vec![])),
    ]
}

/// `n` tokens split into 1 to 4 sequences at the drawn cut points.
fn cu_seqlens(n: usize, cuts: &[usize]) -> Vec<usize> {
    let mut cu: Vec<usize> = cuts.iter().map(|c| 1 + c % n.max(1)).filter(|&c| c < n).collect();
    cu.extend([0, n]);
    cu.sort_unstable();
    cu.dedup();
    cu
}

/// Valid feature cases with a sequence length in `seq`, segments and windows up to
/// `max_w`, head dims from `head_dims`. Each feature is drawn independently (so cases
/// mix them): grouped heads (1-3 query heads per key/value head), a key padding mask
/// (each key padded with probability 0.1-0.6, so some rows see no key), packed
/// sequences (1-4, batch 1), causal, an explicit scale.
pub fn feature_case(
    seq: std::ops::RangeInclusive<usize>,
    max_w: usize,
    head_dims: Vec<usize>,
) -> impl Strategy<Value = FeatureCase> {
    (mode(max_w), any::<bool>(), prop::option::weighted(0.2, 0.05f64..2.0), 1..=3usize, 1..=3usize)
        .prop_flat_map(move |((mode, pats), causal, scale, kv_heads, group)| {
            let builder = DilatedConfig::builder().causality(causal.into()).maybe_scale(scale);
            let (cfg, g) = match mode {
                Mode::Dilated(mixing) => {
                    let (w, r): (Vec<usize>, Vec<usize>) = pats.iter().copied().unzip();
                    (
                        builder.segments(&w).dilations(&r).mixing(mixing).build(),
                        if mixing == Mixing::HeadGroups { pats.len() } else { 1 },
                    )
                }
                Mode::Window(l, r) => (builder.window(l, r).build(), 1),
            };
            let cfg = cfg.expect("strategy builds valid configs");
            // Enough query heads for every head group, a whole number per key/value head.
            let kv_heads = kv_heads.max(g.div_ceil(group));
            let packed = any::<bool>();
            let padded = prop::option::weighted(0.5, 0.1f64..0.6);
            (
                Just(cfg),
                Just((kv_heads, group)),
                seq.clone(),
                prop::sample::select(head_dims.clone()),
                packed,
                padded,
                1..=2usize,
                prop::collection::vec(any::<usize>(), 0..4),
                any::<u64>(),
            )
        })
        .prop_map(|(cfg, (kv_heads, group), n, d, packed, padded, batch, cuts, seed)| {
            let batch = if packed { 1 } else { batch };
            let q = Shape4::new(batch, n, kv_heads * group, d).expect("small shape");
            let kv = Shape4::new(batch, n, kv_heads, d).expect("small shape");
            let shape = AttnShape { q, kv };
            let cu_seqlens = packed.then(|| cu_seqlens(n, &cuts));
            let padding = padded.map(|p| {
                let u = random_vec(seed ^ 0x5eed, batch * n);
                // A standard normal below the p-quantile, roughly: pad when |x| > z.
                let z = (1.0 - p) * 1.6;
                u.iter().map(|x| f64::from(x.abs()) > z).collect()
            });
            FeatureCase { cfg, shape, padding, cu_seqlens, seed }
        })
}

/// Problems with head dims 64 and 128 (the conformance files have 8 to 32), for kernel
/// instances that start there: dilated affine tiles with a ragged last segment (head dim
/// 128), causal dilated attention with grouped heads, key padding and packed sequences,
/// and a causal window with grouped heads and key padding (head dim 64).
pub fn wide_head_cases() -> Vec<(&'static str, FeatureCase)> {
    let gqa =
        AttnShape { q: Shape4::new(1, 300, 4, 64).expect("shape"), kv: Shape4::new(1, 300, 2, 64).expect("shape") };
    let padding: Vec<bool> = (0..300).map(|i| i % 37 == 5).collect();
    let config = |b: DilatedConfigBuilder| b.build().expect("valid config");
    vec![
        (
            "affine tiles, d128",
            FeatureCase {
                cfg: config(DilatedConfig::builder().segments(&[256, 512]).dilations(&[2, 4])),
                shape: AttnShape::self_attn(Shape4::new(1, 1000, 2, 128).expect("shape")),
                padding: None,
                cu_seqlens: None,
                seed: 2027,
            },
        ),
        (
            "causal dilated, gqa, padding, packed, d64",
            FeatureCase {
                cfg: config(DilatedConfig::builder().segments(&[64, 128]).dilations(&[1, 2]).causal()),
                shape: gqa,
                padding: Some(padding.clone()),
                cu_seqlens: Some(vec![0, 130, 300]),
                seed: 2026,
            },
        ),
        (
            "causal window, gqa, padding, d64",
            FeatureCase {
                cfg: config(DilatedConfig::builder().window(70, 0).causal()),
                shape: gqa,
                padding: Some(padding),
                cu_seqlens: None,
                seed: 2026,
            },
        ),
    ]
}

/// A case whose selected queries include rows that attend nothing (their LSE is `-inf`):
/// every key of two segments padded, head dim 64 (the tensor-core kernels). The backward
/// kernels visit those rows, so a gradient into the LSE there must be ignored.
pub fn unattended_rows_case() -> FeatureCase {
    let cfg = DilatedConfig::builder().segments(&[16, 32]).dilations(&[1, 2]).build().expect("valid config");
    let shape = AttnShape::self_attn(Shape4::new(1, 96, 2, 64).expect("shape"));
    // Positions 16..48 padded: head 0 (w 16, r 1) selects rows 16..48, none with a key.
    let padding = Some((0..96).map(|i| (16..48).contains(&i)).collect());
    FeatureCase { cfg, shape, padding, cu_seqlens: None, seed: 2028 }
}

/// `backend`'s gradients on `case` judged row by row against the float64 reference on the
/// inputs rounded to the backend's dtype.
pub fn judge_gradients(backend: &dyn crate::golden::DilatedBackend, case: &FeatureCase) -> Result<(), String> {
    use crate::judge::{Expected, judge_backward, round_to, verdict};
    let dtype = backend.dtype();
    let p = case.problem();
    let [q, k, v, go] = case.inputs();
    let r = [&q, &k, &v, &go].map(|x| round_to(dtype, x).into_iter().map(f64::from).collect::<Vec<_>>());
    let want = Expected::for_problem(&p, [&r[0], &r[1], &r[2]], Some(&r[3])).map_err(|e| e.to_string())?;
    let g = backend.backward(&p, [&q, &k, &v], &go).map_err(|e| e.to_string())?;
    verdict(&judge_backward(&want, [&g.dq, &g.dk, &g.dv], dtype))
}

/// [`judge_gradients`] with a gradient into the LSE ([`FeatureCase::grad_lse`], NaN on
/// the rows that attend nothing, which take no gradient from their LSE whatever it is):
/// the backend's `dq, dk, dv` of `sum(out * grad_out) + sum(lse * grad_lse)`.
pub fn judge_lse_gradients(backend: &dyn crate::golden::DilatedBackend, case: &FeatureCase) -> Result<(), String> {
    use crate::judge::{Expected, judge_backward, round_to, verdict};
    let dtype = backend.dtype();
    let p = case.problem();
    let [q, k, v, go] = case.inputs();
    let r = [&q, &k, &v, &go].map(|x| round_to(dtype, x).into_iter().map(f64::from).collect::<Vec<_>>());
    let fwd = attn_core::reference::dilated_forward_masked(p.cfg, p.shape, p.masks, [&r[0], &r[1], &r[2]])
        .map_err(|e| e.to_string())?;
    let mut gl = case.grad_lse();
    gl.iter_mut().zip(&fwd.lse).filter(|(_, l)| !l.is_finite()).for_each(|(g, _)| *g = f32::NAN);
    let gl64: Vec<f64> = gl.iter().map(|&x| f64::from(x)).collect();
    let want = Expected::for_problem_lse(&p, [&r[0], &r[1], &r[2]], &r[3], &gl64).map_err(|e| e.to_string())?;
    let g = backend.backward_lse(&p, [&q, &k, &v], &go, &gl).map_err(|e| e.to_string())?;
    verdict(&judge_backward(&want, [&g.dq, &g.dk, &g.dv], dtype)).map_err(|e| format!("with grad_lse: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cu_seqlens_are_valid() {
        for n in 1..20 {
            for cuts in [vec![], vec![3], vec![0, 7, 7, 100]] {
                let cu = cu_seqlens(n, &cuts);
                assert!(PackedSequences::new(&cu).is_ok() && cu[cu.len() - 1] == n, "{n} {cuts:?} {cu:?}");
            }
        }
    }
}
