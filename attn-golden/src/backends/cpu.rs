//! The CPU backend of `attn-kernels` behind the f32 golden interface, in f32, bf16 or f16.

use attn_core::{AttnShape, DType, DilatedConfig, Element, Result};
use attn_kernels::CpuBackend;
use attn_testkit::{DilatedBackend, Forward32, Gradients32};
use half::{bf16, f16};

pub struct CpuDilated {
    cpu: CpuBackend,
    dtype: DType,
}

impl CpuDilated {
    pub fn new(threads: usize, dtype: DType) -> Result<Self> {
        if dtype == DType::F64 {
            return Err(attn_core::AttnError::InvalidArgument("the cpu backend runs f32, bf16 or f16".into()));
        }
        Ok(CpuDilated { cpu: CpuBackend::new(threads)?, dtype })
    }

    fn fwd<T: Element>(&self, cfg: &DilatedConfig, s: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Forward32> {
        let (q, k, v) = (conv::<T>(q), conv::<T>(k), conv::<T>(v));
        let (out, lse) = self.cpu.forward_cross_vec(cfg, s, &q, &k, &v)?;
        Ok(Forward32 { out: back(&out), lse })
    }

    fn bwd<T: Element>(&self, cfg: &DilatedConfig, s: AttnShape, x: [&[f32]; 4]) -> Result<Gradients32> {
        let [q, k, v, go] = x.map(conv::<T>);
        let (out, lse) = self.cpu.forward_cross_vec(cfg, s, &q, &k, &v)?;
        let (dq, dk, dv) = self.cpu.backward_cross_vec(cfg, s, &q, &k, &v, &out, &lse, &go)?;
        Ok(Gradients32 { dq: back(&dq), dk: back(&dk), dv: back(&dv) })
    }
}

fn conv<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&a| T::from_f32(a)).collect()
}

fn back<T: Element>(x: &[T]) -> Vec<f32> {
    x.iter().map(|a| a.to_f32()).collect()
}

impl DilatedBackend for CpuDilated {
    fn name(&self) -> String {
        format!("cpu {} {}t {:?}", self.dtype.as_str(), self.cpu.threads(), self.cpu.isa())
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn forward(&self, cfg: &DilatedConfig, s: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Forward32> {
        match self.dtype {
            DType::BF16 => self.fwd::<bf16>(cfg, s, q, k, v),
            DType::F16 => self.fwd::<f16>(cfg, s, q, k, v),
            _ => self.fwd::<f32>(cfg, s, q, k, v),
        }
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
        match self.dtype {
            DType::BF16 => self.bwd::<bf16>(cfg, s, [q, k, v, go]),
            DType::F16 => self.bwd::<f16>(cfg, s, [q, k, v, go]),
            _ => self.bwd::<f32>(cfg, s, [q, k, v, go]),
        }
    }
}
