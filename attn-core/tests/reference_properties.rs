//! Properties of the float64 reference and the LSE merge (proptest, small sizes).

use attn_core::reference::{self, Forward};
use attn_core::{AttnShape, Causality, DilatedConfig, LseMerge, Masks, Mixing, OnlineSoftmax, Shape4};
use attn_testkit::strategies::{dilated_case, invalid_input};
use attn_testkit::{SeededRng, random_vec};
use proptest::prelude::*;

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    attn_testkit::rel_l2_error(a, b)
}

/// A scalar loss of q, k and v.
type Loss<'a> = &'a dyn Fn(&[f64], &[f64], &[f64]) -> f64;

/// `grads` equal central finite differences of `loss` at six random indices of each of
/// q, k and v.
fn finite_differences(
    loss: Loss<'_>,
    [q, k, v]: [&[f64]; 3],
    grads: [&[f64]; 3],
    seed: u64,
) -> Result<(), TestCaseError> {
    let eps = 1e-6;
    let mut rng = SeededRng::new(seed);
    for _ in 0..6 {
        let idx = rng.range(0, q.len());
        for (which, grad) in grads.into_iter().enumerate() {
            let mut inp = [q.to_vec(), k.to_vec(), v.to_vec()];
            inp[which][idx] += eps;
            let up = loss(&inp[0], &inp[1], &inp[2]);
            inp[which][idx] -= 2.0 * eps;
            let down = loss(&inp[0], &inp[1], &inp[2]);
            let fd = (up - down) / (2.0 * eps);
            prop_assert!(
                (fd - grad[idx]).abs() <= 1e-6 * (1.0 + fd.abs()),
                "tensor {which} idx {idx}: fd {fd} vs {}",
                grad[idx]
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(64), max_shrink_iters: 200, ..ProptestConfig::default() })]

    /// One pattern with w >= n and r = 1 is dense attention.
    #[test]
    fn single_full_pattern_equals_dense(b in 1..3usize, n in 1..40usize, h in 1..4usize, d in 1..9usize,
                                        extra in 0..8usize, causal: bool, seed: u64) {
        let shape = Shape4::new(b, n, h, d).unwrap();
        let s = AttnShape::self_attn(shape);
        let [q, k, v] = [0, 1, 2].map(|i| f64s(&random_vec(seed ^ i, shape.numel())));
        let cfg = DilatedConfig::builder().segments(&[n + extra]).dilations(&[1]).causality(causal.into()).build().unwrap();
        let dil = reference::dilated_forward(&cfg, s, &q, &k, &v).unwrap();
        let dense = reference::dense_forward(s, &q, &k, &v, cfg.scale_for(d), causal.into()).unwrap();
        // HeadGroups with G = 1 divides by 1: identical.
        prop_assert!(rel(&dil.out, &dense.out) < 1e-12);
        prop_assert!(rel(&dil.lse, &dense.lse) < 1e-12);
    }

    /// HeadGroups: a position its group's pattern does not select is exactly 0.
    #[test]
    fn head_groups_unselected_positions_are_zero(case in dilated_case()) {
        prop_assume!(case.cfg.mixing() == Mixing::HeadGroups);
        let [q, k, v, _] = case.inputs().map(|x| f64s(&x));
        let Forward { out, lse } = reference::dilated_forward(&case.cfg, case.attn_shape(), &q, &k, &v).unwrap();
        let sh = case.shape;
        for b in 0..sh.batch { for i in 0..sh.seq { for h in 0..sh.heads {
            let hp = case.cfg.head_patterns(sh.heads, h);
            let (_, p) = hp.patterns[0];
            if !p.is_selected(i) {
                let o = ((b * sh.seq + i) * sh.heads + h) * sh.head_dim;
                prop_assert!(out[o..o + sh.head_dim].iter().all(|&x| x == 0.0));
                prop_assert_eq!(lse[(b * sh.seq + i) * sh.heads + h], f64::NEG_INFINITY);
            }
        }}}
    }

    /// Causal: query 0 (selected, segment 0) attends only key 0, so its output is v[0] * out_scale.
    #[test]
    fn causal_first_query_returns_first_value(case in dilated_case()) {
        let cfg = case.cfg.clone().with_causality(Causality::Causal);
        let [q, k, v, _] = case.inputs().map(|x| f64s(&x));
        let f = reference::dilated_forward(&cfg, case.attn_shape(), &q, &k, &v).unwrap();
        let sh = case.shape;
        for b in 0..sh.batch { for h in 0..sh.heads {
            let hp = cfg.head_patterns(sh.heads, h);
            // Patterns selecting position 0 (offset 0); under LongNet several may, each sees only key 0.
            if hp.patterns.iter().any(|(_, p)| p.is_selected(0)) {
                let o = (b * sh.seq * sh.heads + h) * sh.head_dim;
                for e in 0..sh.head_dim {
                    prop_assert!((f.out[o + e] - hp.out_scale * v[o + e]).abs() < 1e-12);
                }
            }
        }}
    }

    /// The backward equals central finite differences of sum(out * grad_out).
    #[test]
    fn backward_matches_finite_differences(case in attn_testkit::strategies::dilated_case_with(12, 8)) {
        let [q, k, v, go] = case.inputs().map(|x| f64s(&x));
        let s = case.attn_shape();
        let (_, g) = reference::dilated_backward(&case.cfg, s, &q, &k, &v, &go).unwrap();
        let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            let f = reference::dilated_forward(&case.cfg, s, q, k, v).unwrap();
            f.out.iter().zip(&go).map(|(a, b)| a * b).sum()
        };
        finite_differences(&loss, [&q, &k, &v], [&g.dq, &g.dk, &g.dv], case.seed)?;
    }

    /// With a gradient into the LSE, the backward equals central finite differences of
    /// `sum(out * grad_out) + sum(lse * grad_lse)` over the rows that attend something,
    /// and the magnitudes still bound the gradients.
    #[test]
    fn lse_gradient_matches_finite_differences(case in attn_testkit::strategies::dilated_case_with(12, 8)) {
        let [q, k, v, go] = case.inputs().map(|x| f64s(&x));
        let s = case.attn_shape();
        let gl = f64s(&random_vec(case.seed ^ 0x15e, s.q.lse_len()));
        let (fwd, g, m) =
            reference::dilated_backward_lse(&case.cfg, s, Masks::NONE, [&q, &k, &v], &go, Some(&gl)).unwrap();
        let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            let f = reference::dilated_forward(&case.cfg, s, q, k, v).unwrap();
            let lse_part: f64 = f.lse.iter().zip(&gl).filter(|(l, _)| l.is_finite()).map(|(l, g)| l * g).sum();
            f.out.iter().zip(&go).map(|(a, b)| a * b).sum::<f64>() + lse_part
        };
        finite_differences(&loss, [&q, &k, &v], [&g.dq, &g.dk, &g.dv], case.seed)?;
        for (name, x, mx) in [("dq", &g.dq, &m.dq), ("dk", &g.dk, &m.dk)] {
            prop_assert!(x.iter().zip(mx).all(|(a, b)| a.abs() <= b * (1.0 + 1e-12) + 1e-300), "{name}");
        }
        // The LSE's gradient leaves dv alone, and a row that attends nothing takes none
        // of it: NaN there changes nothing.
        let (_, plain) = reference::dilated_backward(&case.cfg, s, &q, &k, &v, &go).unwrap();
        prop_assert_eq!(&g.dv, &plain.dv);
        let nan_there: Vec<f64> = gl.iter().zip(&fwd.lse).map(|(&g, l)| if l.is_finite() { g } else { f64::NAN }).collect();
        let (_, g_nan, _) =
            reference::dilated_backward_lse(&case.cfg, s, Masks::NONE, [&q, &k, &v], &go, Some(&nan_there)).unwrap();
        prop_assert_eq!(&g_nan, &g);
    }

    /// LSE merge: commutative, associative, and merging a split key set equals the whole.
    /// Magnitudes bound their results elementwise and equal them where nothing can
    /// cancel: non-negative values give `|out|`, a non-negative grad_out gives `|dv|`.
    #[test]
    fn magnitudes_bound_their_results(case in dilated_case()) {
        let [q, k, v, go] = case.inputs().map(|x| f64s(&x));
        let s = case.attn_shape();
        let (fwd, g, m) = reference::dilated_backward_with_magnitudes(&case.cfg, s, &q, &k, &v, &go).unwrap();
        for (name, x, mx) in [("out", &fwd.out, &m.out), ("dq", &g.dq, &m.dq), ("dk", &g.dk, &m.dk), ("dv", &g.dv, &m.dv)] {
            prop_assert!(x.iter().zip(mx).all(|(a, b)| a.abs() <= b * (1.0 + 1e-12) + 1e-300), "{name}");
        }
        let (va, ga) = (v.iter().map(|x| x.abs()).collect::<Vec<_>>(), go.iter().map(|x| x.abs()).collect::<Vec<_>>());
        let (fa, gpos, ma) = reference::dilated_backward_with_magnitudes(&case.cfg, s, &q, &k, &va, &ga).unwrap();
        prop_assert!(rel(&fa.out, &ma.out) < 1e-12 && rel(&gpos.dv, &ma.dv) < 1e-12);
    }

    #[test]
    fn lse_merge_laws(d in 1..9usize, sizes in prop::collection::vec(0..6usize, 3), seed: u64) {
        let mut rng = SeededRng::new(seed);
        let mut parts = vec![];
        let mut whole = OnlineSoftmax::<f64>::new(d);
        for &m in &sizes {
            let mut part = OnlineSoftmax::<f64>::new(d);
            for _ in 0..m {
                let s = 3.0 * rng.normal();
                let row: Vec<f64> = (0..d).map(|_| rng.normal()).collect();
                part.push(s, &row);
                whole.push(s, &row);
            }
            let mut o = vec![0.0; d];
            let l = part.finish(&mut o);
            parts.push((o, l));
        }
        let merge = |a: &(Vec<f64>, f64), b: &(Vec<f64>, f64)| {
            let (mut o, mut l) = a.clone();
            LseMerge::merge_into(&mut o, &mut l, &b.0, b.1);
            (o, l)
        };
        let ab = merge(&parts[0], &parts[1]);
        let ba = merge(&parts[1], &parts[0]);
        let close = |x: &(Vec<f64>, f64), y: &(Vec<f64>, f64)| {
            let lse_ok = (x.1 == f64::NEG_INFINITY && y.1 == f64::NEG_INFINITY) || (x.1 - y.1).abs() < 1e-12;
            lse_ok && x.0.iter().zip(&y.0).all(|(a, b)| (a - b).abs() < 1e-12 && a.is_finite())
        };
        prop_assert!(close(&ab, &ba));
        let left = merge(&ab, &parts[2]);
        let right = merge(&parts[0], &merge(&parts[1], &parts[2]));
        prop_assert!(close(&left, &right));
        let mut o = vec![0.0; d];
        let l = whole.finish(&mut o);
        prop_assert!(close(&left, &(o, l)));
    }

    /// Every invalid config or shape is a typed error, never a panic.
    #[test]
    fn invalid_inputs_are_errors(input in invalid_input()) {
        prop_assert!(input.validate().is_err(), "{input:?} was accepted");
    }

    /// The reference rejects a head count below G in HeadGroups mode and wrong buffer sizes.
    #[test]
    fn reference_rejects_bad_calls(case in dilated_case()) {
        let [q, k, v, _] = case.inputs().map(|x| f64s(&x));
        let s = case.attn_shape();
        prop_assert!(reference::dilated_forward(&case.cfg, s, &q[1..], &k, &v).is_err());
        prop_assert!(reference::dilated_forward(&case.cfg, s, &q, &k, &v[..v.len() - 1]).is_err());
    }
}

