//! `cargo xtask ptx`: compile every CUDA kernel with NVRTC for sm_80, sm_90 and sm_90a and check
//! the PTX with `ptxas -v` (registers, shared memory, spills), with no GPU needed.
//!
//! NVRTC and ptxas come from PyPI wheels cached outside the repository:
//! `pip install --target ~/.cache/attn-cuda nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12
//! nvidia-cuda-runtime-cu12` (override the directory with `ATTN_CUDA_HOME`). This module
//! finds them, puts libnvrtc on `LD_LIBRARY_PATH` and runs the `attn-ptx` binary of
//! `attn-kernels` (feature `cuda`), which does the work and fails on any error or spill.
//! Extra arguments (`--arch 80,90`, `--out DIR`) are passed through. [`run_emulation`]
//! runs the same kernels on the CPU (a fiber per CUDA thread) against a float64 reference.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where the NVRTC / ptxas wheels are installed.
pub fn cuda_home() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("ATTN_CUDA_HOME") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").ok_or("HOME is not set and ATTN_CUDA_HOME is not given")?;
    Ok(PathBuf::from(home).join(".cache/attn-cuda"))
}

/// The NVRTC library folder and the `ptxas` binary under `home`.
fn nvrtc_paths(home: &Path) -> (PathBuf, PathBuf) {
    (home.join("nvidia/cuda_nvrtc/lib"), home.join("nvidia/cuda_nvcc/bin/ptxas"))
}

/// The cargo target folder: `CARGO_TARGET_DIR` where set, else the workspace's `target`.
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| crate::workspace::repo_root().join("target"), PathBuf::from)
}

/// The C++ compiler of the emulation: `CXX`, default `g++`.
fn cxx() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "g++".into())
}

/// Why `ptx --emulate` cannot run here (no C++ compiler, or no NVRTC / ptxas under
/// `home`), or `None` when it can.
pub fn missing_tools(home: &Path, cxx: &str) -> Option<String> {
    let on_path =
        |t: &str| std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(t).is_file()));
    let (nvrtc_lib, ptxas) = nvrtc_paths(home);
    if !(Path::new(cxx).is_file() || on_path(cxx)) {
        Some(format!("no C++ compiler `{cxx}` (set CXX or install g++)"))
    } else if !nvrtc_lib.is_dir() || !ptxas.is_file() {
        Some(format!(
            "NVRTC / ptxas not under {} (pip install --target DIR nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12)",
            home.display()
        ))
    } else {
        None
    }
}

/// [`missing_tools`] for the default locations (`ATTN_CUDA_HOME`, `CXX`).
pub fn missing_default_tools() -> Option<String> {
    match cuda_home() {
        Ok(home) => missing_tools(&home, &cxx()),
        Err(e) => Some(e),
    }
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
    let (nvrtc_lib, ptxas) = nvrtc_paths(&home);
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
    // PTX goes under the target folder wherever the command runs, unless `--out` says.
    let out = (!args.iter().any(|a| a == "--out")).then(|| target_dir().join("ptx"));
    // The test profile: `cargo test -p attn-kernels --features cuda` built this binary
    // already (a package's binaries are built for its integration tests).
    let status = Command::new(crate::workspace::cargo())
        .args([
            "run",
            "--quiet",
            "--profile",
            "test",
            "-p",
            "attn-kernels",
            "--features",
            "cuda",
            "--bin",
            "attn-ptx",
            "--",
        ])
        .arg("--ptxas")
        .arg(&ptxas)
        .args(out.iter().flat_map(|o| [std::ffi::OsStr::new("--out"), o.as_os_str()]))
        .args(&args)
        .env("LD_LIBRARY_PATH", ld)
        .status()
        .map_err(|e| format!("running cargo: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("attn-ptx failed ({status})")) }
}

/// `cargo xtask ptx --emulate`: build `attn-kernels/kernels/emulation/harness.cpp` with
/// the host C++ compiler (`CXX`, default `g++`, C++20) and run it: the CUDA kernels run
/// as fibers on the CPU (mma.sync, wgmma, TMA, mbarriers, shuffles and barriers emulated)
/// against a float64 reference, with the two- and the three-stage forward, the sm_90a
/// forward and backward and the backward with 64-row query tiles, each then again with
/// `--plant`, where the harness passes only if its judge rejects the errors it plants in
/// every case.
fn run_emulation() -> Result<(), String> {
    let harness = crate::workspace::repo_root().join("attn-kernels/kernels/emulation/harness.cpp");
    // Created if no build made it yet.
    let dir = target_dir();
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let exe = dir.join("attn-cuda-emulation");
    let cxx = cxx();
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
    // Every case with the two-stage forward, the three-stage one, the sm_90a forward and
    // backward (`--hopper`, where a launch can take them) and the backward's 64-row query
    // tiles; then the judge bites: errors planted in every case's results (two rows of out
    // swapped, one LSE off by 0.01; under `--hopper` also two rows of each gradient) and in
    // the Hopper micro-kernels (a descriptor field, a swizzle, an mbarrier parity) must each
    // be rejected, or this run fails.
    let variants: [(&str, &[&str]); 4] =
        [("2", &[]), ("3", &[]), ("2", &["--hopper"]), ("2", &["--bwd-queries", "64"])];
    for (stages, variant) in variants {
        let run = |plant: &[&str]| {
            Command::new(&exe)
                .args(plant)
                .args(["--stages", stages])
                .args(variant)
                .status()
                .map_err(|e| format!("running {}: {e}", exe.display()))
        };
        let what = match variant {
            [] => format!("{stages} forward stages"),
            v => format!("{stages} stages, {}", v.join(" ")),
        };
        let ran = run(&[])?;
        if !ran.success() {
            return Err(format!("CUDA kernel emulation with {what} failed ({ran})"));
        }
        let planted = run(&["--plant"])?;
        if !planted.success() {
            return Err(format!("the emulation's judge let a planted error pass ({what}, {planted})"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_tools_say_which() {
        let nowhere = Path::new("/nonexistent/attn-cuda");
        assert!(missing_tools(nowhere, "no-such-compiler-xyz").unwrap().contains("no C++ compiler"));
        assert!(missing_tools(nowhere, "sh").unwrap().contains("NVRTC / ptxas not under /nonexistent/attn-cuda"));
    }
}
