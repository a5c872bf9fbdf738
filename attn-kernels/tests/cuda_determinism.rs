//! The deterministic backward of the CUDA path (`BackwardDq::Deterministic`: the tensor-core
//! kernel computes dK and dV only, the query-major tensor-core dq kernel adds dQ) on the CPU
//! emulation:
//! bit-identical gradients whatever order a launch's blocks run in, where the default's dQ
//! atomics round differently from one order to the next (shown, so the comparison bites),
//! and gradients within the float64 reference's bounds, golden files included.
#![cfg(feature = "cuda")]

use std::num::NonZeroU64;

use attn_core::{AttnShape, DType, DilatedConfig, Shape4};
use attn_kernels::cuda::emulation::{BlockOrder, Emulator};
use attn_kernels::cuda::plan::{
    BackwardDq, BackwardKernel, BackwardKeys, BackwardLoads, BackwardOptions, BackwardWrites, ForwardRows,
    backward_kernel,
};
use attn_testkit::FeatureCase;
use attn_testkit::golden::{Gradients32, assert_attention_dirs_pass};
use half::bf16;

use crate::cuda_emulation::{Emulated, fresh_emulator};

/// A fresh emulator planning the backward with `bwd`, running blocks in `order`.
fn emulator_ordered(bwd: BackwardOptions, order: BlockOrder) -> Emulator {
    fresh_emulator()
        .with_backward_loads(bwd.loads)
        .with_backward_keys(bwd.keys)
        .with_backward_dq(bwd.dq)
        .with_backward_writes(bwd.writes)
        .with_block_order(order)
}

/// Every query row reads 256 keys (4 blocks of 64, 2 of 128) of one segment, head_dim 64,
/// two query heads a k/v head.
fn many_key_blocks() -> FeatureCase {
    let cfg = DilatedConfig::builder().segments(&[256, 512]).dilations(&[1, 2]).build().unwrap();
    let shape = AttnShape { q: Shape4::new(1, 512, 2, 64).unwrap(), kv: Shape4::new(1, 512, 1, 64).unwrap() };
    FeatureCase { cfg, shape, padding: None, cu_seqlens: None, seed: 20_261_202 }
}

fn orders() -> [BlockOrder; 3] {
    let seed = |s| BlockOrder::Shuffled(NonZeroU64::new(s).unwrap());
    [BlockOrder::Grid, seed(7), seed(0x5eed)]
}

fn bits(g: &Gradients32) -> [Vec<u32>; 3] {
    [&g.dq, &g.dk, &g.dv].map(|x| x.iter().map(|v| v.to_bits()).collect())
}

/// The gradients of `case` in bf16 under `bwd` with the blocks of every launch in each of
/// [`orders`].
fn gradients_in_every_order(case: &FeatureCase, bwd: BackwardOptions) -> Vec<Gradients32> {
    let p = case.problem();
    let [q, k, v, go] = case.inputs();
    let emulated = Emulated::<bf16>::new(ForwardRows::M64).with_backward(bwd);
    orders()
        .into_iter()
        .map(|order| emulated.gradients_on(&emulator_ordered(bwd, order), &p, [&q, &k, &v], &go, None).unwrap())
        .collect()
}

#[test]
fn deterministic_dq_gives_the_same_bits_in_any_block_order() {
    let case = many_key_blocks();
    let shapes = [
        (BackwardLoads::Sync, BackwardKeys::K64, BackwardWrites::Accumulated),
        (BackwardLoads::Pipelined, BackwardKeys::K128, BackwardWrites::Accumulated),
        (BackwardLoads::Pipelined, BackwardKeys::K128, BackwardWrites::Direct),
    ];
    for (loads, keys, writes) in shapes {
        let bwd = BackwardOptions { loads, keys, dq: BackwardDq::Deterministic, writes, ..BackwardOptions::default() };
        let BackwardKernel::Mma { name, dq: Some(dq), .. } = backward_kernel(DType::BF16, "bf16", 64, bwd) else {
            panic!("expected the tensor-core kernel without dq")
        };
        assert!(name.contains("_dkv_") && dq.name == "dilated_bwd_dq_mma_bf16_d64", "{name}, {dq:?}");
        let runs = gradients_in_every_order(&case, bwd);
        let first = bits(&runs[0]);
        for (order, run) in orders().iter().zip(&runs).skip(1) {
            for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(first.iter().zip(&bits(run))) {
                assert!(
                    a == b,
                    "{loads:?} {keys:?} {writes:?}: {name} with blocks in {order:?} differs from grid order"
                );
            }
        }
        let emulated = Emulated::<bf16>::new(ForwardRows::M64).with_backward(bwd);
        if let Err(e) = attn_testkit::judge_gradients(&emulated, &case) {
            panic!("{loads:?} {keys:?}: {e}");
        }
    }
}

/// The default's dQ atomics do depend on the block order in the emulation: without this,
/// the test above could not tell a deterministic sum from an order that never changes.
#[test]
fn atomic_dq_rounds_differently_when_blocks_run_in_another_order() {
    let runs = gradients_in_every_order(&many_key_blocks(), BackwardOptions::default());
    let dq: Vec<[Vec<u32>; 3]> = runs.iter().map(bits).collect();
    assert!(dq.iter().skip(1).any(|b| b[0] != dq[0][0]), "dq came out the same in every block order");
    // dk and dv have one writer a row within a launch: the same bits in every order.
    assert!(dq.iter().all(|b| b[1] == dq[0][1] && b[2] == dq[0][2]), "dk or dv depends on the block order");
}

#[test]
fn emulated_cuda_golden_bf16_deterministic_dq() {
    let bwd = BackwardOptions { dq: BackwardDq::Deterministic, ..BackwardOptions::default() };
    assert_attention_dirs_pass(&Emulated::<bf16>::new(ForwardRows::M64).with_backward(bwd));
}
