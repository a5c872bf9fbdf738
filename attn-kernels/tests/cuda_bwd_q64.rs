//! The tensor-core backward with query tiles of 64 rows (`ATTN_CUDA_BWD_QUERIES=64`) on the
//! CUDA emulation: every attention golden file within the float64 reference's bounds, and
//! the gradients of every golden file bit for bit those of 32-row tiles (dK and dV add the
//! same 16-query products in the same order, dQ's per key block sums are the same), with
//! 64 and 128 keys a block, synchronous and pipelined loads, and both dq sums (the
//! deterministic one, and the atomics with blocks in grid order).
#![cfg(feature = "cuda")]

use attn_core::DType;
use attn_kernels::cuda::CudaElement;
use attn_kernels::cuda::plan::{
    BackwardDq, BackwardKernel, BackwardKeys, BackwardLoads, BackwardOptions, BackwardQueries, ForwardRows,
    backward_kernel,
};
use attn_testkit::golden::{DilatedBackend, Problem, assert_attention_dirs_pass, attention_cases};
use half::{bf16, f16};

use crate::cuda_emulation::Emulated;

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn q64(bwd: BackwardOptions) -> BackwardOptions {
    BackwardOptions { queries: BackwardQueries::Q64, ..bwd }
}

/// Every golden file's gradients with 64-row query tiles against 32-row ones, bit for bit,
/// for each backward shape in `shapes`; the number of files whose backward ran on tensor
/// cores (so the comparison cannot pass on the row kernels alone).
fn q64_equals_q32<T: CudaElement>(shapes: &[BackwardOptions]) -> usize {
    let mut mma_files = 0;
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        let [q, k, v, go] = ["q", "k", "v", "grad_out"].map(|t| case.tensor(t).unwrap().data.clone());
        let kernel = backward_kernel(T::DTYPE, T::SUFFIX, p.shape.q.head_dim, q64(shapes[0]));
        if p.masks.block.is_some() || !matches!(kernel, BackwardKernel::Mma { ref name, .. } if name.contains("q64_")) {
            continue;
        }
        mma_files += 1;
        for &bwd in shapes {
            let run =
                |b| Emulated::<T>::new(ForwardRows::M64).with_backward(b).backward(&p, [&q, &k, &v], &go).unwrap();
            let (a, b) = (run(bwd), run(q64(bwd)));
            for (name, x, y) in [("dq", &a.dq, &b.dq), ("dk", &a.dk, &b.dk), ("dv", &a.dv, &b.dv)] {
                assert!(bits(x) == bits(y), "{} {bwd:?}: {name} differs with 64-row query tiles", case.name);
            }
        }
    }
    println!("64-row query tiles = 32-row ones bit for bit on {mma_files} golden files");
    mma_files
}

#[test]
fn q64_gradients_equal_32_row_tiles_bit_for_bit_bf16() {
    let shapes = [
        BackwardOptions { dq: BackwardDq::Deterministic, ..BackwardOptions::default() },
        BackwardOptions { loads: BackwardLoads::Pipelined, keys: BackwardKeys::K128, ..BackwardOptions::default() },
    ];
    let files = q64_equals_q32::<bf16>(&shapes);
    assert!(files >= 20, "only {files} golden files ran the tensor-core backward");
}

#[test]
fn q64_gradients_equal_32_row_tiles_bit_for_bit_f16() {
    let k128 = BackwardOptions { keys: BackwardKeys::K128, dq: BackwardDq::Deterministic, ..Default::default() };
    let files = q64_equals_q32::<f16>(&[k128]);
    assert!(files >= 20, "only {files} golden files ran the tensor-core backward");
}

/// The kernels' names and shared memory: 64-row tiles double the query stages and dS^T.
#[test]
fn q64_kernels_are_named_and_sized() {
    let k128 = BackwardOptions { loads: BackwardLoads::Pipelined, keys: BackwardKeys::K128, ..Default::default() };
    let BackwardKernel::Mma { name, smem_bytes, .. } = backward_kernel(DType::BF16, "bf16", 128, q64(k128)) else {
        panic!("expected the tensor-core backward")
    };
    assert_eq!(name, "dilated_bwd_mma_pipelined_k128_q64_bf16_d128");
    assert_eq!(smem_bytes, (2 * 128 + 2 * 2 * 64) * 136 * 2 + 128 * 72 * 2);
}

/// Every golden file (forward and gradients, gradients into the lse included) with 64-row
/// query tiles in the sm_90 block shape (pipelined, 128 keys), bf16.
#[test]
fn emulated_cuda_golden_q64_backward_bf16() {
    let k128 = BackwardOptions { loads: BackwardLoads::Pipelined, keys: BackwardKeys::K128, ..Default::default() };
    let emulated = Emulated::<bf16>::new(ForwardRows::M64).with_backward(q64(k128));
    assert!(emulated.name().contains("Q64"), "{}", emulated.name());
    assert_attention_dirs_pass(&emulated);
}
