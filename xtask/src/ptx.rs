//! `cargo xtask ptx`: compile every CUDA kernel with NVRTC for sm_80 and sm_90 and check
//! the PTX with `ptxas -v` (registers, shared memory, spills), with no GPU needed.
//!
//! NVRTC and ptxas come from PyPI wheels cached outside the repository:
//! `pip install --target ~/.cache/attn-cuda nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12
//! nvidia-cuda-runtime-cu12` (override the directory with `ATTN_CUDA_HOME`). This module
//! finds them, puts libnvrtc on `LD_LIBRARY_PATH` and runs the `attn-ptx` binary of
//! `attn-kernels` (feature `cuda`), which does the work and fails on any error or spill.
//! Extra arguments (`--arch 80,90`, `--out DIR`) are passed through. [`run_emulation`]
//! runs the same kernels on the CPU (C++ threads) against a float64 reference.

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

/// Run the PTX check; `args` are passed to `attn-ptx`, except `--emulate`, which first
/// runs the kernels on the CPU ([`run_emulation`]).
pub fn run(args: &[String]) -> Result<(), String> {
    let emulate = args.iter().any(|a| a == "--emulate");
    let args: Vec<String> = args.iter().filter(|a| *a != "--emulate").cloned().collect();
    if emulate {
        run_emulation()?;
    }
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
        .args(&args)
        .env("LD_LIBRARY_PATH", ld)
        .status()
        .map_err(|e| format!("running cargo: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("attn-ptx failed ({status})")) }
}

/// `cargo xtask ptx --emulate`: build `attn-kernels/kernels/emulation/harness.cpp` with
/// the host C++ compiler (`CXX`, default `g++`, C++20) and run it: the CUDA kernels run
/// as CPU threads (mma.sync, shuffles and barriers emulated) against a float64 reference.
fn run_emulation() -> Result<(), String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let harness = root.join("attn-kernels/kernels/emulation/harness.cpp");
    let exe = root.join("target/attn-cuda-emulation");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let built = Command::new(&cxx)
        .args(["-std=c++20", "-O2", "-pthread"])
        .arg(&harness)
        .arg("-o")
        .arg(&exe)
        .status()
        .map_err(|e| format!("running {cxx}: {e}"))?;
    if !built.success() {
        return Err(format!("{cxx} failed to build {} ({built})", harness.display()));
    }
    let ran = Command::new(&exe).status().map_err(|e| format!("running {}: {e}", exe.display()))?;
    if ran.success() { Ok(()) } else { Err(format!("CUDA kernel emulation failed ({ran})")) }
}
