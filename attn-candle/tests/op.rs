//! The candle op against a plain candle composition of the definition (forward, LSE and
//! candle-autograd gradients) on random feature cases in both layouts, f32 tight and
//! bf16/f16 row by row against the float64 reference; gradients into the LSE in every
//! dtype; a planted error fails the bound.

use crate::common;

use attn_candle::run_buffers;
use attn_core::DType as AttnDType;
use attn_testkit::FeatureCase;
use attn_testkit::feature_case;
use attn_testkit::judge::{Expected, judge_backward, judge_forward, round_to, verdict};
use candle_core::DType;
use common::compose::{Masking, compose};
use common::{Layout, Run, agree, run_op};
use proptest::prelude::*;
use proptest::strategy::ValueTree;

/// The composition's run on the case (f32, one layout).
fn composed(case: &FeatureCase, layout: Layout) -> Run {
    let [q, k, v, go] = case.inputs();
    let masking = Masking { padding: case.padding.clone(), cu_seqlens: case.cu_seqlens.clone() };
    let dims = [case.shape.q.dims(), case.shape.kv.dims()];
    run_buffers(|q, k, v| compose(q, k, v, &case.cfg, &masking), [&q, &k, &v], dims, &go, (DType::F32, layout))
        .expect("composition runs")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(48), ..ProptestConfig::default() })]

    /// f32: the op equals the composition, forward, LSE and gradients, in both layouts.
    #[test]
    fn f32_op_equals_the_candle_composition(case in feature_case(1..=24, 8, vec![1, 4, 8]), bhsd in any::<bool>()) {
        let layout = if bhsd { Layout::Bhsd } else { Layout::Bshd };
        let [q, k, v, go] = case.inputs();
        let got = run_op(&case.problem(), [&q, &k, &v], &go, DType::F32, layout).expect("op runs");
        let verdict = agree(&case, &got, &composed(&case, layout));
        prop_assert!(verdict.is_ok(), "{:?}", verdict);
    }

    /// bf16 and f16: every row of out, LSE and gradients within the dtype's row bound of
    /// the float64 reference on the rounded inputs.
    #[test]
    fn half_precision_rows_are_within_their_bounds(case in feature_case(1..=24, 8, vec![4, 8]), half in any::<bool>(), bhsd in any::<bool>()) {
        let (dtype, attn_dtype) = if half { (DType::F16, AttnDType::F16) } else { (DType::BF16, AttnDType::BF16) };
        let layout = if bhsd { Layout::Bhsd } else { Layout::Bshd };
        let [q, k, v, go] = case.inputs();
        let got = run_op(&case.problem(), [&q, &k, &v], &go, dtype, layout).expect("op runs");
        let [q, k, v, go] = [&q, &k, &v, &go].map(|x| round_to(attn_dtype, x).into_iter().map(f64::from).collect::<Vec<_>>());
        let want = Expected::for_problem(&case.problem(), [&q, &k, &v], Some(&go)).expect("reference");
        let mut rows = judge_forward(&want, &got.out, &got.lse, attn_dtype);
        let [dq, dk, dv] = &got.grads;
        rows.extend(judge_backward(&want, [dq, dk, dv], attn_dtype));
        prop_assert!(verdict(&rows).is_ok(), "{:?}", verdict(&rows));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(32), ..ProptestConfig::default() })]

    /// A loss of the output and the LSE: every gradient row within the dtype's bound of
    /// the float64 reference with that gradient into the LSE, in every dtype and layout.
    #[test]
    fn lse_gradients_match_the_reference(case in feature_case(1..=24, 8, vec![1, 4, 8]), dtype in 0..3usize, bhsd in any::<bool>()) {
        let layout = if bhsd { Layout::Bhsd } else { Layout::Bshd };
        let dtype = [DType::F32, DType::BF16, DType::F16][dtype];
        let op = common::CandleOp { dtype, layout, device: candle_core::Device::Cpu };
        let verdict = attn_testkit::judge_lse_gradients(&op, &case);
        prop_assert!(verdict.is_ok(), "{:?}", verdict);
    }
}