#[test]
fn longnet_merges_patterns_by_their_denominators() {
    // A direct check of SPEC's LongNet rule: out = sum_i exp(lse_i - lse) o_i with per-pattern results.
    let shape = Shape4::new(1, 12, 2, 4).unwrap();
    let s = AttnShape::self_attn(shape);
    let [q, k, v] = [1u64, 2, 3].map(|i| f64s(&random_vec(i, shape.numel())));
    let cfg = DilatedConfig::builder().segments(&[4, 12]).dilations(&[1, 2]).mixing(Mixing::LongNet).build().unwrap();
    let whole = reference::dilated_forward(&cfg, s, &q, &k, &v).unwrap();
    let per = |w: usize, r: usize, h: usize| {
        // Pattern (w, r) with offset h mod r, run as a one-pattern HeadGroups config on head h only.
        let mut o = vec![0.0; 12 * 4];
        let mut l = vec![f64::NEG_INFINITY; 12];
        let p = attn_core::SegmentPattern::new(w, r, h % r);
        for i in 0..12 {
            let keys: Vec<usize> = p.keys_of(i, 12, Causality::Full).collect();
            let at = |t: &[f64], j: usize| t[(j * 2 + h) * 4..(j * 2 + h) * 4 + 4].to_vec();
            let sc: Vec<f64> =
                keys.iter().map(|&j| 0.5 * at(&q, i).iter().zip(at(&k, j)).map(|(a, b)| a * b).sum::<f64>()).collect();
            if sc.is_empty() {
                continue;
            }
            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
            l[i] = m + z.ln();
            for (&j, &x) in keys.iter().zip(&sc) {
                for e in 0..4 {
                    o[i * 4 + e] += (x - l[i]).exp() * at(&v, j)[e];
                }
            }
        }
        (o, l)
    };
    for h in 0..2 {
        let (o1, l1) = per(4, 1, h);
        let (o2, l2) = per(12, 2, h);
        for i in 0..12 {
            let lse = (l1[i].exp() + l2[i].exp()).ln();
            let at = ((i * 2) + h) * 4;
            assert!((whole.lse[i * 2 + h] - lse).abs() < 1e-12);
            for e in 0..4 {
                let want = (l1[i] - lse).exp() * o1[i * 4 + e] + (l2[i] - lse).exp() * o2[i * 4 + e];
                assert!((whole.out[at + e] - want).abs() < 1e-12);
            }
        }
    }
}

