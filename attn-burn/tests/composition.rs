//! The op against a plain burn composition of the definition (forward, LSE and burn
//! autodiff gradients, of a loss on the output alone and of one on the output and the
//! LSE) on random feature cases in both layouts, f32; a composition with a planted wrong
//! scale, and an op whose loss leaves the LSE out, fail the same comparisons.

use crate::common::compose::{Masking, Scale, compose};
use crate::common::{Layout, Run, agree, grad_lse_of, run_op, run_op_lse, run_with, values};
use attn_testkit::{FeatureCase, feature_case};
use burn_tensor::DType;
use proptest::prelude::*;
use proptest::strategy::ValueTree;

/// The composition's run on the case (f32, one layout), its loss using the LSE where
/// `grad_lse` is given.
fn composed(case: &FeatureCase, scale: Scale, grad_lse: Option<&[f32]>, layout: Layout) -> Run {
    let masking = Masking { padding: case.padding.clone(), cu_seqlens: case.cu_seqlens.clone() };
    let f = |q, k, v| Ok(compose(q, k, v, &case.cfg, &masking, scale));
    run_with(case, &f, grad_lse, DType::F32, layout).expect("composition runs")
}

/// The op's run with a gradient into the LSE, and that gradient.
fn op_with_lse_grad(case: &FeatureCase, layout: Layout) -> (Run, Vec<f32>) {
    let gl = grad_lse_of(case, &run_op(case, DType::F32, layout).expect("op runs").lse);
    (run_op_lse(case, Some(&gl), DType::F32, layout).expect("op runs"), gl)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(12), max_shrink_iters: 64, ..ProptestConfig::default() })]

    /// The op equals the composition, forward, LSE and gradients, in both layouts.
    #[test]
    fn f32_op_equals_the_burn_composition(case in feature_case(1..=16, 8, vec![1, 4, 8]), bhsd in any::<bool>()) {
        let layout = if bhsd { Layout::Bhsd } else { Layout::Bshd };
        let got = run_op(&case, DType::F32, layout).expect("op runs");
        let verdict = agree(&case, None, &got, &composed(&case, Scale::Config, None, layout));
        prop_assert!(verdict.is_ok(), "{:?}", verdict);
    }

    /// With a gradient into the LSE too, the op's gradients equal the composition's.
    #[test]
    fn f32_lse_gradients_equal_the_burn_composition(
        case in feature_case(1..=16, 8, vec![1, 4, 8]),
        bhsd in any::<bool>(),
    ) {
        let layout = if bhsd { Layout::Bhsd } else { Layout::Bshd };
        let (got, gl) = op_with_lse_grad(&case, layout);
        let verdict = agree(&case, Some(&gl), &got, &composed(&case, Scale::Config, Some(&gl), layout));
        prop_assert!(verdict.is_ok(), "{:?}", verdict);
    }
}

/// A composition scaling scores by 1.1 times the config's scale disagrees with the op on
/// every case where some query attends a key (its LSE, at least, moves).
#[test]
fn a_planted_wrong_scale_fails_the_comparison() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = feature_case(4..=16, 8, vec![4, 8]);
    let mut judged = 0;
    for _ in 0..6 {
        let case = strategy.new_tree(&mut runner).expect("a case").current();
        let got = run_op(&case, DType::F32, Layout::Bshd).expect("op runs");
        if got.lse.iter().all(|x| x.is_infinite()) {
            continue;
        }
        judged += 1;
        let d = case.shape.q.head_dim;
        let planted = composed(&case, Scale::Planted(case.cfg.scale_for(d) * 1.1), None, Layout::Bshd);
        assert!(agree(&case, None, &got, &planted).is_err(), "a wrong scale passed on {case:?}");
        // The honest composition passes on the same case.
        let honest = composed(&case, Scale::Config, None, Layout::Bshd);
        assert_eq!(agree(&case, None, &got, &honest), Ok(()));
    }
    assert!(judged >= 3, "only {judged} cases attended any key");
}

/// An op whose loss leaves the LSE out (the gradients of `sum(out * grad_out)` alone)
/// disagrees with the composition's gradients of the loss with the LSE on every case
/// where some query attends a key.
#[test]
fn leaving_the_lse_gradient_out_fails_the_comparison() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = feature_case(4..=16, 8, vec![4, 8]);
    let mut judged = 0;
    for _ in 0..6 {
        let case = strategy.new_tree(&mut runner).expect("a case").current();
        let (with_lse, gl) = op_with_lse_grad(&case, Layout::Bshd);
        if gl.iter().all(|&g| g == 0.0) {
            continue;
        }
        judged += 1;
        let want = composed(&case, Scale::Config, Some(&gl), Layout::Bshd);
        let without = run_op(&case, DType::F32, Layout::Bshd).expect("op runs");
        assert!(agree(&case, Some(&gl), &without, &want).is_err(), "the LSE's gradient made no difference: {case:?}");
        assert_eq!(agree(&case, Some(&gl), &with_lse, &want), Ok(()));
    }
    assert!(judged >= 3, "only {judged} cases attended any key");
}

/// The LSE the op returns is a tensor `[batch, seq, heads]` holding the forward's LSE.
#[test]
fn the_lse_tensor_has_the_lse_shape() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let case = feature_case(4..=8, 4, vec![4]).new_tree(&mut runner).expect("a case").current();
    let [q, k, v, _] = case.inputs();
    let device = burn_tensor::Device::flex();
    let (qd, kd) = (case.shape.q.dims(), case.shape.kv.dims());
    let t = |x: &[f32], d| crate::common::tensor4(x, d, DType::F32, Layout::Bshd, &device);
    let r = attn_burn::dilated_attention_with_lse(t(&q, qd), t(&k, kd), t(&v, kd), &crate::common::options(&case))
        .expect("op runs");
    assert_eq!(r.lse.dims(), [qd[0], qd[1], qd[2]]);
    assert_eq!(r.out.dims(), qd);
    let got = run_op(&case, DType::F32, Layout::Bshd).expect("op runs");
    assert_eq!(values(r.lse), got.lse);
}
