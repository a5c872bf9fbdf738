//! The kernel source compiles with NVRTC for sm_80 and sm_90 when libnvrtc is loadable
//! (e.g. `LD_LIBRARY_PATH=~/.cache/attn-cuda/nvidia/cuda_nvrtc/lib`). It skips without
//! NVRTC only where nothing promises it: with `ATTN_CUDA_HOME` set (CI installs NVRTC
//! there) or `ATTN_REQUIRE_GPU=1`, an NVRTC that does not load is a failure.
//! `cargo xtask ptx` goes further (ptxas registers and spills).
#![cfg(feature = "cuda")]

use attn_kernels::cuda::nvrtc_present;
use attn_kernels::cuda::source::{full_source, kernel_names, nvrtc_options};
use attn_testkit::skip_gpu_test;
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

#[test]
fn kernels_compile_for_sm80_and_sm90() {
    if !nvrtc_present() {
        let reason = "libnvrtc did not load (not on LD_LIBRARY_PATH)";
        if let Some(home) = std::env::var_os("ATTN_CUDA_HOME") {
            panic!("ATTN_CUDA_HOME={} is set but {reason}", home.to_string_lossy());
        }
        return skip_gpu_test("kernels_compile_for_sm80_and_sm90", reason);
    }
    for arch in ["compute_80", "compute_90"] {
        let opts = CompileOptions { options: nvrtc_options(arch), ..Default::default() };
        let ptx = compile_ptx_with_opts(full_source(), opts).unwrap_or_else(|e| panic!("{arch}: {e}")).to_src();
        for name in kernel_names() {
            assert!(ptx.contains(&format!(".entry {name}(")), "{arch}: {name} missing from the PTX");
        }
    }
}
