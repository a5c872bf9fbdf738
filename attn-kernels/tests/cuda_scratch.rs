//! The lean call path's scratch on the CPU emulation: whole calls of one shape allocate
//! their f32 scratch (the backward's accumulators and delta, the forward's partial where
//! the output cannot come straight from the kernel) on the first call only, through the
//! pool code the device runs; a new shape allocates anew; where gradients go straight into
//! the caller's tensors, no accumulators for them; the persistent forward's work counter,
//! allocated zeroed once and never filled again (each launch leaves it zeroed, which the
//! emulator checks after every plan).
#![cfg(feature = "cuda")]

use attn_core::{AttnShape, DilatedConfig, Mixing, Shape4};
use attn_kernels::cuda::plan::{BackwardDq, BackwardOptions, BackwardWrites, ForwardRows, PatternFusion};
use attn_testkit::FeatureCase;
use attn_testkit::golden::DilatedBackend;
use half::bf16;

use crate::cuda_emulation::Emulated;

fn case(mixing: Mixing, seq: usize) -> FeatureCase {
    let cfg = DilatedConfig::builder().segments(&[64, 128]).dilations(&[1, 2]).mixing(mixing).build().unwrap();
    FeatureCase {
        cfg,
        shape: AttnShape::self_attn(Shape4::new(1, seq, 2, 32).unwrap()),
        padding: None,
        cu_seqlens: None,
        seed: 5,
    }
}

/// Allocations after each of three forward+backward calls of `case`.
fn allocations_over_three_calls(emulated: &Emulated<bf16>, case: &FeatureCase) -> Vec<u64> {
    let [q, k, v, go] = case.inputs();
    (0..3)
        .map(|_| {
            emulated.backward(&case.problem(), [&q, &k, &v], &go).unwrap();
            emulated.scratch_allocations()
        })
        .collect()
}

#[test]
fn repeated_calls_of_one_shape_allocate_scratch_on_the_first_only() {
    // Head groups: the forward writes its output straight from the kernel (no partial); the
    // backward takes delta and three accumulators.
    let emulated = Emulated::<bf16>::new(ForwardRows::M64);
    assert_eq!(allocations_over_three_calls(&emulated, &case(Mixing::HeadGroups, 256)), [4, 4, 4]);
    // LongNet: the forward's partial too (out; its lse is the caller's).
    let emulated = Emulated::<bf16>::new(ForwardRows::M64);
    assert_eq!(allocations_over_three_calls(&emulated, &case(Mixing::LongNet, 256)), [5, 5, 5]);
    // Another length: each buffer once more, then none.
    assert_eq!(allocations_over_three_calls(&emulated, &case(Mixing::LongNet, 192)), [10, 10, 10]);
    // dk and dv written straight into the gradients (head groups): delta and dq only; LongNet
    // heads (two patterns a head) keep the accumulators.
    let direct = BackwardOptions { writes: BackwardWrites::Direct, ..BackwardOptions::default() };
    let emulated = Emulated::<bf16>::new(ForwardRows::M64).with_backward(direct);
    assert_eq!(allocations_over_three_calls(&emulated, &case(Mixing::HeadGroups, 256)), [2, 2, 2]);
    let emulated = Emulated::<bf16>::new(ForwardRows::M64).with_backward(direct);
    assert_eq!(allocations_over_three_calls(&emulated, &case(Mixing::LongNet, 256)), [5, 5, 5]);
    // dq too, under the deterministic dq kernel (head groups): delta alone.
    let every = BackwardOptions { dq: BackwardDq::Deterministic, ..direct };
    let emulated = Emulated::<bf16>::new(ForwardRows::M64).with_backward(every);
    assert_eq!(allocations_over_three_calls(&emulated, &case(Mixing::HeadGroups, 256)), [1, 1, 1]);
    // The persistent forward: its work counter once more, whatever the call (the partial
    // path of LongNet heads plans no persistent launch: one pattern per head is needed).
    let persistent = || Emulated::<bf16>::new(ForwardRows::M64).with_fusion(PatternFusion::Persistent);
    assert_eq!(allocations_over_three_calls(&persistent(), &case(Mixing::HeadGroups, 256)), [5, 5, 5]);
    assert_eq!(allocations_over_three_calls(&persistent(), &case(Mixing::LongNet, 256)), [5, 5, 5]);
    let emulated = persistent();
    assert_eq!(allocations_over_three_calls(&emulated, &case(Mixing::HeadGroups, 256)), [5, 5, 5]);
    assert_eq!(allocations_over_three_calls(&emulated, &case(Mixing::HeadGroups, 192)), [9, 9, 9]);
}
