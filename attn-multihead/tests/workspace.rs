//! `forward_with` and `MultiheadWorkspace`: one workspace reused across layers, shapes and modes gives exactly what a fresh forward gives.

use std::sync::Arc;

use attn_core::{Causality, DType, DilatedConfig, Mixing};
use attn_kernels::CpuBackend;
use attn_multihead::{Bias, LayerNorms};
use attn_multihead::{
    Call, Mode, MultiheadConfig, MultiheadDilatedAttention, MultiheadWorkspace, NamedParams, ReferenceBackend,
};
use attn_testkit::rng::random_vec;
use attn_testkit::tolerance::{Tolerance, rel_l2_error};

/// A CPU layer with every parameter random (biases and LayerNorm included, so that a
/// stale or missing bias shows), and its float64 twin on the reference backend.
fn layers(cfg: &MultiheadConfig, seed: u64) -> (MultiheadDilatedAttention<f32>, MultiheadDilatedAttention<f64>) {
    let mut l32 =
        MultiheadDilatedAttention::<f32>::new(cfg.clone(), seed, Arc::new(CpuBackend::new(2).unwrap())).unwrap();
    for (i, p) in l32.weights.params_mut().into_iter().enumerate() {
        let r = random_vec(100 + seed * 16 + i as u64, p.data.len());
        p.data.iter_mut().zip(r).for_each(|(d, x)| *d += 0.3 * x);
    }
    let mut l64 = MultiheadDilatedAttention::<f64>::new(cfg.clone(), seed, Arc::new(ReferenceBackend)).unwrap();
    for (d, s) in l64.weights.params_mut().into_iter().zip(l32.weights.params()) {
        d.data.iter_mut().zip(s.data).for_each(|(a, &b)| *a = b as f64);
    }
    (l32, l64)
}

#[test]
fn a_reused_workspace_gives_the_fresh_forward_bit_for_bit() {
    let base = MultiheadConfig::new(32, 4, DilatedConfig::new(&[8, 16, 32], &[1, 2, 4]).unwrap());
    let longnet = DilatedConfig::builder().segments(&[8, 16, 32]).dilations(&[1, 2, 4]).mixing(Mixing::LongNet);
    let longnet = longnet.build().unwrap();
    // Consecutive calls change the selection (segments, rates, mixing), the shape,
    // biases, sub-LN and causality, so every buffer is reused across a change.
    let cases = [
        (base.clone(), 2, 64),
        (base.clone(), 2, 64),
        (MultiheadConfig::new(32, 4, DilatedConfig::new(&[16, 32], &[2, 4]).unwrap()), 2, 64),
        (base.clone().with_causality(Causality::Causal), 1, 48),
        (MultiheadConfig::new(32, 4, longnet).with_bias(Bias::Absent), 1, 48),
        (base.clone().with_layer_norm(LayerNorms::Absent), 2, 40),
        (base.clone(), 2, 64),
    ];
    let mut ws = MultiheadWorkspace::new();
    for (i, (cfg, batch, seq)) in cases.into_iter().enumerate() {
        let (l32, l64) = layers(&cfg, i as u64);
        let x = random_vec(7 + i as u64, batch * seq * 32);
        let fresh = l32.forward(&x, &Call::new(batch, seq)).unwrap();
        let mut out = vec![f32::NAN; fresh.len()];
        l32.forward_into(&x, &Call::new(batch, seq), &mut ws, &mut out).unwrap();
        assert_eq!(out, fresh, "case {i}: reused workspace differs from a fresh forward");
        assert!(ws.bytes() >= batch * seq * 32 * 4 * 4, "case {i}: workspace holds {} bytes", ws.bytes());
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let want = l64.forward(&x64, &Call::new(batch, seq)).unwrap();
        let err = rel_l2_error(&out, &want);
        assert!(err <= Tolerance::for_dtype(DType::F32).rel_l2, "case {i}: {err:.2e} from the f64 reference");
    }
}

#[test]
fn training_mode_with_a_workspace_matches_forward_train() {
    let cfg = MultiheadConfig::new(32, 4, DilatedConfig::new(&[8, 16], &[1, 2]).unwrap()).with_dropout(0.25);
    let (l32, _) = layers(&cfg, 3);
    let x = random_vec(5, 2 * 32 * 32);
    let mode = Mode::Train { seed: 9 };
    let (want, _) = l32.forward_train(&x, &Call::new(2, 32).mode(mode)).unwrap();
    let mut ws = MultiheadWorkspace::new();
    let mut out = vec![0f32; want.len()];
    for _ in 0..2 {
        l32.forward_into(&x, &Call::new(2, 32).mode(mode), &mut ws, &mut out).unwrap();
        assert_eq!(out, want);
    }
    let eval = l32.forward(&x, &Call::new(2, 32)).unwrap();
    assert_ne!(eval, want, "dropout had no effect");
}

#[test]
fn a_wrong_output_buffer_is_an_error() {
    let cfg = MultiheadConfig::new(32, 4, DilatedConfig::new(&[8, 16], &[1, 2]).unwrap());
    let (l32, _) = layers(&cfg, 1);
    let x = random_vec(5, 32 * 32);
    let mut ws = MultiheadWorkspace::new();
    let mut short = vec![0f32; 32 * 32 - 1];
    assert!(l32.forward_into(&x, &Call::new(1, 32), &mut ws, &mut short).is_err());
    let mut out = vec![0f32; 32 * 32];
    assert!(l32.forward_into(&x[1..], &Call::new(1, 32), &mut ws, &mut out).is_err());
    l32.forward_into(&x, &Call::new(1, 32), &mut ws, &mut out).unwrap();
    assert_eq!(out, l32.forward(&x, &Call::new(1, 32)).unwrap());
}
