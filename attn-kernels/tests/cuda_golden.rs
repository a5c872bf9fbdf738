//! Golden conformance on the GPU: every file in `conformance/dilated` through the
//! CUDA backend in f32, bf16 and f16 (forward, lse, dq/dk/dv). Skips, printing the reason,
//! when no driver, NVRTC or GPU is present.
#![cfg(feature = "cuda")]

mod cuda_support;

use attn_kernels::cuda::CudaElement;
use attn_testkit::golden::{check_case, golden_dir, load_dir};
use cuda_support::{device_or_skip, gpu};
use half::{bf16, f16};

fn run_all<T: CudaElement>(test: &str) {
    let Some(dev) = device_or_skip(test) else { return };
    let dir = golden_dir().join("dilated");
    let cases = load_dir(&dir).unwrap();
    assert_eq!(cases.len(), 9, "the 9 golden files in {}", dir.display());
    let backend = gpu::<T>(&dev);
    let mut failed = Vec::new();
    for (path, case) in cases {
        let case = case.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let report = check_case(&case, Some(&backend), None);
        println!("{report}");
        if !report.passed() {
            failed.push(report.to_string());
        }
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

#[test]
fn golden_cuda_f32() {
    run_all::<f32>("golden_cuda_f32");
}

#[test]
fn golden_cuda_bf16() {
    run_all::<bf16>("golden_cuda_bf16");
}

#[test]
fn golden_cuda_f16() {
    run_all::<f16>("golden_cuda_f16");
}