/// Merging two halves of the keys by their LSEs gives the whole attention's gradients;
/// with the LSEs detached (the merge weights taken as constants) they are far off.
#[test]
fn partial_results_merged_by_their_lses_get_exact_gradients() {
    use attn_candle::{AttnOptions, dilated_attention, dilated_attention_with_lse};
    use candle_core::{Device, Tensor, Var};
    let dev = Device::Cpu;
    let rand = |seed: u64, dims: &[usize]| {
        let n = dims.iter().product();
        Var::from_tensor(&Tensor::from_vec(attn_testkit::random_vec(seed, n), dims, &dev).unwrap()).unwrap()
    };
    let (q, k, v) = (rand(1, &[1, 32, 2, 8]), rand(2, &[1, 64, 2, 8]), rand(3, &[1, 64, 2, 8]));
    let g = Tensor::from_vec(attn_testkit::random_vec(4, 512), (1, 32, 2, 8), &dev).unwrap();
    let opts = AttnOptions::new(attn_core::DilatedConfig::new(&[64], &[1]).unwrap());
    let grads_of = |out: &Tensor| {
        let gs = (out * &g).unwrap().sum_all().unwrap().backward().unwrap();
        [&q, &k, &v].map(|x| gs.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
    };
    let merged = |detach: bool| {
        let half = |i: usize| {
            let (kh, vh) = (k.narrow(1, 32 * i, 32).unwrap(), v.narrow(1, 32 * i, 32).unwrap());
            let r = dilated_attention_with_lse(&q, &kh, &vh, &opts).unwrap();
            let lse = if detach { r.lse.detach() } else { r.lse };
            (r.out, lse.unsqueeze(3).unwrap())
        };
        let ((o1, l1), (o2, l2)) = (half(0), half(1));
        let m = l1.maximum(&l2).unwrap();
        let (e1, e2) = (l1.broadcast_sub(&m).unwrap().exp().unwrap(), l2.broadcast_sub(&m).unwrap().exp().unwrap());
        let total = (&e1 + &e2).unwrap();
        let w1 = e1.broadcast_div(&total).unwrap();
        let w2 = e2.broadcast_div(&total).unwrap();
        (o1.broadcast_mul(&w1).unwrap() + o2.broadcast_mul(&w2).unwrap()).unwrap()
    };
    let want = grads_of(&dilated_attention(&q, &k, &v, &opts).unwrap());
    for (name, got, want) in
        ["dq", "dk", "dv"].into_iter().zip(grads_of(&merged(false))).zip(&want).map(|((n, a), b)| (n, a, b))
    {
        let err = attn_testkit::rel_l2_error(&got, want);
        assert!(err < 1e-5, "{name}: {err}");
    }
    let dq_detached = &grads_of(&merged(true))[0];
    assert!(attn_testkit::rel_l2_error(dq_detached, &want[0]) > 0.1);
}

/// The comparison bites: one output row scaled by 1.01, one dq row by 1.05 or one LSE
/// moved by 0.01 fails it.
#[test]
fn a_planted_error_fails_the_comparison() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = feature_case(16..=16, 8, vec![4]);
    let case = strategy.new_tree(&mut runner).expect("a case").current();
    let [q, k, v, go] = case.inputs();
    let got = run_op(&case.problem(), [&q, &k, &v], &go, DType::F32, Layout::Bshd).expect("op runs");
    let want = composed(&case, Layout::Bshd);
    assert_eq!(agree(&case, &got, &want), Ok(()));
    let d = case.shape.q.head_dim;
    // The row with the largest norm, so the planted change is not lost in a zero row.
    let largest = |x: &[f32]| {
        let norm = |r: &[f32]| r.iter().map(|v| v * v).sum::<f32>();
        x.chunks(d).enumerate().max_by(|a, b| norm(a.1).total_cmp(&norm(b.1))).map(|(i, _)| i).unwrap_or(0)
    };
    let plant = |f: &dyn Fn(&mut Run)| {
        let mut bad = got.clone();
        f(&mut bad);
        agree(&case, &bad, &want)
    };
    let scale_row = |x: &mut [f32], by: f32| {
        let r = largest(x);
        x[r * d..(r + 1) * d].iter_mut().for_each(|v| *v *= by);
    };
    assert!(plant(&|r: &mut Run| scale_row(&mut r.out, 1.01)).is_err(), "a planted output error passed");
    assert!(plant(&|r: &mut Run| scale_row(&mut r.grads[0], 1.05)).is_err(), "a planted dq error passed");
    let lse_at = got.lse.iter().position(|x| x.is_finite()).expect("a finite LSE");
    assert!(plant(&|r: &mut Run| r.lse[lse_at] += 0.01).is_err(), "a planted LSE error passed");
}
