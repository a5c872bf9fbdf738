//! Numerics under attack on the CPU backend (checked against the float64 reference):
//! finite inputs give finite outputs even with inputs scaled by 1e3, fully masked rows
//! are exactly zero with `lse = -inf`, and subnormal inputs stay finite and accurate.

use attn_core::reference;
use attn_core::{AttnError, AttnShape, Band, Causality, DilatedConfig, Element, Mixing, SegmentPattern, Shape4};
use attn_kernels::{Block, BlockRows, CpuBackend, attend_block};
use attn_reliability::readers::{has_keys, row_index};
use attn_testkit::judge::{self, Expected};
use attn_testkit::rng::random_vec;
use attn_testkit::strategies::{DilatedCase, dilated_case};
use attn_testkit::tolerance::{Tolerance, rel_l2_error};
use half::f16;
use proptest::prelude::*;

fn cpu() -> CpuBackend {
    CpuBackend::new(2).expect("cpu backend")
}

fn to64<T: Element>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

fn scaled(x: &[f32], s: f32) -> Vec<f32> {
    x.iter().map(|v| v * s).collect()
}

/// Forward and backward of one case on the CPU backend with inputs scaled by `mag`;
/// every output finite (lse `-inf` exactly where a row has no keys), each output row a
/// convex combination of its value rows (times `out_scale`).
fn check_finite_case(case: &DilatedCase, mag: f32) -> Result<(), TestCaseError> {
    let [q, k, v, go] = case.inputs();
    let (q, k) = (scaled(&q, mag), scaled(&k, mag));
    let s = case.shape;
    let cpu = cpu();
    let (out, lse) = cpu.forward_vec(&case.cfg, s, &q, &k, &v).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let (dq, dk, dv) = cpu
        .backward_vec(&case.cfg, s, [&q, &k, &v], &out, &lse, &go)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert!(out.iter().all(|x| x.is_finite()), "non-finite out at mag {mag}");
    prop_assert!(dq.iter().chain(&dk).chain(&dv).all(|x| x.is_finite()), "non-finite gradient at mag {mag}");
    let vmax = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    // f32 scores of size S carry absolute errors of about eps * S, so softmax weights
    // (and LongNet's merge weights) are off by that relative amount: the convex-hull
    // bound gets exactly that slack, no more.
    let slack = 1e-5 + 8.0 * f32::EPSILON as f64 * max_score(&case.cfg, s, &q, &k);
    for b in 0..s.batch {
        for i in 0..s.seq {
            for h in 0..s.heads {
                let r = row_index(s.seq, s.heads, b, i, h);
                let keyed = has_keys(&case.cfg, s.heads, h, i, s.seq);
                prop_assert!(
                    if keyed { lse[r].is_finite() } else { lse[r] == f32::NEG_INFINITY },
                    "lse[{r}] = {} (row has keys: {keyed})",
                    lse[r]
                );
                let bound = case.cfg.head_patterns(s.heads, h).out_scale * f64::from(vmax) * (1.0 + slack);
                let row = &out[r * s.head_dim..][..s.head_dim];
                prop_assert!(
                    row.iter().all(|x| f64::from(x.abs()) <= bound),
                    "row {r} = {row:?} outside the convex hull bound {bound} (slack {slack:e})"
                );
            }
        }
    }
    if mag == 1.0 {
        let want = reference::dilated_forward(&case.cfg, case.attn_shape(), &to64(&q), &to64(&k), &to64(&v))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let err = rel_l2_error(&out, &want.out);
        prop_assert!(Tolerance::for_dtype(attn_core::DType::F32).accepts(err), "rel error {err:e}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(64), max_shrink_iters: 64, ..ProptestConfig::default() })]

    #[test]
    fn finite_inputs_give_finite_outputs(case in dilated_case(), big in any::<bool>()) {
        check_finite_case(&case, if big { 1e3 } else { 1.0 })?;
    }
}

use attn_reliability::fuzz_targets::max_abs_score as max_score;

#[test]
fn scores_up_to_the_edge_of_f32_stay_finite() {
    // Magnitudes whose largest score (computed in f64) stays below f32::MAX / 4: the
    // kernel may not overflow in its dot products or exponentials.
    let cfg = DilatedConfig::builder().segments(&[8, 16]).dilations(&[1, 2]).mixing(Mixing::LongNet).build().unwrap();
    let s = Shape4::new(1, 32, 2, 16).unwrap();
    let n = s.numel();
    let (q0, k0, v) = (random_vec(11, n), random_vec(12, n), random_vec(13, n));
    let cpu = cpu();
    let mut tried = 0;
    for mag in [1e3f32, 1e6, 1e9, 1e12, 1e15, 1e17, 1e18] {
        let (q, k) = (scaled(&q0, mag), scaled(&k0, mag));
        if max_score(&cfg, s, &q, &k) >= f64::from(f32::MAX) / 4.0 {
            continue;
        }
        tried += 1;
        for causal in [Causality::Full, Causality::Causal] {
            let c = cfg.clone().with_causality(causal);
            let (out, lse) = cpu.forward_vec(&c, s, &q, &k, &v).unwrap();
            assert!(out.iter().all(|x| x.is_finite()), "mag {mag} {causal:?}: non-finite out");
            assert!(lse.iter().all(|x| x.is_finite()), "mag {mag} {causal:?}: non-finite lse");
        }
    }
    assert!(tried >= 5, "only {tried} magnitudes were below the overflow edge");
}

/// Found by the `config_shape` fuzzer (scale 1.4e38): when `|scale * q.k|` can exceed
/// f32::MAX the CPU backend refuses the call with `ScoreOverflow` instead of returning NaN.
#[test]
fn scores_beyond_f32_are_refused_or_finite() {
    let s = Shape4::new(1, 16, 1, 4).unwrap();
    let n = s.numel();
    let (q, k, v) = (random_vec(41, n), random_vec(42, n), random_vec(43, n));
    let cfg = DilatedConfig::builder().segments(&[8]).dilations(&[1]).scale(1e38).build().unwrap();
    assert!(max_score(&cfg, s, &q, &k) > f64::from(f32::MAX), "fixture must overflow f32");
    match cpu().forward_vec(&cfg, s, &q, &k, &v) {
        Err(e) => assert!(matches!(e, AttnError::ScoreOverflow { .. }), "refused with the wrong error: {e}"),
        Ok((out, _)) => assert!(out.iter().all(|x| x.is_finite()), "finite inputs and scale gave NaN/Inf outputs"),
    }
}

#[test]
fn rows_without_keys_are_exact_zeros_with_neg_inf_lse() {
    // HeadGroups: group 1 runs offset 1 with rate 4, so 3 of every 4 positions of its
    // heads are selected by nothing; LongNet with one rate-4 pattern leaves holes per head.
    let cfgs = [
        DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 4]).causal().build().unwrap(),
        DilatedConfig::builder().segments(&[8]).dilations(&[4]).mixing(Mixing::LongNet).build().unwrap(),
        DilatedConfig::builder()
            .segments(&[6, 12])
            .dilations(&[3, 4])
            .mixing(Mixing::LongNet)
            .causal()
            .build()
            .unwrap(),
    ];
    let s = Shape4::new(2, 21, 3, 8).unwrap();
    let n = s.numel();
    let (q, k, v, go) = (random_vec(1, n), random_vec(2, n), random_vec(3, n), random_vec(4, n));
    let cpu = cpu();
    for cfg in &cfgs {
        let (out, lse) = cpu.forward_vec(cfg, s, &q, &k, &v).unwrap();
        let (dq, _, _) = cpu.backward_vec(cfg, s, [&q, &k, &v], &out, &lse, &go).unwrap();
        let want = reference::dilated_forward(cfg, AttnShape::self_attn(s), &to64(&q), &to64(&k), &to64(&v)).unwrap();
        let mut empty = 0;
        for b in 0..s.batch {
            for i in 0..s.seq {
                for h in 0..s.heads {
                    let r = row_index(s.seq, s.heads, b, i, h);
                    let row = r * s.head_dim..(r + 1) * s.head_dim;
                    if has_keys(cfg, s.heads, h, i, s.seq) {
                        assert!(lse[r].is_finite());
                        continue;
                    }
                    empty += 1;
                    assert_eq!(lse[r], f32::NEG_INFINITY, "{cfg:?}: lse of empty row {r}");
                    assert_eq!(want.lse[r], f64::NEG_INFINITY);
                    assert!(out[row.clone()].iter().all(|&x| x == 0.0), "{cfg:?}: empty row {r} not zero");
                    assert!(dq[row].iter().all(|&x| x == 0.0), "{cfg:?}: dq of empty row {r} not zero");
                }
            }
        }
        assert!(empty > 0, "{cfg:?} has no empty rows: the test would prove nothing");
        assert!(Tolerance::for_dtype(attn_core::DType::F32).accepts(rel_l2_error(&out, &want.out)));
    }
}

