//! Property test: on random valid configs and shapes, the layer on the CPU kernels (f32)
//! equals the layer on the float64 reference, forward and backward.

use std::sync::Arc;

use attn_core::DType;
use attn_multihead::{
    Call, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, NamedParams, ReferenceBackend,
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
    let cfg = MultiheadConfig::new(e, s.heads, case.cfg.clone())
        // LayerNorm over a handful of features is ill-conditioned (with 2 features its
        // output is +-1 and its gradient scales with 1/|x0 - x1|), so f32 and f64 only
        // agree to 1e-5 on realistic widths: sub-LN is on for embed >= 16.
        .with_layer_norm((e >= 16 && case.seed.is_multiple_of(2)).into());
    let r64 = MultiheadDilatedAttention::<f64>::new(cfg.clone(), case.seed, Arc::new(ReferenceBackend)).unwrap();
    let mut w32 = MultiheadWeights::<f32>::magneto(&cfg, 0);
    for (d, src) in w32.params_mut().into_iter().zip(r64.weights.params()) {
        d.data.iter_mut().zip(src.data).for_each(|(a, &b)| *a = b as f32);
    }
    let cpu = Arc::new(attn_kernels::CpuBackend::new(1).unwrap());
    (r64, MultiheadDilatedAttention::from_weights(cfg, w32, cpu).unwrap())
}

/// The CPU layer (f32) against the reference layer on `case`: output and input gradient
/// each within the f32 bound, or what exceeded it. `plant` changes the f32 layer's weights
/// first (the planted-error test).
fn layer_vs_reference(case: &DilatedCase, plant: impl Fn(&mut MultiheadWeights<f32>)) -> Result<(), String> {
    let s = case.shape;
    let e = s.heads * s.head_dim;
    let (r64, mut c32) = twin_layers(case);
    plant(&mut c32.weights);
    let n = s.batch * s.seq * e;
    let x = random_vec(case.seed, n);
    let g = random_vec(case.seed ^ 1, n);
    let wide = |v: &[f32]| v.iter().map(|&v| v as f64).collect::<Vec<f64>>();
    let (x64, g64) = (wide(&x), wide(&g));
    let (y64, k64) = r64.forward_train(&x64, &Call::new(s.batch, s.seq)).map_err(|e| e.to_string())?;
    let (y32, k32) = c32.forward_train(&x, &Call::new(s.batch, s.seq)).map_err(|e| e.to_string())?;
    let dx64 = r64.backward(&k64, &g64, &mut r64.zero_grads()).map_err(|e| e.to_string())?.query;
    let dx32 = c32.backward(&k32, &g, &mut c32.zero_grads()).map_err(|e| e.to_string())?.query;
    let bound = Tolerance::for_dtype(DType::F32).rel_l2;
    for (name, got, want) in [("out", &y32, &y64), ("dx", &dx32, &dx64)] {
        let err = rel_l2_error(got, want);
        if err > bound {
            return Err(format!("{name} {err:.2e} > {bound:.0e}"));
        }
    }
    Ok(())
}

/// The comparison bites: the same case passes with the twin's weights and fails with
/// the CPU layer's `out_proj.weight` scaled by 1.001.
#[test]
fn a_planted_weight_error_is_rejected() {
    let cfg = attn_core::DilatedConfig::builder().segments(&[8, 16]).dilations(&[1, 2]).build().unwrap();
    let case = DilatedCase { cfg, shape: attn_core::Shape4::new(1, 32, 2, 8).unwrap(), seed: 11 };
    layer_vs_reference(&case, |_| {}).unwrap();
    let plant = |w: &mut MultiheadWeights<f32>| {
        let mut params = w.params_mut();
        let out_proj = params.iter_mut().find(|p| p.name == "out_proj.weight").expect("out_proj.weight");
        out_proj.data.iter_mut().for_each(|x| *x *= 1.001);
    };
    let e = layer_vs_reference(&case, plant).expect_err("a wrong layer passed");
    eprintln!("planted weight error: {e}");
    assert!(e.contains("out"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(24), max_shrink_iters: 50, ..ProptestConfig::default() })]

    #[test]
    fn cpu_layer_matches_reference_layer(case in dilated_case()) {
        layer_vs_reference(&case, |_| {}).map_err(TestCaseError::fail)?;
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
        let (want, _) = r64.forward_train(&x64, &Call::new(s.batch, s.seq)).unwrap();
        let got = c32.forward(&x, &Call::new(s.batch, s.seq)).unwrap();
        let err = rel_l2_error(&got, &want);
        prop_assert!(err <= Tolerance::for_dtype(DType::F32).rel_l2, "out {:.2e}", err);
    }
}
