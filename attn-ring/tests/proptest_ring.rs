//! proptest: the ring (random config and features, world size 1..=8, layout, strategy)
//! computes the function: every row of the forward and the gradients within its f32
//! bound of the float64 reference (`attn_testkit::judge`).

use crate::common;

use attn_core::error::TensorName;
use attn_core::{DType, TensorView};
use attn_ring::{Layout, Strategy, run_in_process, run_in_process_backward};
use attn_testkit::feature_case;
use attn_testkit::golden::DilatedBackend;
use attn_testkit::judge::{Expected, judge, judge_backward, judge_forward, verdict};
use attn_testkit::strategies::dilated_case;
use common::views;
use proptest::prelude::*;

fn layouts() -> impl proptest::strategy::Strategy<Value = Layout> {
    prop::sample::select(vec![Layout::Contiguous, Layout::Zigzag])
}

fn strategies() -> impl proptest::strategy::Strategy<Value = Strategy> {
    prop::sample::select(vec![Strategy::Auto, Strategy::Ring, Strategy::AllGather])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(96), max_shrink_iters: 64, ..ProptestConfig::default() })]

    #[test]
    fn ring_equals_single_device(case in dilated_case(), world in 1usize..=8, layout in layouts(), strategy in strategies()) {
        prop_assume!(layout.check(case.shape.seq, world).is_ok());
        let [q, k, v, go] = case.inputs();
        let [qv, kv, vv] = views(case.attn_shape(), &q, &k, &v).unwrap();
        let got = run_in_process(world, &case.cfg, layout, strategy, qv, kv, vv).unwrap();
        let gov = TensorView::contiguous(TensorName::GradOutput, &go, case.shape).unwrap();
        let g = run_in_process_backward(world, &case.cfg, layout, strategy, [qv, kv, vv], gov).unwrap();
        // Every row of out, lse, dq, dk and dv against the float64 reference, each by its
        // own tensor's bound (a dq that cancels to zero is judged by its magnitudes).
        let verdict = judge(&case.cfg, case.attn_shape(), [&q, &k, &v, &go], &got.out, &got.lse, [&g.dq, &g.dk, &g.dv]);
        prop_assert!(verdict.is_ok(), "{}", verdict.unwrap_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(96), max_shrink_iters: 64, ..ProptestConfig::default() })]

    /// The features (grouped heads, key padding, packed sequences, windows, mixed with
    /// every mode and causal) on every world size, layout and strategy.
    #[test]
    fn ring_with_features_equals_the_reference(
        case in feature_case(1..=48, 24, vec![1, 4, 8, 16]),
        world in 1usize..=8,
        layout in layouts(),
        strategy in strategies(),
    ) {
        prop_assume!(layout.check(case.shape.q.seq, world).is_ok());
        let backend = common::RingBackend { world, layout, strategy };
        let problem = case.problem();
        let [q, k, v, go] = case.inputs();
        let fwd = backend.forward(&problem, [&q, &k, &v]).unwrap();
        let g = backend.backward(&problem, [&q, &k, &v], &go).unwrap();
        let [qw, kw, vw] = [&q, &k, &v].map(|x| wide(x));
        let want = Expected::for_problem(&problem, [&qw, &kw, &vw], Some(&wide(&go))).unwrap();
        let mut rows = judge_forward(&want, &fwd.out, &fwd.lse, DType::F32);
        rows.extend(judge_backward(&want, [&g.dq, &g.dk, &g.dv], DType::F32));
        let v = verdict(&rows);
        prop_assert!(v.is_ok(), "{}", v.unwrap_err());
    }
}

fn wide(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}