#[test]
fn block_with_every_key_masked_leaves_the_partial_untouched() {
    // Causal: queries 0..4 against keys 8..12 of the same segment: no query sees a key.
    let p = SegmentPattern::new(16, 1, 0);
    let d = 4;
    let (qd, kd, vd) = (random_vec(1, 4 * d), random_vec(2, 4 * d), random_vec(3, 4 * d));
    let (qp, kp) = ([0usize, 1, 2, 3], [8usize, 9, 10, 11]);
    let (q, k, v) = (BlockRows::new(&qd, d, &qp), BlockRows::new(&kd, d, &kp), BlockRows::new(&vd, d, &kp));
    let mut out = vec![0.0f32; 4 * d];
    let mut lse = vec![f32::NEG_INFINITY; 4];
    attend_block(&Block::new(&p, Band::CAUSAL, 0.5, d, [q, k, v]), &mut out, &mut lse).unwrap();
    assert!(out.iter().all(|&x| x == 0.0) && lse.iter().all(|&l| l == f32::NEG_INFINITY));
    // An empty key block, and a block in another segment, change nothing either.
    let none: [usize; 0] = [];
    let e = BlockRows::new(&kd[..0], d, &none);
    attend_block(&Block::new(&p, Band::FULL, 0.5, d, [q, e, e]), &mut out, &mut lse).unwrap();
    let far = [16usize, 17, 18, 19];
    let (kf, vf) = (BlockRows::new(&kd, d, &far), BlockRows::new(&vd, d, &far));
    attend_block(&Block::new(&p, Band::FULL, 0.5, d, [q, kf, vf]), &mut out, &mut lse).unwrap();
    assert!(out.iter().all(|&x| x == 0.0) && lse.iter().all(|&l| l == f32::NEG_INFINITY));
}

