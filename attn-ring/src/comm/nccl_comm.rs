//! `NcclComm`: placeholder until the NCCL transport is wired (feature `nccl`).

use attn_core::{AttnError, Result};

/// NCCL communicator (only constructible where NCCL and a GPU are present).
#[derive(Debug)]
pub struct NcclComm {
    _private: (),
}

impl NcclComm {
    /// Always an error in this build.
    pub fn new(_rank: usize, _world: usize) -> Result<Self> {
        Err(AttnError::NotCompiled { backend: "NCCL", feature: "nccl" })
    }
}
