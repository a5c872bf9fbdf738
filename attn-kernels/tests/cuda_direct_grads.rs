//! A whole call's backward writing dk and dv straight from the tensor-core kernel into the
//! gradients (`BackwardWrites::Direct`) on the CUDA emulation: the same bits as through the
//! f32 accumulators and their epilogue on every attention golden file where it applies
//! (every head one pattern, as many key/value heads as query heads), with each backward
//! block shape and dq sum; elsewhere the accumulators run. Keys no pattern selects and
//! padded keys keep zero gradients because the call zeroes dk and dv first.
#![cfg(feature = "cuda")]

use attn_kernels::cuda::CudaElement;
use attn_kernels::cuda::launch_plan::plan_backward_direct;
use attn_kernels::cuda::plan::{BackwardDq, BackwardKeys, BackwardLoads, BackwardOptions, BackwardWrites, ForwardRows};
use attn_testkit::golden::{DilatedBackend, Problem, attention_cases};
use half::{bf16, f16};

use crate::cuda_emulation::{Emulated, call_geometry};

/// The attention golden files with one pattern a head and no grouped key/value heads.
const DIRECT_FILES: usize = 12;

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Every golden file's gradients with dk and dv written directly against the accumulated
/// ones, bit for bit, for each backward shape in `shapes`; the number of files the direct
/// plan applied to.
fn direct_equals_accumulated<T: CudaElement>(shapes: &[BackwardOptions]) -> usize {
    let mut direct_files = 0;
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        let [q, k, v, go] = ["q", "k", "v", "grad_out"].map(|t| case.tensor(t).unwrap().data.clone());
        let mut applied = false;
        for &bwd in shapes {
            let direct = BackwardOptions { writes: BackwardWrites::Direct, ..bwd };
            applied |= plan_backward_direct(&call_geometry(&p), T::DTYPE, T::SUFFIX, direct).unwrap().is_some();
            let run =
                |b| Emulated::<T>::new(ForwardRows::M64).with_backward(b).backward(&p, [&q, &k, &v], &go).unwrap();
            let (a, d) = (run(bwd), run(direct));
            for (name, x, y) in [("dq", &a.dq, &d.dq), ("dk", &a.dk, &d.dk), ("dv", &a.dv, &d.dv)] {
                assert!(
                    bits(x) == bits(y),
                    "{} {bwd:?}: {name} differs when dk and dv are written directly",
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
    let files = direct_equals_accumulated::<bf16>(&shapes);
    assert_eq!(files, DIRECT_FILES, "golden files the direct plan applies to");
}

#[test]
fn direct_dk_dv_give_the_accumulated_bits_f16_128_keys_pipelined() {
    let k128 = BackwardOptions { loads: BackwardLoads::Pipelined, keys: BackwardKeys::K128, ..Default::default() };
    let files = direct_equals_accumulated::<f16>(&[k128]);
    assert_eq!(files, DIRECT_FILES, "golden files the direct plan applies to");
}
