//! A reused workspace against a fresh call: stale values in its buffers never reach the
//! layer's output.

use std::sync::Arc;

use crate::{Call, MultiheadConfig, MultiheadDilatedAttention, MultiheadWorkspace, NamedParams, ReferenceBackend};

/// Garbage in every reused buffer (NaN) cannot reach the output: each is fully
/// overwritten, or re-zeroed when its selection is not known.
#[test]
fn stale_buffers_do_not_leak_into_the_output() {
    let cfg = MultiheadConfig::new(16, 4, attn_core::DilatedConfig::new(&[8, 16], &[1, 2]).unwrap());
    let mut layer = MultiheadDilatedAttention::<f64>::new(cfg, 2, Arc::new(ReferenceBackend)).unwrap();
    for p in layer.weights.params_mut() {
        p.data.iter_mut().enumerate().for_each(|(i, x)| *x += 0.01 * (i as f64).sin());
    }
    let x: Vec<f64> = (0..2 * 16 * 16).map(|i| (i as f64 * 0.37).cos()).collect();
    let want = layer.forward(&x, &Call::new(2, 16)).unwrap();
    let mut ws = MultiheadWorkspace::new();
    let mut out = vec![0.0; want.len()];
    layer.forward_into(&x, &Call::new(2, 16), &mut ws, &mut out).unwrap();
    for buf in [&mut ws.qkv, &mut ws.attn, &mut ws.pre_out] {
        buf.fill(f64::NAN);
    }
    ws.lse.fill(f32::NAN);
    ws.zero_outside = None;
    out.fill(f64::NAN);
    layer.forward_into(&x, &Call::new(2, 16), &mut ws, &mut out).unwrap();
    assert_eq!(out, want);
}
