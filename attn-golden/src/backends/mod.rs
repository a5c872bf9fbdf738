//! Backend selection: maps `--backend`, `--dtype` and the ring options to implementations.

#[cfg(feature = "burn")]
mod burn;
#[cfg(feature = "burn")]
mod burn_layer;
#[cfg(feature = "candle")]
mod candle;
mod multihead;
mod ring;

use attn_core::{Attention, AttnError, DType};
use attn_kernels::CpuBackend;
use attn_kernels::cuda::CudaBackend;
use attn_testkit::{DilatedBackend, MultiheadBackend, Typed, reference};
use half::{bf16, f16};

use crate::options::Options;

/// The backends for one run: one per case kind.
pub struct Selected {
    pub label: String,
    pub dilated: Option<Box<dyn DilatedBackend>>,
    pub multihead: Option<Box<dyn MultiheadBackend>>,
}

/// Why no backend was selected: a usage mistake, or a typed error from opening it
/// (`NotCompiled`, `BackendUnavailable`), which the runner reports by its own exit code.
#[derive(Debug)]
pub enum Refusal {
    Usage(String),
    Backend(AttnError),
}

impl From<String> for Refusal {
    fn from(s: String) -> Self {
        Refusal::Usage(s)
    }
}

impl From<&str> for Refusal {
    fn from(s: &str) -> Self {
        Refusal::Usage(s.to_string())
    }
}

pub fn select(o: &Options) -> Result<Selected, Refusal> {
    let dtype = DType::parse(&o.dtype).ok_or_else(|| format!("unknown dtype `{}`", o.dtype))?;
    if o.world_size.is_some() && o.backend != "ring" {
        return Err("--world-size needs --backend ring".into());
    }
    if !["cpu", "cuda", "candle", "burn"].contains(&o.backend.as_str()) && dtype != DType::F32 {
        return Err(format!("--dtype {} is only for --backend cpu|cuda|candle|burn", o.dtype).into());
    }
    let err = |e: AttnError| e.to_string();
    let sel = match o.backend.as_str() {
        "reference" => Selected {
            label: "reference".into(),
            dilated: Some(Box::new(reference())),
            multihead: Some(Box::new(multihead::MultiheadRunner::reference())),
        },
        "cpu" => {
            let cpu = CpuBackend::new(o.threads).map_err(err)?;
            let label = format!("cpu {} {}t {:?}", dtype.as_str(), cpu.threads(), cpu.isa());
            let cpu = typed(cpu, dtype, label.clone()).map_err(err)?;
            Selected {
                label,
                dilated: Some(cpu),
                multihead: Some(Box::new(
                    match dtype {
                        DType::F32 => multihead::MultiheadRunner::cpu(o.threads),
                        _ => multihead::MultiheadRunner::cpu_half(o.threads, dtype),
                    }
                    .map_err(err)?,
                )),
            }
        }
        "ring" => {
            let r = ring::RingDilated::new(o.world_size.unwrap_or(2), &o.strategy, &o.layout).map_err(err)?;
            let m = multihead::MultiheadRunner::ring(r.world, r.layout, r.strategy);
            Selected { label: r.name(), dilated: Some(Box::new(r)), multihead: Some(Box::new(m)) }
        }
        "cuda" => cuda_backend(dtype).map_err(Refusal::Backend)?,
        "candle" => candle_backend(dtype).map_err(Refusal::Backend)?,
        "burn" => burn_backend(dtype).map_err(Refusal::Backend)?,
        other => return Err(format!("unknown backend `{other}` (reference|cpu|ring|cuda|candle|burn)").into()),
    };
    Ok(sel)
}

/// The CUDA backend on device 0 (without the `cuda` feature: `NotCompiled`); in f32 the
/// multihead files run their layer on it too.
fn cuda_backend(dtype: DType) -> Result<Selected, AttnError> {
    let gpu = CudaBackend::new(0)?;
    let label = format!("cuda {}", dtype.as_str());
    let multihead = (dtype == DType::F32).then(|| {
        Box::new(multihead::MultiheadRunner::cuda(std::sync::Arc::new(gpu.clone()))) as Box<dyn MultiheadBackend>
    });
    Ok(Selected { label: label.clone(), dilated: Some(typed(gpu, dtype, label)?), multihead })
}

/// The candle op (feature `candle`; without it, `NotCompiled`), and in f32 its candle-nn
/// layer for the multihead files.
fn candle_backend(dtype: DType) -> Result<Selected, AttnError> {
    #[cfg(feature = "candle")]
    {
        let label = format!("candle {}", dtype.as_str());
        let multihead: Option<Box<dyn MultiheadBackend>> =
            (dtype == DType::F32).then(|| Box::new(candle::CandleMultihead) as Box<dyn MultiheadBackend>);
        Ok(Selected { label, dilated: Some(Box::new(candle::CandleDilated { dtype })), multihead })
    }
    #[cfg(not(feature = "candle"))]
    {
        let _ = dtype;
        Err(AttnError::NotCompiled { backend: "candle", feature: "candle" })
    }
}

/// The burn op on burn-flex in any dtype it stores (feature `burn`; without it,
/// `NotCompiled`), and attn-burn's layer for the multihead files in the same dtype.
fn burn_backend(dtype: DType) -> Result<Selected, AttnError> {
    #[cfg(feature = "burn")]
    {
        Ok(Selected {
            label: format!("burn {}", dtype.as_str()),
            dilated: Some(Box::new(burn::BurnDilated { dtype })),
            multihead: Some(Box::new(burn_layer::BurnMultihead { dtype })),
        })
    }
    #[cfg(not(feature = "burn"))]
    {
        let _ = dtype;
        Err(AttnError::NotCompiled { backend: "burn", feature: "burn" })
    }
}

/// `backend` computing in `dtype` behind the golden interface.
fn typed<A>(backend: A, dtype: DType, label: String) -> Result<Box<dyn DilatedBackend>, AttnError>
where
    A: Attention<f32> + Attention<bf16> + Attention<f16> + 'static,
{
    Ok(match dtype {
        DType::F32 => Box::new(Typed::<A, f32>::new(backend).labeled(label)),
        DType::BF16 => Box::new(Typed::<A, bf16>::new(backend).labeled(label)),
        DType::F16 => Box::new(Typed::<A, f16>::new(backend).labeled(label)),
        DType::F64 => return Err(AttnError::InvalidArgument(format!("{label}: runs f32, bf16 or f16"))),
    })
}
