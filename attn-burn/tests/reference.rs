//! The op against the float64 reference (`attn_core`'s reference, through the
//! testkit's judge) on random feature cases: every row of out, LSE and dq, dk, dv within
//! the row bound of each dtype flex stores (f32, f64, bf16, f16), in both layouts; and
//! the gradients of a loss using the LSE too.

use crate::common::golden_op::{BurnOp, DTYPES};
use crate::common::{Layout, judge_run, run_op};
use attn_testkit::feature_case;
use attn_testkit::judge::{Expected, round_to};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(16), max_shrink_iters: 64, ..ProptestConfig::default() })]

    #[test]
    fn rows_are_within_their_bounds_of_the_reference(
        case in feature_case(1..=24, 8, vec![1, 4, 8]),
        which in 0..4usize,
        bhsd in any::<bool>(),
    ) {
        let (dtype, attn_dtype) = DTYPES[which];
        let layout = if bhsd { Layout::Bhsd } else { Layout::Bshd };
        let got = run_op(&case, dtype, layout).expect("op runs");
        let wide = |x: &Vec<f32>| round_to(attn_dtype, x).into_iter().map(f64::from).collect::<Vec<_>>();
        let [q, k, v, go] = case.inputs().each_ref().map(wide);
        let want = Expected::for_problem(&case.problem(), [&q, &k, &v], Some(&go)).expect("reference");
        let verdict = judge_run(&want, &got, attn_dtype);
        prop_assert!(verdict.is_ok(), "{:?}", verdict);
    }

    /// dq, dk, dv of `sum(out * grad_out) + sum(lse * grad_lse)` within their row bounds.
    #[test]
    fn lse_gradients_are_within_their_bounds_of_the_reference(
        case in feature_case(1..=24, 8, vec![1, 4, 8]),
        which in 0..4usize,
        bhsd in any::<bool>(),
    ) {
        let layout = if bhsd { Layout::Bhsd } else { Layout::Bshd };
        let verdict = attn_testkit::judge_lse_gradients(&BurnOp { dtype: DTYPES[which], layout }, &case);
        prop_assert!(verdict.is_ok(), "{:?}", verdict);
    }
}
