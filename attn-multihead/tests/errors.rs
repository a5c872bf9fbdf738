//! Bad input to the layers is a typed error, never a panic.

use std::sync::Arc;

use attn_core::{AttnError, DilatedConfig};
use attn_multihead::{
    Attention, Call, Cross, EncoderConfig, LayerNorm, Linear, LongNetEncoder, LongNetEncoderLayer, MultiheadConfig,
    MultiheadDilatedAttention, ReferenceBackend, SeededRng,
};
use attn_multihead::{Bias, LayerNorms};

#[test]
fn bad_shapes_and_configs_are_errors() {
    let layer = MultiheadDilatedAttention::<f64>::new(
        MultiheadConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap()),
        1,
        Arc::new(ReferenceBackend),
    )
    .unwrap();
    let x = vec![0.5; 8 * 8];
    assert!(matches!(layer.forward(&x, &Call::new(1, 7)), Err(AttnError::ShapeMismatch { .. })));
    assert!(matches!(layer.forward(&[], &Call::new(0, 8)), Err(AttnError::ZeroDim { dim: "batch", .. })));
    assert!(matches!(layer.forward(&x, &Call::new(usize::MAX, 2)), Err(AttnError::ShapeOverflow { .. })));
    assert!(
        layer.forward_train(&x, &Call::new(1, 8).cross(Cross::new(&x[..40], &x, 5))).is_err(),
        "value length disagrees"
    );
    let (_, cache) = layer.forward_train(&x, &Call::new(1, 8)).unwrap();
    let mut grads = layer.zero_grads();
    assert!(layer.backward(&cache, &x[..8], &mut grads).is_err(), "grad_out of the wrong size");
    let wrong = MultiheadDilatedAttention::<f64>::new(
        MultiheadConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap()).with_layer_norm(LayerNorms::Absent),
        1,
        Arc::new(ReferenceBackend),
    )
    .unwrap();
    let mut wrong_grads = wrong.zero_grads();
    assert!(layer.backward(&cache, &x, &mut wrong_grads).is_err(), "gradient layout must match");

    let msg = MultiheadDilatedAttention::<f32>::new(
        MultiheadConfig::new(10, 3, DilatedConfig::new(&[4], &[1]).unwrap()),
        0,
        Arc::new(ReferenceBackend),
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("divisible"), "{msg}");
    assert!(
        LongNetEncoder::<f32>::new(
            EncoderConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap(), 0),
            1,
            0,
            Arc::new(ReferenceBackend)
        )
        .is_err()
    );
    assert!(
        LongNetEncoder::<f32>::new(
            EncoderConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap(), 8),
            0,
            0,
            Arc::new(ReferenceBackend)
        )
        .is_err()
    );
    let cpu = Arc::new(attn_kernels::CpuBackend::new(1).unwrap());
    let on_cpu = layer.clone().with_backend(cpu);
    let r = on_cpu.forward_train(&x, &Call::new(1, 8).cross(Cross::new(&x[..48], &x[..40], 6)));
    assert!(matches!(r, Err(AttnError::ShapeMismatch { .. })), "value length disagrees on the CPU too");
}

