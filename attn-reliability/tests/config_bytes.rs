//! Bytes-driven config and shape validation (the `config_shape` fuzz target run as a
//! proptest, so it runs on stable in `cargo test`): validated configs obey SPEC.md, and
//! small valid problems agree between the CPU backend and the float64 reference.

use attn_core::{AttnError, AttnShape, DilatedConfig, Shape4};
use attn_reliability::fuzz_targets::{config_shape, score_bound};
use attn_testkit::rng::random_vec;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(2000), max_shrink_iters: 500, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_validate_or_fail_cleanly(bytes in prop::collection::vec(any::<u8>(), 0..96)) {
        config_shape(&bytes);
    }
}

#[test]
fn random_bytes_reach_the_backends_often_enough() {
    // The proptest above is only worth something if random bytes often make a valid
    // problem: count how many of 2000 seeded byte strings run on both backends.
    let ran = attn_reliability::byte_cursor::seeded_hits(9, 2000, 96, config_shape);
    eprintln!("{ran} of 2000 random byte strings ran on the reference and the CPU backend");
    assert!(ran >= 100, "only {ran} of 2000 reached the backends");
}

#[test]
fn hand_picked_hostile_values_are_typed_errors() {
    let b = DilatedConfig::builder;
    let huge = usize::MAX;
    assert!(b().segments(&[huge]).dilations(&[huge]).build().is_ok(), "w = r = usize::MAX is valid per SPEC");
    assert!(matches!(b().segments(&[4]).dilations(&[huge]).build(), Err(AttnError::RateExceedsSegment { .. })));
    for s in [f64::MIN_POSITIVE / 4.0, f64::MAX] {
        // Finite positive scales are valid, even extreme ones...
        let cfg = b().segments(&[4]).dilations(&[1]).scale(s).build().unwrap();
        // ...and a scale that is zero or infinite in f32 is refused by the CPU backend, not run.
        let cpu = attn_kernels::CpuBackend::new(1).unwrap();
        let sh = Shape4::new(1, 4, 1, 2).unwrap();
        let x = vec![0.5f32; sh.numel()];
        let r = cpu.forward_vec(&cfg, sh, &x, &x, &x);
        assert!(matches!(r, Err(AttnError::InvalidScale(_))), "scale {s:e}: {:?}", r.map(|_| ()));
    }
    // A huge segment with a tiny sequence: one short segment, valid, finite.
    let cfg = b().segments(&[huge / 2]).dilations(&[3]).causal().build().unwrap();
    let sh = Shape4::new(1, 7, 1, 2).unwrap();
    let x: Vec<f32> = (0..sh.numel()).map(|i| i as f32 / 7.0).collect();
    let (out, _) = attn_kernels::CpuBackend::new(1).unwrap().forward_vec(&cfg, sh, &x, &x, &x).unwrap();
    assert!(out.iter().all(|v| v.is_finite()));
    // Shapes: overflow, zero and rank errors.
    assert!(matches!(AttnShape::check_cross(&[huge, 2, 1, 1], &[1; 4], &[1; 4]), Err(AttnError::ShapeOverflow { .. })));
    assert!(matches!(
        AttnShape::check_cross(&[1, 1 << 40, 1 << 20, 1 << 3], &[1; 4], &[1; 4]),
        Err(AttnError::ShapeOverflow { .. })
    ));
    assert!(matches!(AttnShape::check(&[], &[], &[]), Err(AttnError::RankMismatch { .. })));
    assert!(matches!(AttnShape::check(&[1, 0, 1, 1], &[1, 0, 1, 1], &[1, 0, 1, 1]), Err(AttnError::ZeroDim { .. })));
}

/// Bytes for one segment (w 8, r 1), HeadGroups, non-causal, the given explicit scale and
/// self-attention of shape [1, 16, 1, 4] (see `config_shape` for the byte layout).
fn scaled_problem_bytes(scale: f64) -> Vec<u8> {
    let mut bytes = vec![3, 7, 1, 0, 0, 0, 0];
    bytes.extend_from_slice(&scale.to_le_bytes());
    bytes.extend_from_slice(&[1, 0, 15, 0, 3, 1, 0]);
    bytes
}

#[test]
fn huge_scale_is_refused_as_score_overflow_not_a_disagreement() {
    // The reference runs in f64; the CPU backend's bound scale*d*max|q|*max|k| is beyond
    // f32::MAX, so it refuses with ScoreOverflow, which the target must accept.
    let cfg = DilatedConfig::builder().segments(&[8]).dilations(&[1]).scale(1.4e38).build().unwrap();
    let s = Shape4::new(1, 16, 1, 4).unwrap();
    let (q, k, v) = (random_vec(1, s.numel()), random_vec(2, s.numel()), random_vec(3, s.numel()));
    let r = attn_kernels::CpuBackend::new(1).unwrap().forward_vec(&cfg, s, &q, &k, &v);
    assert!(matches!(r, Err(AttnError::ScoreOverflow { .. })), "fixture must overflow: {:?}", r.map(|_| ()));
    assert!(score_bound(&cfg, s, &q, &k) > f64::from(f32::MAX));
    assert!(config_shape(&scaled_problem_bytes(1.4e38)), "the bytes must reach the backends");
    // The same bytes with an ordinary scale run and agree (the layout above is right).
    assert!(config_shape(&scaled_problem_bytes(0.5)));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(64), ..ProptestConfig::default() })]

    #[test]
    fn any_large_scale_runs_or_is_refused_typed(exp in 30.0f64..38.5) {
        prop_assert!(config_shape(&scaled_problem_bytes(10f64.powf(exp))));
    }
}

/// Found by the fuzzer (2026-11-24, after `exp2` became a fitted polynomial): one key,
/// explicit scale 4.7e-23. The LSE is the lone score (about 1e-23), so `exp2(0)` must be
/// exactly 1: a polynomial with constant term 1.0000001 put `log2(l)` = 1.7e-7 into the
/// LSE, a relative error of 5e16 against the reference.
#[test]
fn a_lone_key_gets_weight_exactly_one() {
    assert!(config_shape(&[174, 7, 17, 0, 0, 0, 0, 0, 0, 0, 174, 174, 174, 76, 59, 234, 118]));
}

/// k and v with one head for q's two (grouped-query attention) are a valid shape, not a
/// broken invariant (a fuzzer input).
#[test]
fn grouped_key_value_heads_are_a_valid_shape() {
    config_shape(&[238, 3, 126, 107, 107, 3, 126, 3, 0, 0, 10]);
}

/// Windows, alone or (an error) with segments, validate and run like any config: one
/// segment (8, 1) bytes, non-causal or causal, no explicit scale, shape [1, 16, 1, 4]
/// self-attention, then the window bytes (see `config_shape` for the layout).
#[test]
fn window_bytes_validate_and_run() {
    let mut ran = 0;
    for causal in [0u8, 1] {
        for (tail, runs) in [([7u8, 3, 2, 1], true), ([7, 9, 0, 1], true), ([7, 5, 5, 0], false)] {
            let mut bytes = vec![3, 7, 1, 0, 0, causal, 2, 1, 0, 15, 0, 3, 1, 0];
            bytes.extend_from_slice(&tail);
            assert_eq!(config_shape(&bytes), runs, "{bytes:?}");
            ran += usize::from(runs);
        }
    }
    assert_eq!(ran, 4);
}