/// The finite-difference check bites: the reference's own gradients pass it, and the same
/// gradients with dk off by 1e-4 in every value (so each sampled index sees it) fail.
#[test]
fn finite_differences_reject_a_planted_gradient_error() {
    let cfg = DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).build().unwrap();
    let shape = Shape4::new(1, 8, 2, 4).unwrap();
    let s = AttnShape::self_attn(shape);
    let [q, k, v, go] = [0u64, 1, 2, 3].map(|i| f64s(&random_vec(70 + i, shape.numel())));
    let (_, g, _) = reference::dilated_backward_lse(&cfg, s, Masks::NONE, [&q, &k, &v], &go, None).unwrap();
    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        let f = reference::dilated_forward(&cfg, s, q, k, v).unwrap();
        f.out.iter().zip(&go).map(|(a, b)| a * b).sum()
    };
    finite_differences(&loss, [&q, &k, &v], [&g.dq, &g.dk, &g.dv], 5).unwrap();
    let wrong: Vec<f64> = g.dk.iter().map(|x| x + 1e-4).collect();
    let e = finite_differences(&loss, [&q, &k, &v], [&g.dq, &wrong, &g.dv], 5).expect_err("a wrong dk passed");
    assert!(e.to_string().contains("tensor 1"), "{e}");
}