/// The ring splits one sequence for queries, keys and values: cross-attention with a
/// different key/value length is refused on every rank with a typed error naming it
/// (forward and backward), never a hang or a panic.
#[cfg(feature = "ring")]
#[test]
fn ring_cross_attention_with_other_kv_length_is_a_typed_error() {
    use attn_multihead::{MultiheadWeights, ring_layer};
    use attn_ring::{Layout, RingBackend, Strategy, ThreadComm};
    let (cfg, seq, e) = (MultiheadConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap()), 12, 8);
    let errors: Vec<AttnError> = std::thread::scope(|s| {
        let ranks: Vec<_> = ThreadComm::world(2)
            .unwrap()
            .into_iter()
            .map(|comm| {
                let cfg = cfg.clone();
                s.spawn(move || {
                    let backend = Arc::new(RingBackend::new(comm, seq, Layout::Contiguous, Strategy::Auto).unwrap());
                    let rows = backend.positions().len();
                    let layer = ring_layer(cfg.clone(), MultiheadWeights::<f32>::magneto(&cfg, 1), backend).unwrap();
                    let (q, kv) = (vec![0.25f32; rows * e], vec![0.5f32; (rows + 3) * e]);
                    let err =
                        layer.forward_train(&q, &Call::new(1, rows).cross(Cross::new(&kv, &kv, rows + 3))).unwrap_err();
                    // Same lengths still work on the same ring afterwards.
                    let (y, cache) =
                        layer.forward_train(&q, &Call::new(1, rows).cross(Cross::new(&q, &q, rows))).unwrap();
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
        assert!(matches!(err, AttnError::Unsupported { backend: "ring", .. }), "{msg}");
        assert!(msg.contains("kv_seq != q_seq") && msg.contains("ring"), "{msg}");
    }
}

/// The layer's `weights` field is public: weights resized by hand (a q/k/v bias of
/// `embed_dim` instead of `3 * embed_dim`, a truncated in_proj) must not panic inside
/// the projection (slice out of range): every pass checks the layout first.
#[test]
fn hand_resized_weights_are_a_typed_error() {
    let cfg = MultiheadConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap());
    let layer = MultiheadDilatedAttention::<f32>::new(cfg, 1, Arc::new(ReferenceBackend)).unwrap();
    let x = vec![0.1f32; 64];
    let (_, cache) = layer.forward_train(&x, &Call::new(1, 8)).unwrap();
    let mut short_bias = layer.clone();
    short_bias.weights.in_proj.bias = Some(vec![0.0; 8]);
    let mut short_weight = layer.clone();
    short_weight.weights.in_proj.weight.truncate(64);
    for bad in [short_bias, short_weight] {
        let layout =
            |r: attn_core::Result<()>| matches!(r, Err(AttnError::InvalidArgument(m)) if m.contains("do not match"));
        assert!(layout(bad.forward(&x, &Call::new(1, 8)).map(drop)));
        assert!(layout(bad.forward_train(&x, &Call::new(1, 8)).map(drop)));
        assert!(layout(bad.forward_train(&x, &Call::new(1, 8).cross(Cross::new(&x, &x, 8))).map(drop)));
        let mut grads = layer.zero_grads();
        assert!(layout(bad.backward(&cache, &x, &mut grads).map(drop)));
        let mut bad_grads = bad.weights.clone();
        assert!(layout(layer.backward(&cache, &x, &mut bad_grads).map(drop)), "gradient accumulator layout");
    }
}

/// An `embed_dim` whose `embed_dim^2` weights overflow `usize` (2^32) must not panic
/// building the layer (a wrapped, empty weight chunked by zero), nor a
/// `dim_feedforward` as large with a capacity overflow.
#[test]
fn overflowing_layer_sizes_are_typed_errors() {
    let cfg = MultiheadConfig::new(1 << 32, 1, DilatedConfig::new(&[4], &[1]).unwrap())
        .with_bias(Bias::Absent)
        .with_layer_norm(LayerNorms::Absent);
    assert!(matches!(cfg.validate(), Err(AttnError::ShapeOverflow { .. })));
    let r = MultiheadDilatedAttention::<f32>::new(cfg, 0, Arc::new(ReferenceBackend));
    assert!(matches!(r, Err(AttnError::ShapeOverflow { .. })));
    let enc = EncoderConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap(), usize::MAX / 4);
    assert!(matches!(enc.validate(), Err(AttnError::ShapeOverflow { .. })));
    let r = LongNetEncoderLayer::<f32>::new(enc, 1, Arc::new(ReferenceBackend));
    assert!(matches!(r, Err(AttnError::ShapeOverflow { .. })));
}

/// A NaN or negative LayerNorm eps (public field, unchecked `LayerNorm::new`) made
/// every output NaN without an error.
#[test]
fn layer_norm_eps_must_be_finite_and_positive() {
    let x = [1.0f32, 1.0, 2.0, 3.0];
    for eps in [f64::NAN, -1.0, 0.0, f64::INFINITY] {
        let r = LayerNorm::<f32>::new(4, eps).forward(&x);
        assert!(matches!(&r, Err(AttnError::InvalidArgument(m)) if m.contains("eps")), "eps {eps}: {r:?}");
    }
    let mut layer = MultiheadDilatedAttention::<f32>::new(
        MultiheadConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap()),
        1,
        Arc::new(ReferenceBackend),
    )
    .unwrap();
    layer.weights.norm.as_mut().unwrap().eps = f64::NAN;
    assert!(matches!(layer.forward(&[0.1; 64], &Call::new(1, 8)), Err(AttnError::InvalidArgument(_))));
}

/// `Linear::forward` sized its output `rows * out_dim` before looking at the input:
/// a wrapping product panicked (debug) and a huge `rows` aborted on allocation.
#[test]
fn linear_rows_are_checked_before_allocating() {
    let lin = Linear::<f32>::xavier(&mut SeededRng::new(1), 2, 2, 1.0, attn_multihead::Bias::Zeros);
    assert!(matches!(lin.forward(&[], usize::MAX / 2 + 1), Err(AttnError::ShapeOverflow { .. })));
    assert!(matches!(lin.forward(&[], 1 << 40), Err(AttnError::InvalidArgument(_))));
    let mut g = lin.zeros_like();
    assert!(matches!(lin.backward(&[], usize::MAX / 2 + 1, &[], &mut g), Err(AttnError::ShapeOverflow { .. })));
}

/// `LongNetEncoder::layers` is public: an empty stack panicked (`layers[0]`) in
/// `forward` and `forward_windows`.
#[test]
fn an_empty_encoder_stack_is_a_typed_error() {
    let empty = LongNetEncoder::<f32> { layers: vec![] };
    let x = [0.0f32; 16];
    assert!(matches!(empty.forward(&x, &Call::new(1, 2)), Err(AttnError::InvalidArgument(_))));
    assert!(matches!(empty.forward_windows(&x, 1, 2, 2, |_| {}), Err(AttnError::InvalidArgument(_))));
}

/// Gradients made for another encoder layer (another `dim_feedforward`) were
/// accumulated into the wrong elements (or partly dropped) and backward returned Ok.
#[test]
fn encoder_gradients_of_another_layout_are_refused() {
    let be: Arc<dyn Attention<f64>> = Arc::new(ReferenceBackend);
    let a = LongNetEncoderLayer::<f64>::new(
        EncoderConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap(), 16),
        1,
        be.clone(),
    )
    .unwrap();
    let b =
        LongNetEncoderLayer::<f64>::new(EncoderConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap(), 32), 1, be)
            .unwrap();
    let x = vec![0.3; 64];
    let (y, cache) = a.forward_train(&x, &Call::new(1, 8)).unwrap();
    let mut wrong = b.zero_grads();
    let r = a.backward(&cache, &y, &mut wrong);
    assert!(matches!(&r, Err(AttnError::InvalidArgument(m)) if m.contains("does not match")), "{r:?}");
    assert!(wrong == b.zero_grads(), "refused gradients are left untouched");
    assert!(a.backward(&cache, &y, &mut a.zero_grads()).is_ok());
}

