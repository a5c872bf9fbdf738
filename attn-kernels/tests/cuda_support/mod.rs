//! Helpers of the CUDA tests: open the GPU or say why the test cannot run, and the CUDA
//! backend behind the testkit's f32 interface in any dtype.
#![allow(dead_code)]

use attn_kernels::cuda::{CudaBackend, CudaDevice, CudaElement};
use attn_testkit::{Typed, gpu_or_skip};

/// The GPU, or `None` after printing the skip reason (no driver, no NVRTC, no device);
/// with `ATTN_REQUIRE_GPU=1` a missing GPU or library fails the test instead.
pub fn device_or_skip(test: &str) -> Option<CudaDevice> {
    gpu_or_skip(test, CudaDevice::new(0))
}

/// The CUDA backend on `dev` computing in `T`.
pub fn gpu<T: CudaElement>(dev: &CudaDevice) -> Typed<CudaBackend, T> {
    Typed::new(CudaBackend::on(dev.clone()))
}

pub fn conv<T: CudaElement>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}