#[test]
fn subnormal_inputs_stay_finite_and_accurate() {
    let cfg = DilatedConfig::builder()
        .segments(&[8, 16])
        .dilations(&[1, 2])
        .mixing(Mixing::LongNet)
        .causal()
        .build()
        .unwrap();
    let s = Shape4::new(1, 32, 2, 8).unwrap();
    let n = s.numel();
    let (q0, k0, v0, go) = (random_vec(21, n), random_vec(22, n), random_vec(23, n), random_vec(24, n));
    let cpu = cpu();
    // f32: q and k subnormal (1e-40), then v subnormal too.
    for (qs, vs) in [(1e-40f32, 1.0f32), (1e-40, 1e-40), (1.0, 1e-41)] {
        let (q, k, v) = (scaled(&q0, qs), scaled(&k0, qs), scaled(&v0, vs));
        assert!(q.iter().chain(&v).any(|x| x.is_subnormal()), "fixture has no subnormals");
        let (out, lse) = cpu.forward_vec(&cfg, s, &q, &k, &v).unwrap();
        let (dq, dk, dv) = cpu.backward_vec(&cfg, s, [&q, &k, &v], &out, &lse, &go).unwrap();
        assert!(out.iter().chain(&lse).chain(&dq).chain(&dk).chain(&dv).all(|x| x.is_finite()));
        let want = reference::dilated_forward(&cfg, AttnShape::self_attn(s), &to64(&q), &to64(&k), &to64(&v)).unwrap();
        // Relative to the size of v: a subnormal v may lose its low bits (flush-to-zero).
        let abs = out.iter().zip(&want.out).fold(0.0f64, |m, (g, w)| m.max((f64::from(*g) - w).abs()));
        assert!(abs <= 1e-5 * f64::from(vs) * 4.0 + 1e-44, "q,k x{qs} v x{vs}: max abs error {abs:e}");
    }
    // f16: q and k below f16's smallest normal (6.1e-5).
    let to16 = |x: &[f32], sc: f32| x.iter().map(|&a| f16::from_f32(a * sc)).collect::<Vec<_>>();
    let (q, k, v) = (to16(&q0, 1e-6), to16(&k0, 1e-6), to16(&v0, 1.0));
    assert!(q.iter().any(|x| x.to_f32() != 0.0 && x.to_f32().abs() < 6.1e-5), "no f16 subnormals");
    let (out, lse) = cpu.forward_vec(&cfg, s, &q, &k, &v).unwrap();
    let want = Expected::of(&cfg, AttnShape::self_attn(s), [&q, &k, &v], None).unwrap();
    assert!(out.iter().all(|x| x.is_finite()));
    let verdict = judge::verdict(&judge::judge_forward(&want, &out, &lse, attn_core::DType::F16));
    assert!(verdict.is_ok(), "f16 subnormal q/k: {}", verdict.unwrap_err());
}