/// A `Call` a layer cannot run is refused with a typed error naming the layer and the
/// feature: cross-attention keys in an encoder, masks through a token order; keys of
/// another length through a token order need their grid.
#[test]
fn calls_a_layer_cannot_run_are_typed_errors() {
    use attn_core::{Feature, KeyPadding, Masks};
    use attn_hilbert::{Grid, OrderKind};
    let attention = || DilatedConfig::new(&[4], &[1]).unwrap();
    let (b, s, e) = (1, 4, 8);
    let (x, kv) = (vec![0.5f64; b * s * e], vec![0.25f64; b * 6 * e]);
    let cross = Call::new(b, s).cross(Cross::new(&kv, &kv, 6));
    let refused = |r: Result<Vec<f64>, AttnError>, layer: &str, feature: Feature| {
        assert!(
            matches!(r, Err(AttnError::Unsupported { backend, feature: f }) if backend == layer && f == feature),
            "{layer} {feature:?}"
        );
    };
    let enc = LongNetEncoder::<f64>::new(EncoderConfig::new(e, 2, attention(), 12), 2, 1, Arc::new(ReferenceBackend));
    let enc = enc.unwrap();
    refused(enc.forward(&x, &cross), "LongNetEncoderLayer", Feature::CrossAttention);
    refused(enc.layers[0].forward(&x, &cross), "LongNetEncoderLayer", Feature::CrossAttention);
    assert!(matches!(enc.forward_train(&x, &cross), Err(AttnError::Unsupported { .. })));

    let layer =
        MultiheadDilatedAttention::<f64>::new(MultiheadConfig::new(e, 2, attention()), 1, Arc::new(ReferenceBackend));
    let ordered = layer.unwrap().with_token_order(Grid::new_2d(2, 2).unwrap(), OrderKind::Hilbert).unwrap();
    let flags = [false, false, false, true];
    let masks = Masks { key_padding: Some(KeyPadding::new(&flags, b, s).unwrap()), ..Masks::NONE };
    refused(ordered.forward(&x, &Call::new(b, s).masks(masks)), "OrderedAttention", Feature::KeyPadding);
    assert!(matches!(ordered.forward(&x, &cross), Err(AttnError::InvalidArgument(m)) if m.contains("grid")));
    assert!(ordered.forward(&x, &Call::new(b, 5)).is_err(), "a sequence other than the grid's tokens");
}
