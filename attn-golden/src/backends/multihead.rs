//! `kind=multihead` cases through `attn-multihead` on the reference, CPU (f32, bf16,
//! f16), CUDA or ring backend.

use std::collections::BTreeMap;
use std::sync::Arc;

use attn_core::{Attention, AttnError, DType, ReferenceBackend, Result};
use attn_golden::{CaseGrads, RingSplit, backward_case, backward_case_ring, forward_case, forward_case_ring};
use attn_kernels::CpuBackend;
use attn_multihead::{F32Tensors, LayerFloat};
use attn_ring::{Layout, Strategy};
use attn_testkit::{GoldenCase, MultiheadBackend, MultiheadGrads32};

enum Engine {
    Reference,
    /// A single-device f32 backend (CPU or CUDA) and its name.
    Device(Arc<dyn Attention<f32>>, &'static str),
    /// The layer in bf16 or f16 on the CPU kernels.
    CpuHalf(Arc<CpuBackend>, DType),
    Ring {
        world: usize,
        layout: Layout,
        strategy: Strategy,
    },
}

pub struct MultiheadRunner {
    engine: Engine,
}

impl MultiheadRunner {
    pub fn reference() -> Self {
        MultiheadRunner { engine: Engine::Reference }
    }
    pub fn cpu(threads: usize) -> Result<Self> {
        Ok(MultiheadRunner { engine: Engine::Device(Arc::new(attn_kernels::CpuBackend::new(threads)?), "cpu") })
    }
    /// The layer stored and run in `dtype` (bf16 or f16) on the CPU kernels.
    pub fn cpu_half(threads: usize, dtype: DType) -> Result<Self> {
        if !matches!(dtype, DType::BF16 | DType::F16) {
            return Err(AttnError::InvalidArgument(format!("{dtype:?} is not a 2-byte layer dtype")));
        }
        Ok(MultiheadRunner { engine: Engine::CpuHalf(Arc::new(CpuBackend::new(threads)?), dtype) })
    }
    pub fn cuda(gpu: Arc<attn_kernels::cuda::CudaBackend>) -> Self {
        MultiheadRunner { engine: Engine::Device(gpu, "cuda") }
    }
    pub fn ring(world: usize, layout: Layout, strategy: Strategy) -> Self {
        MultiheadRunner { engine: Engine::Ring { world, layout, strategy } }
    }
}

impl MultiheadBackend for MultiheadRunner {
    fn name(&self) -> String {
        match &self.engine {
            Engine::Reference => "multihead reference f64".into(),
            Engine::Device(_, name) => format!("multihead {name} f32"),
            Engine::CpuHalf(_, dtype) => format!("multihead cpu {}", dtype.as_str()),
            Engine::Ring { world, layout, strategy } => {
                format!("multihead ring p={world} {strategy:?} {layout:?}").to_lowercase()
            }
        }
    }
    fn dtype(&self) -> DType {
        match &self.engine {
            Engine::CpuHalf(_, dtype) => *dtype,
            _ => DType::F32,
        }
    }
    fn forward(&self, case: &GoldenCase) -> Result<Vec<f32>> {
        let (meta, tensors, pad) = case_parts(case);
        let tensors = &tensors;
        match &self.engine {
            Engine::Reference => {
                let backend: Arc<dyn Attention<f64>> = Arc::new(ReferenceBackend);
                Ok(forward_case::<f64>(meta, tensors, pad, backend)?.into_iter().map(|x| x as f32).collect())
            }
            Engine::Device(backend, _) => forward_case::<f32>(meta, tensors, pad, backend.clone()),
            Engine::CpuHalf(cpu, DType::BF16) => Ok(f32s(forward_case::<half::bf16>(meta, tensors, pad, cpu.clone())?)),
            Engine::CpuHalf(cpu, _) => Ok(f32s(forward_case::<half::f16>(meta, tensors, pad, cpu.clone())?)),
            Engine::Ring { world, layout, strategy } => {
                let split = RingSplit { world: *world, layout: *layout, strategy: *strategy };
                forward_case_ring(meta, tensors, pad, split)
            }
        }
    }

    fn backward(&self, case: &GoldenCase) -> Result<MultiheadGrads32> {
        let (meta, tensors, pad) = case_parts(case);
        let tensors = &tensors;
        let CaseGrads { out, grads } = match &self.engine {
            Engine::Reference => {
                let backend: Arc<dyn Attention<f64>> = Arc::new(ReferenceBackend);
                grads_f32(backward_case::<f64>(meta, tensors, pad, backend)?)
            }
            Engine::Device(backend, _) => backward_case::<f32>(meta, tensors, pad, backend.clone())?,
            Engine::CpuHalf(cpu, DType::BF16) => {
                grads_f32(backward_case::<half::bf16>(meta, tensors, pad, cpu.clone())?)
            }
            Engine::CpuHalf(cpu, _) => grads_f32(backward_case::<half::f16>(meta, tensors, pad, cpu.clone())?),
            Engine::Ring { world, layout, strategy } => {
                let split = RingSplit { world: *world, layout: *layout, strategy: *strategy };
                backward_case_ring(meta, tensors, pad, split)?
            }
        };
        Ok(MultiheadGrads32 { out, grads })
    }
}

/// Values as f32 (exact from bf16 and f16).
fn f32s<F: LayerFloat>(v: Vec<F>) -> Vec<f32> {
    v.into_iter().map(|x| x.to_f32()).collect()
}

/// A run's output and gradients as f32.
fn grads_f32<F: LayerFloat>(r: CaseGrads<F>) -> CaseGrads<f32> {
    CaseGrads { out: f32s(r.out), grads: r.grads.into_iter().map(|(n, g)| (n, f32s(g))).collect() }
}

/// A case's metadata, its f32 tensors by name and its key padding flags.
fn case_parts(case: &GoldenCase) -> (&BTreeMap<String, String>, F32Tensors<'_>, Option<&[bool]>) {
    let tensors = F32Tensors {
        tensors: case.tensors.iter().map(|(k, t)| (k.clone(), (t.shape.as_slice(), t.data.as_slice()))).collect(),
    };
    (&case.meta, tensors, case.masks.key_padding().map(|k| k.view().flags()))
}
