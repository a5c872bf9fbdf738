//! Hostile sizes through the CPU backend's public API: absurd thread counts, shapes
//! whose workspace overflows `usize` or that skip `Shape4::new` (public fields), and
//! broadcast (zero-stride) inputs claiming huge shapes. Each is a typed `AttnError` or
//! a saturated size, returned at once: never a panic, an abort, a hang or a wrapped
//! size that slips under a memory budget.

use attn_core::FiniteCheck;
use attn_core::error::TensorName;
use attn_core::{Attention, AttnError, AttnInputs, AttnShape, DilatedConfig, Grads, MemoryBudget, Mixing, Pass, Saved};
use attn_core::{Shape4, TensorView, TensorViewMut};
use attn_kernels::CpuBackend;

fn cfg(mixing: Mixing) -> DilatedConfig {
    DilatedConfig::builder().segments(&[64, 128]).dilations(&[1, 2]).mixing(mixing).build().unwrap()
}

/// Rayon would clamp the request to its maximum (65535) and spawn that many threads
/// (minutes).
#[test]
fn absurd_thread_counts_are_typed_errors() {
    for threads in [usize::MAX, 1 << 20] {
        let r = CpuBackend::new(threads);
        assert!(matches!(r, Err(AttnError::InvalidArgument(_))), "{threads}: {:?}", r.map(|b| b.threads()));
    }
    assert!(CpuBackend::new(0).unwrap().threads() >= 1);
}

/// `Shape4` literals skip validation; the size query must not panic (`clamp(1, 0)`) on a
/// zero sequence length, nor wrap or allocate on overflowing dimensions.
#[test]
fn workspace_of_unchecked_shapes_saturates() {
    let be = CpuBackend::new(1).unwrap();
    let shapes = [
        Shape4 { batch: 1, seq: 0, heads: 2, head_dim: 4 },
        Shape4 { batch: 0, seq: 8, heads: 2, head_dim: 4 },
        Shape4 { batch: 1, seq: 8, heads: 0, head_dim: 4 },
        Shape4 { batch: 1, seq: 8, heads: 2, head_dim: 0 },
        Shape4 { batch: usize::MAX, seq: usize::MAX, heads: usize::MAX, head_dim: usize::MAX },
        Shape4 { batch: 1, seq: 1, heads: usize::MAX, head_dim: 1 },
    ];
    for mixing in [Mixing::LongNet, Mixing::HeadGroups] {
        for s in shapes {
            for pass in [Pass::Forward, Pass::Backward] {
                assert_eq!(be.workspace_bytes(&cfg(mixing), s, pass), usize::MAX, "{s:?} {pass:?}");
            }
        }
    }
    let ok = Shape4::new(1, 8, 2, 4).unwrap();
    let bad = AttnShape { q: ok, kv: Shape4 { seq: 0, ..ok } };
    assert_eq!(be.workspace_bytes(&cfg(Mixing::LongNet), bad, Pass::Backward), usize::MAX);
}

/// A valid shape with 2^56 heads: the forward's size query must not allocate a length
/// per head (abort: "memory allocation failed"), nor the backward's build every head's
/// patterns (a hang).
#[test]
fn workspace_of_absurd_head_counts_returns_at_once() {
    let be = CpuBackend::new(1).unwrap();
    for mixing in [Mixing::LongNet, Mixing::HeadGroups] {
        let s = Shape4::new(1, 1, 1 << 56, 1).unwrap();
        for pass in [Pass::Forward, Pass::Backward] {
            let w = be.workspace_bytes(&cfg(mixing), s, pass);
            // At least the work list: two 40-byte units per (batch, head).
            assert!(w >= 80 << 56, "{mixing:?} {pass:?}: {w}");
        }
    }
}

/// Valid shapes whose workspace exceeds `usize`: the bound saturates rather than wrap (in
/// release) to a small number, so no budget admits it.
#[test]
fn workspace_beyond_usize_saturates() {
    let be = CpuBackend::new(8).unwrap();
    let cfg = DilatedConfig::new(&[1 << 40], &[1]).unwrap();
    let s = Shape4::new(1, 1 << 40, 1, 1 << 19).unwrap();
    assert_eq!(be.workspace_bytes(&cfg, s, Pass::Forward), usize::MAX);
    assert_eq!(be.workspace_bytes(&cfg, s, Pass::Backward), usize::MAX);
}

/// Cross-attention with broadcast (zero-stride) k and v claiming 2^40 positions: a
/// wrapped workspace (about 4.6e14 bytes on 8 threads) would pass a 2^50-byte budget,
/// and the call would then scan 2^59 key elements (a hang).
#[test]
fn wrapped_workspace_cannot_slip_under_a_budget() {
    let be = CpuBackend::new(8).unwrap().with_budget(MemoryBudget::bytes(1 << 50));
    let cfg = DilatedConfig::new(&[1 << 40], &[1]).unwrap();
    let d = 1 << 19;
    let x = vec![0.5f32; d];
    let qs = Shape4::new(1, 1, 1, d).unwrap();
    let kvs = Shape4::new(1, 1 << 40, 1, d).unwrap();
    let q = TensorView::contiguous(TensorName::Query, &x, qs).unwrap();
    let kv = TensorView::strided(TensorName::Key, &x, kvs, [0, 0, 0, 1]).unwrap();
    let mut o = vec![0.0f32; d];
    let mut lse = vec![0.0f32; 1];
    let ov = TensorViewMut::contiguous(TensorName::Output, &mut o, qs).unwrap();
    let r = be.forward(&AttnInputs::new(&cfg, q, kv, kv), ov, &mut lse);
    assert!(matches!(r, Err(AttnError::OverBudget { needed: usize::MAX, .. })), "{r:?}");
}

/// A broadcast q claiming 2^40 heads with an output of another shape: the output check
/// came after planning, which allocated per head (abort: "memory allocation failed").
#[test]
fn outputs_are_checked_before_broadcast_inputs_are_planned() {
    let be = CpuBackend::new(1).unwrap().with_check_finite(FiniteCheck::Inputs);
    let cfg = cfg(Mixing::LongNet);
    let x = vec![0.5f32; 4];
    let big = Shape4::new(1, 1, 1 << 40, 4).unwrap();
    let q = TensorView::strided(TensorName::Query, &x, big, [0, 0, 0, 1]).unwrap();
    let small = Shape4::new(1, 1, 1, 4).unwrap();
    let (mut o, mut lse) = (vec![0.0f32; 4], vec![0.0f32; 1]);
    let ov = TensorViewMut::contiguous(TensorName::Output, &mut o, small).unwrap();
    let r = be.forward(&AttnInputs::new(&cfg, q, q, q), ov, &mut lse);
    assert!(matches!(r, Err(AttnError::ShapeMismatch { tensor: TensorName::Output, .. })), "{r:?}");

    // Backward: out and grad_out broadcast too (they are read-only), dq the caller's.
    let l = vec![0.0f32; 1];
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; 4], vec![0.0f32; 4], vec![0.0f32; 4]);
    let grads = Grads {
        dq: TensorViewMut::contiguous(TensorName::GradQuery, &mut dq, small).unwrap(),
        dk: TensorViewMut::contiguous(TensorName::GradKey, &mut dk, small).unwrap(),
        dv: TensorViewMut::contiguous(TensorName::GradValue, &mut dv, small).unwrap(),
    };
    let r = be.backward(&AttnInputs::new(&cfg, q, q, q), Saved { out: q, lse: &l }, q, grads);
    assert!(matches!(r, Err(AttnError::ShapeMismatch { .. })), "{r:?}");
}
