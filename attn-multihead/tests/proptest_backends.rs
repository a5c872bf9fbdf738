//! Property test: on random valid configs and shapes, the layer on the CPU kernels (f32)
//! equals the layer on the float64 reference, forward and backward.

use std::sync::Arc;

use attn_core::DType;
use attn_multihead::{
    Mode, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, NamedParams, ReferenceBackend,
};
use attn_testkit::rng::random_vec;
use attn_testkit::strategies::dilated_case;
use attn_testkit::tolerance::{Tolerance, rel_l2_error};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, max_shrink_iters: 50, ..ProptestConfig::default() })]

    #[test]
    fn cpu_layer_matches_reference_layer(case in dilated_case()) {
        let s = case.shape;
        let e = s.heads * s.head_dim;
        let cfg = MultiheadConfig::new(e, s.heads, case.cfg.segment_lengths(), case.cfg.dilation_rates())
            .with_mixing(case.cfg.mixing())
            .with_causal(case.cfg.causal())
            .with_scale(case.cfg.explicit_scale())
            // LayerNorm over a handful of features is ill-conditioned (with 2 features its
            // output is +-1 and its gradient scales with 1/|x0 - x1|), so f32 and f64 only
            // agree to 1e-5 on realistic widths: sub-LN is on for embed >= 16.
            .with_layer_norm(e >= 16 && case.seed % 2 == 0);
        let r64 = MultiheadDilatedAttention::<f64>::new(cfg.clone(), case.seed, Arc::new(ReferenceBackend)).unwrap();
        let mut w32 = MultiheadWeights::<f32>::magneto(&cfg, 0);
        for (d, src) in w32.params_mut().into_iter().zip(r64.weights.params()) {
            d.data.iter_mut().zip(src.data).for_each(|(a, &b)| *a = b as f32);
        }
        let c32 = MultiheadDilatedAttention::from_weights(cfg, w32, Arc::new(attn_kernels::CpuBackend::new(1).unwrap())).unwrap();
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
}
