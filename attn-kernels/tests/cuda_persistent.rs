//! The persistent forward (`ATTN_CUDA_FWD_LAUNCH=persistent`: the fused pattern table's
//! blocks as work items that a grid cut to the machine takes from an atomic counter) on the
//! CPU emulation: every golden file it applies to gives the bits of one launch a pattern
//! (which the golden tests hold to the float64 reference), with two and three K/V stages,
//! on the direct and the partial path, its blocks run in grid order and in shuffled orders;
//! and each launch leaves its work counter zeroed (the emulator checks it after every
//! plan), so the next launch needs no fill.
#![cfg(feature = "cuda")]

use std::num::NonZeroU64;

use attn_kernels::cuda::CudaElement;
use attn_kernels::cuda::ForwardPath;
use attn_kernels::cuda::emulation::{BlockOrder, Emulator};
use attn_kernels::cuda::launch_plan::plan_forward;
use attn_kernels::cuda::plan::{ForwardOptions, ForwardRows, ForwardStages, PatternFusion};
use attn_testkit::golden::{Problem, attention_cases};
use half::{bf16, f16};

use crate::cuda_emulation::{Emulated, call_geometry, conv, fresh_emulator};

/// A fresh emulator planning the forward with `opts`, running blocks in `order`.
fn emulator_ordered(opts: ForwardOptions, order: BlockOrder) -> Emulator {
    fresh_emulator()
        .with_forward_rows(opts.rows)
        .with_pattern_fusion(opts.fusion)
        .with_forward_stages(opts.stages)
        .with_block_order(order)
}

fn bits<T: CudaElement>(x: &[T]) -> Vec<u32> {
    x.iter().map(|v| v.to_f32().to_bits()).collect()
}

/// Every golden file with a persistent launch: its output and lse under the persistent
/// forward of `stages` stages equal one launch a pattern's bit for bit (each row is still
/// computed by one block's arithmetic), on both paths, in grid order and two shuffled
/// orders. Counts the files, so it cannot pass by planning no persistent launch.
fn persistent_equals_per_pattern<T: CudaElement>(stages: ForwardStages) {
    let apart = Emulated::<T>::new(ForwardRows::M64).with_stages(stages);
    let persistent = Emulated::<T>::new(ForwardRows::M64).with_stages(stages).with_fusion(PatternFusion::Persistent);
    let seed = |s| BlockOrder::Shuffled(NonZeroU64::new(s).unwrap());
    let emus = [BlockOrder::Grid, seed(11), seed(0xb10c)].map(|o| emulator_ordered(persistent.options(), o));
    let mut compared = Vec::new();
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        let plan = plan_forward(&call_geometry(&p), T::DTYPE, T::SUFFIX, persistent.options()).unwrap();
        if !plan.iter().any(|l| l.work) {
            continue;
        }
        assert!(plan.iter().all(|l| l.work && l.kernel.contains("persistent")), "{}: {plan:?}", case.name);
        let [q, k, v]: [Vec<T>; 3] = ["q", "k", "v"].map(|t| conv(&case.tensor(t).unwrap().data));
        for path in [ForwardPath::Direct, ForwardPath::Partial] {
            let want = apart.forward_on(&p, [&q, &k, &v], path).unwrap();
            for (emu, order) in emus.iter().zip(["grid", "shuffled 11", "shuffled 0xb10c"]) {
                let got = persistent.forward_with(emu, &p, [&q, &k, &v], path).unwrap();
                let what = format!("{} {path:?} blocks in {order} order", case.name);
                assert!(bits(&got.0) == bits(&want.0), "{what}: persistent output differs");
                assert!(bits(&got.1) == bits(&want.1), "{what}: persistent lse differs");
            }
        }
        let items: i64 = plan.iter().map(|l| l.params.work_items).sum();
        compared.push(format!("{} ({} launches, {items} items)", case.name, plan.len()));
    }
    println!("persistent = per pattern bit for bit: {}", compared.join(", "));
    assert!(compared.len() >= 12, "only {} golden files plan a persistent launch", compared.len());
}

#[test]
fn persistent_forward_equals_one_launch_a_pattern_in_any_block_order_bf16() {
    persistent_equals_per_pattern::<bf16>(ForwardStages::Two);
}

#[test]
fn persistent_three_stage_forward_equals_one_launch_a_pattern_in_any_block_order_f16() {
    persistent_equals_per_pattern::<f16>(ForwardStages::Three);
}
