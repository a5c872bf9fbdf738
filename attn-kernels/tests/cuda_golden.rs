//! Golden conformance on the GPU: every file in `conformance/dilated` and
//! `conformance/features` (grouped key/value heads, key padding, packed sequences,
//! sliding windows) through the CUDA backend in f32, bf16 and f16 (forward, lse where
//! present, dq/dk/dv), judged like the CPU golden tests. Skips, printing the reason, when
//! no driver, NVRTC or GPU is present (fails instead with `ATTN_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod cuda_support;

use attn_kernels::cuda::CudaElement;
use attn_testkit::golden::assert_attention_dirs_pass;
use cuda_support::{device_or_skip, gpu};
use half::{bf16, f16};

fn run_all<T: CudaElement>(test: &str) {
    let Some(dev) = device_or_skip(test) else { return };
    assert_attention_dirs_pass(&gpu::<T>(&dev));
}

#[test]
fn golden_cuda_f32() {
    run_all::<f32>("golden_cuda_f32");
}

#[test]
fn golden_cuda_bf16() {
    run_all::<bf16>("golden_cuda_bf16");
}

#[test]
fn golden_cuda_f16() {
    run_all::<f16>("golden_cuda_f16");
}
