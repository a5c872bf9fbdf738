//! The CUDA backend (feature `cuda`) behind the f32 golden interface, in f32, bf16 or f16.

use std::marker::PhantomData;

use attn_core::{AttnShape, DType, DilatedConfig, Element, Result};
use attn_kernels::cuda::{CudaDevice, CudaElement, backward_vec, forward_vec};
use attn_testkit::{DilatedBackend, Forward32, Gradients32};

pub struct Gpu<T> {
    dev: CudaDevice,
    _t: PhantomData<T>,
}

/// Open device 0 for dtype `dtype`; a typed error (no driver, no GPU) otherwise.
pub fn open(dtype: DType) -> Result<Box<dyn DilatedBackend>> {
    let dev = CudaDevice::new(0)?;
    Ok(match dtype {
        DType::BF16 => Box::new(Gpu::<half::bf16> { dev, _t: PhantomData }),
        DType::F16 => Box::new(Gpu::<half::f16> { dev, _t: PhantomData }),
        _ => Box::new(Gpu::<f32> { dev, _t: PhantomData }),
    })
}

fn conv<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&a| T::from_f32(a)).collect()
}

fn back<T: Element>(x: &[T]) -> Vec<f32> {
    x.iter().map(|a| a.to_f32()).collect()
}

impl<T: CudaElement> DilatedBackend for Gpu<T> {
    fn name(&self) -> String {
        format!("cuda {}", T::DTYPE.as_str())
    }
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn forward(&self, cfg: &DilatedConfig, s: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Forward32> {
        let (out, lse) = forward_vec(&self.dev, cfg, s, &conv::<T>(q), &conv::<T>(k), &conv::<T>(v))?;
        Ok(Forward32 { out: back(&out), lse })
    }
    fn backward(
        &self,
        cfg: &DilatedConfig,
        s: AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        go: &[f32],
    ) -> Result<Gradients32> {
        let [q, k, v, go] = [q, k, v, go].map(conv::<T>);
        let [dq, dk, dv] = backward_vec(&self.dev, cfg, s, [&q, &k, &v], &go)?;
        Ok(Gradients32 { dq: back(&dq), dk: back(&dk), dv: back(&dv) })
    }
}
