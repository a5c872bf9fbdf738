//! A whole call's backward writing gradients straight from the tensor-core kernels into the
//! caller's tensors (`BackwardWrites::Direct`) on the CUDA emulation: the same bits as
//! through the f32 accumulators and their epilogue on every attention golden file where it
//! applies (dk and dv: every head one pattern, as many key/value heads as query heads; dq:
//! every head one pattern, the deterministic dq kernel), with each backward block shape and
//! dq sum; elsewhere the accumulators run. Rows no pattern selects and padded keys keep
//! zero gradients because the call zeroes the direct gradients first.
#![cfg(feature = "cuda")]

use attn_kernels::cuda::CudaElement;
use attn_kernels::cuda::launch_plan::{DirectGrads, plan_backward_direct};
use attn_kernels::cuda::plan::{BackwardDq, BackwardKeys, BackwardLoads, BackwardOptions, BackwardWrites, ForwardRows};
use attn_testkit::golden::{DilatedBackend, Problem, attention_cases};
use half::{bf16, f16};

use crate::cuda_emulation::{Emulated, call_geometry};

/// The attention golden files with one pattern a head and no grouped key/value heads (dk
/// and dv direct).
const DIRECT_FILES: usize = 12;

/// The attention golden files with one pattern a head (dq direct under the deterministic
/// dq kernel).
const DIRECT_DQ_FILES: usize = 15;

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Every golden file's gradients with direct writes against the accumulated ones, bit for
/// bit, for each backward shape in `shapes`; the number of files where the direct plan
/// wrote `which` (dq, or dk and dv) directly.
fn direct_equals_accumulated<T: CudaElement>(shapes: &[BackwardOptions], which: DirectGrads) -> usize {
    let mut direct_files = 0;
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        let [q, k, v, go] = ["q", "k", "v", "grad_out"].map(|t| case.tensor(t).unwrap().data.clone());
        let mut applied = false;
        for &bwd in shapes {
            let direct = BackwardOptions { writes: BackwardWrites::Direct, ..bwd };
            let plan = plan_backward_direct(&call_geometry(&p), T::DTYPE, T::SUFFIX, direct, DirectGrads::All).unwrap();
            applied |= plan.is_some_and(|d| (which.dq() && d.grads.dq()) || (which.dkv() && d.grads.dkv()));
            let run =
                |b| Emulated::<T>::new(ForwardRows::M64).with_backward(b).backward(&p, [&q, &k, &v], &go).unwrap();
            let (a, d) = (run(bwd), run(direct));
            for (name, x, y) in [("dq", &a.dq, &d.dq), ("dk", &a.dk, &d.dk), ("dv", &a.dv, &d.dv)] {
                assert!(
                    bits(x) == bits(y),
                    "{} {bwd:?}: {name} differs when gradients are written directly",
                    case.name
                );
            }
        }
        direct_files += usize::from(applied);
    }
    direct_files
}

#[test]
fn direct_dk_dv_give_the_accumulated_bits_bf16() {
    let shapes = [BackwardOptions::default(), BackwardOptions { dq: BackwardDq::Deterministic, ..Default::default() }];
    let files = direct_equals_accumulated::<bf16>(&shapes, DirectGrads::KeysValues);
    assert_eq!(files, DIRECT_FILES, "golden files the direct plan applies to");
}

#[test]
fn direct_dk_dv_give_the_accumulated_bits_f16_128_keys_pipelined() {
    let k128 = BackwardOptions { loads: BackwardLoads::Pipelined, keys: BackwardKeys::K128, ..Default::default() };
    let files = direct_equals_accumulated::<f16>(&[k128], DirectGrads::KeysValues);
    assert_eq!(files, DIRECT_FILES, "golden files the direct plan applies to");
}

#[test]
fn direct_dq_gives_the_accumulated_bits_under_the_deterministic_dq_kernel() {
    let det = BackwardOptions { dq: BackwardDq::Deterministic, ..Default::default() };
    let det_k128 = BackwardOptions { keys: BackwardKeys::K128, loads: BackwardLoads::Pipelined, ..det };
    assert_eq!(direct_equals_accumulated::<bf16>(&[det], DirectGrads::Queries), DIRECT_DQ_FILES, "bf16 files");
    assert_eq!(direct_equals_accumulated::<f16>(&[det_k128], DirectGrads::Queries), DIRECT_DQ_FILES, "f16 files");
}
