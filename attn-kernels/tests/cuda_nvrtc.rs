//! The kernel source compiles with NVRTC for sm_80 and sm_90 when libnvrtc is loadable
//! (e.g. `LD_LIBRARY_PATH=~/.cache/attn-cuda/nvidia/cuda_nvrtc/lib`). It skips without
//! NVRTC only where nothing promises it: with `ATTN_CUDA_HOME` set (CI installs NVRTC
//! there) or `ATTN_REQUIRE_GPU=1`, an NVRTC that does not load is a failure.
//! `cargo xtask ptx` goes further (ptxas registers and spills).
#![cfg(feature = "cuda")]

use attn_kernels::cuda::nvrtc::{ImageKind, compile_cubin, compile_for_device};
use attn_kernels::cuda::nvrtc_present;
use attn_kernels::cuda::source::{dtype_define, full_source, kernel_names, nvrtc_options};
use attn_testkit::skip_gpu_test;
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

/// Whether NVRTC loads; its absence is a skip only where nothing promises it.
fn nvrtc_or_skip(test: &str) -> bool {
    if !nvrtc_present() {
        let reason = "libnvrtc did not load (not on LD_LIBRARY_PATH)";
        if let Some(home) = std::env::var_os("ATTN_CUDA_HOME") {
            panic!("ATTN_CUDA_HOME={} is set but {reason}", home.to_string_lossy());
        }
        skip_gpu_test(test, reason);
        return false;
    }
    true
}

#[test]
fn kernels_compile_for_sm80_and_sm90() {
    if !nvrtc_or_skip("kernels_compile_for_sm80_and_sm90") {
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        let opts = CompileOptions { options: nvrtc_options(arch), ..Default::default() };
        let ptx = compile_ptx_with_opts(full_source(), opts).unwrap_or_else(|e| panic!("{arch}: {e}")).to_src();
        for name in kernel_names() {
            assert!(ptx.contains(&format!(".entry {name}(")), "{arch}: {name} missing from the PTX");
        }
    }
}

/// A device's module is a cubin for its own architecture (an ELF image), one dtype per
/// module; an architecture NVRTC does not know is an error naming both attempts.
#[test]
fn device_modules_are_cubins_for_the_device_architecture() {
    if !nvrtc_or_skip("device_modules_are_cubins_for_the_device_architecture") {
        return;
    }
    let (_, kind) = compile_for_device(&full_source(), (9, 0), &[dtype_define("f32").unwrap()]).unwrap();
    assert_eq!(kind, ImageKind::Cubin, "sm_90");
    let options: Vec<String> = nvrtc_options("sm_80").into_iter().chain([dtype_define("bf16").unwrap()]).collect();
    let cubin = compile_cubin(&full_source(), &options).unwrap();
    assert!(cubin.len() > 1024 && cubin.starts_with(b"\x7fELF"), "sm_80: not a cubin");
    let err = compile_for_device(&full_source(), (1, 0), &[]).unwrap_err().to_string();
    assert!(err.contains("cubin") && err.contains("PTX"), "{err}");
}
