//! Bad input to the layers is a typed error, never a panic.

use std::sync::Arc;

use attn_core::AttnError;
use attn_multihead::{
    EncoderConfig, LongNetEncoder, Mode, MultiheadConfig, MultiheadDilatedAttention, ReferenceBackend,
};

#[test]
fn bad_shapes_and_configs_are_errors() {
    let layer =
        MultiheadDilatedAttention::<f64>::new(MultiheadConfig::new(8, 2, &[4], &[1]), 1, Arc::new(ReferenceBackend))
            .unwrap();
    let x = vec![0.5; 8 * 8];
    assert!(matches!(layer.forward(&x, 1, 7, Mode::Eval), Err(AttnError::ShapeMismatch { .. })));
    assert!(matches!(layer.forward(&[], 0, 8, Mode::Eval), Err(AttnError::ZeroDim { dim: "batch", .. })));
    assert!(matches!(layer.forward(&x, usize::MAX, 2, Mode::Eval), Err(AttnError::ShapeOverflow { .. })));
    assert!(layer.forward_cross(&x, &x[..40], &x, 1, 8, 5, Mode::Eval).is_err(), "value length disagrees");
    let (_, cache) = layer.forward_train(&x, 1, 8, Mode::Eval).unwrap();
    let mut grads = layer.zero_grads();
    assert!(layer.backward(&cache, &x[..8], &mut grads).is_err(), "grad_out of the wrong size");
    let wrong = MultiheadDilatedAttention::<f64>::new(
        MultiheadConfig::new(8, 2, &[4], &[1]).with_layer_norm(false),
        1,
        Arc::new(ReferenceBackend),
    )
    .unwrap();
    let mut wrong_grads = wrong.zero_grads();
    assert!(layer.backward(&cache, &x, &mut wrong_grads).is_err(), "gradient layout must match");

    let msg =
        MultiheadDilatedAttention::<f32>::new(MultiheadConfig::new(10, 3, &[4], &[1]), 0, Arc::new(ReferenceBackend))
            .unwrap_err()
            .to_string();
    assert!(msg.contains("divisible"), "{msg}");
    assert!(
        LongNetEncoder::<f32>::new(EncoderConfig::new(8, 2, &[4], &[1], 0), 1, 0, Arc::new(ReferenceBackend)).is_err()
    );
    assert!(
        LongNetEncoder::<f32>::new(EncoderConfig::new(8, 2, &[4], &[1], 8), 0, 0, Arc::new(ReferenceBackend)).is_err()
    );
    let cpu = Arc::new(attn_kernels::CpuBackend::new(1).unwrap());
    let on_cpu = layer.clone().with_backend(cpu);
    let r = on_cpu.forward_cross(&x, &x[..48], &x[..48], 1, 8, 6, Mode::Eval);
    assert!(r.is_err(), "the CPU kernels need kv_seq == q_seq: an error, not a panic");
}
