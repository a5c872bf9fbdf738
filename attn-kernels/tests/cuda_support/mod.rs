//! Helpers of the CUDA tests: open the GPU or print why the test is skipped, and the CUDA
//! backend behind the testkit's `DilatedBackend` trait for any dtype.
#![allow(dead_code)]

use attn_core::{AttnError, AttnShape, DType, DilatedConfig, Result};
use attn_kernels::cuda::{CudaDevice, CudaElement, backward_vec, forward_vec};
use attn_testkit::golden::{Forward32, Gradients32};
use attn_testkit::{DilatedBackend, skip_gpu_test};

/// The GPU, or `None` after printing the skip reason (no driver, no NVRTC, no device);
/// with `ATTN_REQUIRE_GPU=1` a missing GPU or library fails the test instead.
pub fn device_or_skip(test: &str) -> Option<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(dev) => Some(dev),
        Err(e @ AttnError::BackendUnavailable { .. }) => {
            skip_gpu_test(test, e);
            None
        }
        Err(e) => panic!("{test}: opening the GPU failed with an unexpected error: {e}"),
    }
}

pub fn conv<T: CudaElement>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

pub fn back<T: CudaElement>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// The CUDA backend computing in dtype `T`.
pub struct Gpu<T> {
    pub dev: CudaDevice,
    _t: std::marker::PhantomData<T>,
}

impl<T: CudaElement> Gpu<T> {
    pub fn new(dev: CudaDevice) -> Self {
        Gpu { dev, _t: std::marker::PhantomData }
    }

    /// Forward in `T`: (out, lse).
    pub fn forward_t(
        &self,
        cfg: &DilatedConfig,
        shape: AttnShape,
        q: &[T],
        k: &[T],
        v: &[T],
    ) -> Result<(Vec<T>, Vec<f32>)> {
        forward_vec(&self.dev, cfg, shape, q, k, v)
    }
}

impl<T: CudaElement> DilatedBackend for Gpu<T> {
    fn name(&self) -> String {
        format!("cuda-{}", T::DTYPE.as_str())
    }
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn forward(&self, cfg: &DilatedConfig, shape: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Forward32> {
        let (out, lse) = self.forward_t(cfg, shape, &conv::<T>(q), &conv::<T>(k), &conv::<T>(v))?;
        Ok(Forward32 { out: back(&out), lse })
    }
    fn backward(
        &self,
        cfg: &DilatedConfig,
        shape: AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        grad_out: &[f32],
    ) -> Result<Gradients32> {
        let (q, k, v, go) = (conv::<T>(q), conv::<T>(k), conv::<T>(v), conv::<T>(grad_out));
        let [dq, dk, dv] = backward_vec(&self.dev, cfg, shape, [&q, &k, &v], &go)?;
        Ok(Gradients32 { dq: back(&dq), dk: back(&dk), dv: back(&dv) })
    }
}
