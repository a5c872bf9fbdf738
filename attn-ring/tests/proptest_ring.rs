//! proptest: the ring (random config, world size 1..=8, layout, strategy) equals
//! the single-device CPU backend within f32 tolerance, forward and gradients.

mod common;

use attn_core::error::TensorName;
use attn_core::{DType, TensorView};
use attn_kernels::CpuBackend;
use attn_ring::{Layout, Strategy, run_in_process, run_in_process_backward};
use attn_testkit::strategies::dilated_case;
use attn_testkit::tolerance::{Tolerance, rel_l2_error};
use common::views;
use proptest::prelude::*;

fn layouts() -> impl proptest::strategy::Strategy<Value = Layout> {
    prop::sample::select(vec![Layout::Contiguous, Layout::Zigzag])
}

fn strategies() -> impl proptest::strategy::Strategy<Value = Strategy> {
    prop::sample::select(vec![Strategy::Auto, Strategy::Ring, Strategy::AllGather])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, max_shrink_iters: 64, ..ProptestConfig::default() })]

    #[test]
    fn ring_equals_single_device(case in dilated_case(), world in 1usize..=8, layout in layouts(), strategy in strategies()) {
        prop_assume!(layout.check(case.shape.seq, world).is_ok());
        let [q, k, v, go] = case.inputs();
        let shape = case.shape;
        let cpu = CpuBackend::new(1).unwrap();
        let (want_out, want_lse) = cpu.forward_vec(&case.cfg, shape, &q, &k, &v).unwrap();
        let [qv, kv, vv] = views(case.attn_shape(), &q, &k, &v).unwrap();
        let got = run_in_process(world, &case.cfg, layout, strategy, qv, kv, vv).unwrap();
        let tol = Tolerance::for_dtype(DType::F32);
        let e_out = rel_l2_error(&got.out, &want_out);
        let e_lse = rel_l2_error(&got.lse, &want_lse);
        prop_assert!(tol.accepts(e_out) && tol.accepts(e_lse), "out {e_out:e} lse {e_lse:e}");

        let (dq, dk, dv) = cpu.backward_vec(&case.cfg, shape, &q, &k, &v, &want_out, &want_lse, &go).unwrap();
        let gov = TensorView::contiguous(TensorName::GradOutput, &go, shape).unwrap();
        let g = run_in_process_backward(world, &case.cfg, layout, strategy, [qv, kv, vv], gov).unwrap();
        // dq and dk can be zero up to rounding (a query that sees copies of one key has
        // dS = 0 exactly; tiny heads cancel), so, as in the kernel tests, their error is
        // judged against the larger of their own scale and dv's (the same problem's).
        let norm = |x: &[f32]| x.iter().map(|&w| f64::from(w) * f64::from(w)).sum::<f64>().sqrt();
        for (name, got, want) in [("dq", &g.dq, &dq), ("dk", &g.dk, &dk), ("dv", &g.dv, &dv)] {
            let diff: Vec<f32> = got.iter().zip(want.iter()).map(|(a, b)| a - b).collect();
            prop_assert_eq!(got.len(), want.len());
            let den = norm(want).max(norm(&dv));
            let e = if den == 0.0 { norm(&diff) } else { norm(&diff) / den };
            prop_assert!(got.iter().all(|x| x.is_finite()) && tol.accepts(e), "{name} {e:e}");
        }
    }
}
