//! The one place kernels are launched: every launch of the crate goes through [`launch`],
//! whose callers build argument lists that match the kernel signatures in `kernels/*.cu`.
#![allow(unsafe_code)]

use attn_core::Result;
use cudarc::driver::{LaunchArgs, LaunchConfig};

use super::device::cuda_err;

/// Launch a prepared kernel call.
///
/// Callers must push exactly the arguments of the kernel's `extern "C"` signature, in
/// order and with the same types, and size buffers for the indices the kernel derives
/// from its parameters (the block functions check shapes before calling).
pub(crate) fn launch(mut args: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<()> {
    // SAFETY: the argument list matches the kernel signature (see the callers in
    // `tensor.rs`, `block.rs` and `epilogue.rs`, each next to the kernel they call), and
    // the buffers were checked against the shapes the kernels index with.
    unsafe { args.launch(cfg) }.map(|_| ()).map_err(cuda_err)
}
