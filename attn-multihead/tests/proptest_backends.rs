//! Property test: on random valid configs and shapes, the layer on the CPU kernels (f32)
//! equals the layer on the float64 reference, forward and backward.

use std::sync::Arc;

use attn_core::DType;
use attn_multihead::{
    Mode, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, NamedParams, ReferenceBackend,
};
use attn_testkit::rng::random_vec;
use attn_testkit::strategies::{DilatedCase, dilated_case, dilated_case_with};
use attn_testkit::tolerance::{Tolerance, rel_l2_error};
use proptest::prelude::*;

/// The float64 reference layer for `case` (MAGNETO weights from its seed) and its f32
/// twin on the CPU kernels.
fn twin_layers(case: &DilatedCase) -> (MultiheadDilatedAttention<f64>, MultiheadDilatedAttention<f32>) {
    let s = case.shape;
    let e = s.heads * s.head_dim;
    let cfg = MultiheadConfig::new(e, s.heads, case.cfg.segment_lengths(), case.cfg.dilation_rates())
        .with_mixing(case.cfg.mixing())
        .with_causal(case.cfg.causal())
        .with_scale(case.cfg.explicit_scale())
        // LayerNorm over a handful of features is ill-conditioned (with 2 features its
        // output is +-1 and its gradient scales with 1/|x0 - x1|), so f32 and f64 only
        // agree to 1e-5 on realistic widths: sub-LN is on for embed >= 16.
        .with_layer_norm(e >= 16 && case.seed.is_multiple_of(2));
    let r64 = MultiheadDilatedAttention::<f64>::new(cfg.clone(), case.seed, Arc::new(ReferenceBackend)).unwrap();
    let mut w32 = MultiheadWeights::<f32>::magneto(&cfg, 0);
    for (d, src) in w32.params_mut().into_iter().zip(r64.weights.params()) {
        d.data.iter_mut().zip(src.data).for_each(|(a, &b)| *a = b as f32);
    }
    let cpu = Arc::new(attn_kernels::CpuBackend::new(1).unwrap());
    (r64, MultiheadDilatedAttention::from_weights(cfg, w32, cpu).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(24), max_shrink_iters: 50, ..ProptestConfig::default() })]

    #[test]
    fn cpu_layer_matches_reference_layer(case in dilated_case()) {
        let s = case.shape;
        let e = s.heads * s.head_dim;
        let (r64, c32) = twin_layers(&case);
        let n = s.batch * s.seq * e;
        let x = random_vec(case.seed, n);
        let g = random_vec(case.seed ^ 1, n);
        let (x64, g64): (Vec<f64>, Vec<f64>) = (x.iter().map(|&v| v as f64).collect(), g.iter().map(|&v| v as f64).collect());
        let (y64, k64) = r64.forward_train(&x64, s.batch, s.seq, Mode::Eval).unwrap();
        let (y32, k32) = c32.forward_train(&x, s.batch, s.seq, Mode::Eval).unwrap();
        let bound = Tolerance::for_dtype(DType::F32).rel_l2;
        prop_assert!(rel_l2_error(&y32, &y64) <= bound, "out {:.2e}", rel_l2_error(&y32, &y64));
        let dx64 = r64.backward(&k64, &g64, &mut r64.zero_grads()).unwrap().query;
        let dx32 = c32.backward(&k32, &g, &mut c32.zero_grads()).unwrap().query;
        prop_assert!(rel_l2_error(&dx32, &dx64) <= bound, "dx {:.2e}", rel_l2_error(&dx32, &dx64));
    }

    /// Inference in windows of random size (rounded up to a multiple of every segment
    /// length) on the CPU kernels equals one pass of the float64 reference layer.
    #[test]
    fn windowed_cpu_inference_matches_one_reference_pass(case in dilated_case_with(160, 8), target in 0usize..48) {
        let s = case.shape;
        let e = s.heads * s.head_dim;
        let (r64, c32) = twin_layers(&case);
        let c32 = c32.with_window_rows(target);
        let x = random_vec(case.seed, s.batch * s.seq * e);
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let (want, _) = r64.forward_train(&x64, s.batch, s.seq, Mode::Eval).unwrap();
        let got = c32.forward(&x, s.batch, s.seq, Mode::Eval).unwrap();
        let err = rel_l2_error(&got, &want);
        prop_assert!(err <= Tolerance::for_dtype(DType::F32).rel_l2, "out {:.2e}", err);
    }
}
