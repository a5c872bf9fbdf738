//! Shared test helpers: the CPU backend behind the testkit's `DilatedBackend` trait for
//! any dtype, and f32/f64 conversions.
#![allow(dead_code)]

use attn_core::{AttnShape, DType, DilatedConfig, Element, Result};
use attn_kernels::{CpuBackend, Isa};
use attn_testkit::DilatedBackend;
use attn_testkit::golden::{Forward32, Gradients32};

pub fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

pub fn conv<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

pub fn back<T: Element>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// The CPU backend computing in dtype `T` (inputs rounded to `T`, results back to f32).
pub struct Cpu<T> {
    pub backend: CpuBackend,
    _t: std::marker::PhantomData<T>,
}

impl<T: Element> Cpu<T> {
    pub fn new(threads: usize, isa: Isa) -> Self {
        Cpu { backend: CpuBackend::new(threads).unwrap().with_isa(isa).unwrap(), _t: std::marker::PhantomData }
    }
}

impl<T: Element> DilatedBackend for Cpu<T> {
    fn name(&self) -> String {
        format!("cpu-{}-{}", T::DTYPE.as_str(), self.backend.isa().as_str())
    }
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn forward(&self, cfg: &DilatedConfig, shape: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Forward32> {
        let (out, lse) = self.backend.forward_cross_vec::<T>(cfg, shape, &conv(q), &conv(k), &conv(v))?;
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
        let (out, lse) = self.backend.forward_cross_vec::<T>(cfg, shape, &q, &k, &v)?;
        let (dq, dk, dv) = self.backend.backward_cross_vec::<T>(cfg, shape, &q, &k, &v, &out, &lse, &go)?;
        Ok(Gradients32 { dq: back(&dq), dk: back(&dk), dv: back(&dv) })
    }
}
