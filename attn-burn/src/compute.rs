//! [`Compute`]: where a call on host tensors computes: the process-wide CPU kernels, or
//! a backend the caller hands over ([`HostAttention`]: any `attn_core::Attention` in
//! every dtype flex stores, such as an `attn_ring::RingBackend` rank).

use std::sync::{Arc, OnceLock};

use attn_core::{Attention, Result};
use half::{bf16, f16};

/// A backend computing every dtype the op accepts on flex (f32, f64, bf16, f16): the CPU
/// kernels, a ring rank, the float64 reference.
pub trait HostAttention: Attention<f32> + Attention<f64> + Attention<bf16> + Attention<f16> {}

impl<B: Attention<f32> + Attention<f64> + Attention<bf16> + Attention<f16>> HostAttention for B {}

/// Where one call (and its backward) computes.
#[derive(Debug, Clone, Default)]
pub enum Compute {
    /// The workspace's CPU kernels, one thread per core, shared by the process.
    #[default]
    Kernels,
    /// The given backend; a ring rank's backward is collective, so every rank's loss
    /// must reach the same results of its calls.
    On(Arc<dyn HostAttention>),
}

impl Compute {
    /// The backend the call runs on (the kernels are built on first use).
    pub(crate) fn host(&self) -> Result<&dyn HostAttention> {
        match self {
            Compute::Kernels => Ok(kernels()?),
            Compute::On(backend) => Ok(backend.as_ref()),
        }
    }

    /// The global positions of `seq` query rows a caller passes: `0..seq` on the kernels,
    /// the rank's rows on a ring rank (an error when `seq` is not its row count). Dropout
    /// masks are drawn at these positions, so ranks drop what one device drops.
    pub fn query_positions(&self, seq: usize) -> Result<Vec<usize>> {
        match self {
            Compute::Kernels => Ok((0..seq).collect()),
            Compute::On(backend) => Attention::<f32>::query_positions(backend.as_ref(), seq),
        }
    }
}

/// The process-wide CPU kernels (one thread per core), built on first use.
fn kernels() -> Result<&'static attn_kernels::CpuBackend> {
    static CPU: OnceLock<attn_kernels::CpuBackend> = OnceLock::new();
    if let Some(b) = CPU.get() {
        return Ok(b);
    }
    let backend = attn_kernels::CpuBackend::new(0)?;
    Ok(CPU.get_or_init(|| backend))
}
