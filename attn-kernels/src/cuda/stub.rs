//! Stand-in for the CUDA backend when the `cuda` feature is off: the same entry point,
//! returning `AttnError::NotCompiled` so callers get a typed error, not a link failure.

use attn_core::{Attention, AttnError, AttnInputs, AttnShape, DilatedConfig, Element, Grads, Pass, Result, Saved};
use attn_core::{TensorView, TensorViewMut};

/// The CUDA device handle (not compiled in: enable the `cuda` feature).
#[derive(Debug, Clone)]
pub struct CudaDevice {
    _private: (),
}

impl CudaDevice {
    /// Always `AttnError::NotCompiled { backend: "cuda", feature: "cuda" }`.
    pub fn new(_ordinal: usize) -> Result<Self> {
        Err(not_compiled())
    }
}

/// The GPU backend (not compiled in: every constructor and call is
/// `AttnError::NotCompiled`, so code written against it builds without the feature).
#[derive(Debug, Clone)]
pub struct CudaBackend {
    _private: (),
}

impl CudaBackend {
    /// Always `AttnError::NotCompiled { backend: "cuda", feature: "cuda" }`.
    pub fn new(_ordinal: usize) -> Result<Self> {
        Err(not_compiled())
    }
}

impl<T: Element> Attention<T> for CudaBackend {
    fn name(&self) -> &str {
        "cuda"
    }
    fn forward(&self, _inputs: &AttnInputs<'_, T>, _out: TensorViewMut<'_, T>, _lse: &mut [f32]) -> Result<()> {
        Err(not_compiled())
    }
    fn backward_with_lse_grad(
        &self,
        _inputs: &AttnInputs<'_, T>,
        _saved: Saved<'_, T>,
        _grad_out: TensorView<'_, T>,
        _grad_lse: Option<&[f32]>,
        _grads: Grads<'_, T>,
    ) -> Result<()> {
        Err(not_compiled())
    }
    fn workspace_bytes(&self, _cfg: &DilatedConfig, _shape: AttnShape, _pass: Pass) -> usize {
        0
    }
}

/// Always `AttnError::NotCompiled`.
pub fn check_available(_ordinal: usize) -> Result<()> {
    Err(not_compiled())
}

/// Always `AttnError::NotCompiled`.
pub fn device_count() -> Result<usize> {
    Err(not_compiled())
}

fn not_compiled() -> AttnError {
    AttnError::NotCompiled { backend: "cuda", feature: "cuda" }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reports_not_compiled() {
        assert!(matches!(
            super::CudaDevice::new(0),
            Err(attn_core::AttnError::NotCompiled { backend: "cuda", feature: "cuda" })
        ));
        assert!(matches!(
            super::CudaBackend::new(0),
            Err(attn_core::AttnError::NotCompiled { backend: "cuda", feature: "cuda" })
        ));
    }
}
