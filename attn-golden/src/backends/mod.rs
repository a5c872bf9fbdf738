//! Backend selection: maps `--backend`, `--dtype` and the ring options to implementations.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod multihead;
mod ring;

use attn_core::{AttnError, DType};
use attn_testkit::{DilatedBackend, MultiheadBackend, ReferenceBackend};

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
    if o.backend != "cpu" && o.backend != "cuda" && dtype != DType::F32 {
        return Err(format!("--dtype {} is only for --backend cpu|cuda", o.dtype).into());
    }
    let err = |e: AttnError| e.to_string();
    let sel = match o.backend.as_str() {
        "reference" => Selected {
            label: "reference".into(),
            dilated: Some(Box::new(ReferenceBackend)),
            multihead: Some(Box::new(multihead::MultiheadRunner::reference())),
        },
        "cpu" => {
            let cpu = cpu::CpuDilated::new(o.threads, dtype).map_err(err)?;
            Selected {
                label: cpu.name(),
                dilated: Some(Box::new(cpu)),
                multihead: (dtype == DType::F32)
                    .then(|| multihead::MultiheadRunner::cpu(o.threads).map_err(err))
                    .transpose()?
                    .map(|m| Box::new(m) as Box<dyn MultiheadBackend>),
            }
        }
        "ring" => {
            let r = ring::RingDilated::new(o.world_size.unwrap_or(2), &o.strategy, &o.layout).map_err(err)?;
            let m = multihead::MultiheadRunner::ring(r.world, r.layout, r.strategy);
            Selected { label: r.name(), dilated: Some(Box::new(r)), multihead: Some(Box::new(m)) }
        }
        "cuda" => cuda_backend(dtype).map_err(Refusal::Backend)?,
        other => return Err(format!("unknown backend `{other}` (reference|cpu|ring|cuda)").into()),
    };
    Ok(sel)
}

#[cfg(feature = "cuda")]
fn cuda_backend(dtype: DType) -> Result<Selected, AttnError> {
    let b = cuda::open(dtype)?;
    Ok(Selected { label: b.name(), dilated: Some(b), multihead: None })
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(_dtype: DType) -> Result<Selected, AttnError> {
    Err(AttnError::NotCompiled { backend: "cuda", feature: "cuda" })
}
