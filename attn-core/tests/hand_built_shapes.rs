//! `Shape4` and `AttnShape` have public fields, so a caller can build one that the
//! checked constructors would refuse: the reference and the views re-check it and
//! answer with a typed error (before, the reference indexed out of bounds and the
//! views overflowed `usize`).

use attn_core::reference::{dense_backward, dense_forward, dilated_backward, dilated_forward};
use attn_core::{AttnError, AttnShape, Causality, DilatedConfig, Shape4, TensorName, TensorView, TensorViewMut};

fn s(b: usize, n: usize, h: usize, d: usize) -> Shape4 {
    Shape4::new(b, n, h, d).unwrap()
}

#[test]
fn reference_refuses_kv_shapes_that_disagree_with_q() {
    let cfg = DilatedConfig::new(&[4], &[1]).unwrap();
    // Batch and head_dim of k/v differ from q, or k/v heads do not divide q's; buffer
    // lengths match each shape.
    for (q, kv) in [(s(2, 4, 1, 4), s(1, 4, 1, 4)), (s(1, 4, 1, 4), s(1, 4, 1, 2)), (s(1, 4, 3, 2), s(1, 4, 2, 2))] {
        let shape = AttnShape { q, kv };
        let (x, y) = (vec![0.1; q.numel()], vec![0.1; kv.numel()]);
        let mismatch = |r: Result<(), AttnError>| {
            matches!(
                r,
                Err(AttnError::ShapeMismatch { tensor: TensorName::Key, .. } | AttnError::KvHeadsNotDividing { .. })
            )
        };
        assert!(mismatch(dilated_forward(&cfg, shape, &x, &y, &y).map(drop)), "{q:?} / {kv:?}");
        assert!(mismatch(dense_forward(shape, &x, &y, &y, 1.0, Causality::Full).map(drop)), "{q:?} / {kv:?}");
        assert!(mismatch(dilated_backward(&cfg, shape, &x, &y, &y, &x).map(drop)), "{q:?} / {kv:?}");
        assert!(mismatch(dense_backward(shape, &x, &y, &y, &x, 1.0, Causality::Causal).map(drop)), "{q:?} / {kv:?}");
    }
    // Cross-attention (another kv length) and grouped heads (2 query heads on 1) are fine.
    let gqa = AttnShape { q: s(1, 4, 2, 2), kv: s(1, 4, 1, 2) };
    assert!(dilated_forward(&cfg, gqa, &[0.1; 16], &[0.1; 8], &[0.1; 8]).is_ok());
    let shape = AttnShape { q: s(1, 4, 1, 4), kv: s(1, 6, 1, 4) };
    assert!(dense_forward(shape, &[0.1; 16], &[0.1; 24], &[0.1; 24], 1.0, Causality::Full).is_ok());
}

#[test]
fn views_recheck_hand_built_shapes() {
    let zero_seq = Shape4 { batch: 1, seq: 0, heads: 1, head_dim: 2 };
    let huge = Shape4 { batch: usize::MAX, seq: 2, heads: 1, head_dim: 2 };
    let long = Shape4 { batch: 1, seq: usize::MAX / 4, heads: 1, head_dim: 2 };
    let mut buf = [0.0f32; 4];
    let zero = |r: Result<Shape4, AttnError>| matches!(r, Err(AttnError::ZeroDim { dim: "seq", .. }));
    let overflow = |r: Result<Shape4, AttnError>| matches!(r, Err(AttnError::ShapeOverflow { .. }));
    let q = TensorName::Query;
    assert!(zero(TensorView::strided(q, &buf, zero_seq, [0, 5, 0, 1]).map(|v| v.shape())));
    assert!(zero(TensorView::<f32>::contiguous(q, &[], zero_seq).map(|v| v.shape())));
    assert!(zero(TensorViewMut::strided(q, &mut buf, zero_seq, [0, 5, 0, 1]).map(|v| v.shape())));
    assert!(overflow(TensorView::contiguous(q, &buf[..0], huge).map(|v| v.shape())));
    assert!(overflow(TensorViewMut::contiguous(q, &mut buf[..0], huge).map(|v| v.shape())));
    assert!(overflow(TensorView::strided(q, &buf, huge, [4, 2, 2, 1]).map(|v| v.shape())));
    assert!(overflow(TensorView::fused_qkv(&buf, long).map(|v| v[0].shape())));
}
