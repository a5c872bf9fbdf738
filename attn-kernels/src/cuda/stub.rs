//! Stand-in for the CUDA backend when the `cuda` feature is off: the same entry point,
//! returning `AttnError::NotCompiled` so callers get a typed error, not a link failure.

use attn_core::{AttnError, Result};

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

/// Always `AttnError::NotCompiled`.
pub fn check_available(_ordinal: usize) -> Result<()> {
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
    }
}
