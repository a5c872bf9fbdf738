//! A sliding-window layer (`MultiheadConfig::attention` in window mode) is the composition by hand: the fused projection, the float64 reference op with that window, sub-LN and the output projection.

use std::sync::Arc;

use attn_core::reference::dilated_forward;
use attn_core::{AttnShape, DType, DilatedConfig, Shape4};
use attn_kernels::CpuBackend;
use attn_multihead::{
    Call, EncoderConfig, LongNetEncoder, MultiheadConfig, MultiheadDilatedAttention, MultiheadWorkspace, NamedParams,
    ReferenceBackend,
};
use attn_testkit::rng::random_vec;
use attn_testkit::tolerance::{Tolerance, rel_l2_error};

const E: usize = 16;
const HEADS: usize = 4;

/// Causal `(4, 0)` and two-sided `(3, 2)` windows.
fn windows() -> Vec<DilatedConfig> {
    vec![DilatedConfig::builder().window(4, 0).causal().build().unwrap(), DilatedConfig::sliding_window(3, 2).unwrap()]
}

/// Weights nudged off MAGNETO's zero biases and unit norm, so every term shows.
fn layer(attention: DilatedConfig) -> MultiheadDilatedAttention<f64> {
    let cfg = MultiheadConfig::new(E, HEADS, attention);
    let mut layer = MultiheadDilatedAttention::<f64>::new(cfg, 9, Arc::new(ReferenceBackend)).unwrap();
    for p in layer.weights.params_mut() {
        p.data.iter_mut().enumerate().for_each(|(i, x)| *x += 0.05 * ((i as f64) * 0.7).sin());
    }
    layer
}

/// The layer's function composed from its parts: `out_proj(norm(attn(q, k, v)))` with
/// `[q | k | v] = in_proj(x)` and `attn` the float64 reference with `cfg`'s window.
fn composed(layer: &MultiheadDilatedAttention<f64>, cfg: &DilatedConfig, x: &[f64], b: usize, s: usize) -> Vec<f64> {
    let w = &layer.weights;
    let qkv = w.in_proj.forward(x, b * s).unwrap();
    let column =
        |part: usize| -> Vec<f64> { qkv.chunks_exact(3 * E).flat_map(|r| r[part * E..][..E].to_vec()).collect() };
    let shape = AttnShape::self_attn(Shape4::new(b, s, HEADS, E / HEADS).unwrap());
    let attn = dilated_forward(cfg, shape, &column(0), &column(1), &column(2)).unwrap().out;
    let normed = w.norm.as_ref().expect("sub-LN on").forward(&attn).unwrap().0;
    w.out_proj.forward(&normed, b * s).unwrap()
}

#[test]
fn a_windowed_layer_is_projections_then_the_windowed_op() {
    let (b, s) = (2, 13);
    let x: Vec<f64> = random_vec(4, b * s * E).into_iter().map(f64::from).collect();
    for cfg in windows() {
        let what = format!("window {:?} causal {}", cfg.window(), cfg.causal());
        // Windows of 4 rows: the layer must not walk segment windows with a sliding window.
        let layer = layer(cfg.clone()).with_window_rows(4);
        let want = composed(&layer, &cfg, &x, b, s);
        let f64_err = rel_l2_error(&layer.forward(&x, &Call::new(b, s)).unwrap(), &want);
        assert!(f64_err <= Tolerance::for_dtype(DType::F64).rel_l2, "{what}: reference layer {f64_err:.2e}");
        let (train, _) = layer.forward_train(&x, &Call::new(b, s)).unwrap();
        assert!(rel_l2_error(&train, &want) <= Tolerance::for_dtype(DType::F64).rel_l2, "{what}: forward_train");
        // The CPU kernels in f32, same weights (rounded) and input.
        let cpu = cpu32(&layer);
        let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let got = cpu.forward(&x32, &Call::new(b, s)).unwrap();
        let got: Vec<f64> = got.iter().map(|&v| f64::from(v)).collect();
        let f32_err = rel_l2_error(&got, &want);
        assert!(f32_err <= Tolerance::for_dtype(DType::F32).rel_l2, "{what}: cpu f32 layer {f32_err:.2e}");
        eprintln!("{what}: f64 {f64_err:.2e}, cpu f32 {f32_err:.2e}");
    }
}

/// `layer`'s config and weights in f32 on the CPU kernels.
fn cpu32(layer: &MultiheadDilatedAttention<f64>) -> MultiheadDilatedAttention<f32> {
    let backend = Arc::new(CpuBackend::new(2).unwrap());
    let mut l32 = MultiheadDilatedAttention::<f32>::new(layer.config().clone(), 0, backend).unwrap();
    for (p, q) in l32.weights.params_mut().into_iter().zip(layer.weights.params()) {
        p.data.iter_mut().zip(q.data).for_each(|(a, &b)| *a = b as f32);
    }
    l32
}

/// An eval pass of a stack with a sliding window is one pass: segment windows would
/// cut the window at their edges.
#[test]
fn a_windowed_encoder_forward_is_one_pass() {
    let (b, s) = (1, 21);
    let x: Vec<f64> = random_vec(6, b * s * E).into_iter().map(f64::from).collect();
    for cfg in windows() {
        let enc = LongNetEncoder::<f64>::new(EncoderConfig::new(E, HEADS, cfg, 24), 2, 3, Arc::new(ReferenceBackend))
            .unwrap()
            .with_window_rows(4);
        let mut one_pass = vec![0.0; x.len()];
        enc.forward_into(&x, &Call::new(b, s), &mut MultiheadWorkspace::new(), &mut one_pass).unwrap();
        let got = enc.forward(&x, &Call::new(b, s)).unwrap();
        assert!(rel_l2_error(&got, &one_pass) <= Tolerance::for_dtype(DType::F64).rel_l2);
        assert!(enc.forward_windows(&x, b, s, 7, |_| {}).is_err(), "segment windows across a sliding window");
    }
}
