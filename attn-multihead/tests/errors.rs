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
    let r = on_cpu.forward_cross(&x, &x[..48], &x[..40], 1, 8, 6, Mode::Eval);
    assert!(matches!(r, Err(AttnError::ShapeMismatch { .. })), "value length disagrees on the CPU too");
}

/// The ring splits one sequence for queries, keys and values: cross-attention with a
/// different key/value length is refused on every rank with a typed error naming it
/// (forward and backward), never a hang or a panic.
#[test]
fn ring_cross_attention_with_other_kv_length_is_a_typed_error() {
    use attn_multihead::{MultiheadWeights, RingBackend, ring_layer};
    use attn_ring::{Layout, Strategy, ThreadComm};
    let (cfg, seq, e) = (MultiheadConfig::new(8, 2, &[4], &[1]), 12, 8);
    let errors: Vec<AttnError> = std::thread::scope(|s| {
        let ranks: Vec<_> = ThreadComm::world(2)
            .unwrap()
            .into_iter()
            .map(|comm| {
                let cfg = cfg.clone();
                s.spawn(move || {
                    let backend = Arc::new(RingBackend::new(comm, seq, Layout::Contiguous, Strategy::Auto).unwrap());
                    let rows = backend.positions().unwrap().len();
                    let layer = ring_layer(cfg.clone(), MultiheadWeights::<f32>::magneto(&cfg, 1), backend).unwrap();
                    let (q, kv) = (vec![0.25f32; rows * e], vec![0.5f32; (rows + 3) * e]);
                    let err = layer.forward_cross(&q, &kv, &kv, 1, rows, rows + 3, Mode::Eval).unwrap_err();
                    // Same lengths still work on the same ring afterwards.
                    let (y, cache) = layer.forward_cross(&q, &q, &q, 1, rows, rows, Mode::Eval).unwrap();
                    assert_eq!(y.len(), rows * e);
                    let mut grads = layer.zero_grads();
                    layer.backward(&cache, &y, &mut grads).unwrap();
                    err
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for err in errors {
        let msg = err.to_string();
        assert!(matches!(err, AttnError::InvalidArgument(_)), "{msg}");
        assert!(msg.contains("kv_seq != q_seq") && msg.contains("ring"), "{msg}");
    }
}
