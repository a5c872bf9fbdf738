//! `cargo xtask ptx`: compile every CUDA kernel with NVRTC for sm_80 and sm_90 and check
//! the PTX with `ptxas -v` (registers, shared memory, spills), with no GPU needed.
//!
//! NVRTC and ptxas come from PyPI wheels cached outside the repository:
//! `pip install --target ~/.cache/attn-cuda nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12
//! nvidia-cuda-runtime-cu12` (override the directory with `ATTN_CUDA_HOME`). This module
//! finds them, puts libnvrtc on `LD_LIBRARY_PATH` and runs the `attn-ptx` binary of
//! `attn-kernels` (feature `cuda`), which does the work and fails on any error or spill.
//! Extra arguments (`--arch 80,90`, `--out DIR`) are passed through.

use std::path::PathBuf;
use std::process::Command;

/// Where the NVRTC / ptxas wheels are installed.
pub fn cuda_home() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("ATTN_CUDA_HOME") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").ok_or("HOME is not set and ATTN_CUDA_HOME is not given")?;
    Ok(PathBuf::from(home).join(".cache/attn-cuda"))
}

/// Run the PTX check; `args` are passed to `attn-ptx`.
pub fn run(args: &[String]) -> Result<(), String> {
    let home = cuda_home()?;
    let nvrtc_lib = home.join("nvidia/cuda_nvrtc/lib");
    let ptxas = home.join("nvidia/cuda_nvcc/bin/ptxas");
    if !nvrtc_lib.is_dir() || !ptxas.is_file() {
        return Err(format!(
            "NVRTC / ptxas not found under {}; install them with\n  pip install --target {} \
             nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12 nvidia-cuda-runtime-cu12",
            home.display(),
            home.display()
        ));
    }
    let mut ld = nvrtc_lib.into_os_string();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        ld.push(":");
        ld.push(old);
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(["run", "--quiet", "-p", "attn-kernels", "--features", "cuda", "--bin", "attn-ptx", "--"])
        .arg("--ptxas")
        .arg(&ptxas)
        .args(args)
        .env("LD_LIBRARY_PATH", ld)
        .status()
        .map_err(|e| format!("running cargo: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("attn-ptx failed ({status})")) }
}
