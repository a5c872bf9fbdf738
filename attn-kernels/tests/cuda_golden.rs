//! Golden conformance on the GPU: every file in `conformance/dilated` and
//! `conformance/features` (grouped key/value heads, key padding, packed sequences,
//! sliding windows) through the CUDA backend in f32, bf16 and f16 (forward, lse where
//! present, dq/dk/dv), judged like the CPU golden tests. Skips, printing the reason, when
//! no driver, NVRTC or GPU is present (fails instead with `ATTN_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod cuda_support;

use attn_kernels::cuda::CudaElement;
use attn_testkit::golden::{check_case, golden_dir, load_dir};
use cuda_support::{device_or_skip, gpu};
use half::{bf16, f16};

/// The directories and their file counts.
const DIRS: [(&str, usize); 2] = [("dilated", 9), ("features", 9)];

fn run_all<T: CudaElement>(test: &str) {
    let Some(dev) = device_or_skip(test) else { return };
    let backend = gpu::<T>(&dev);
    let mut failed = Vec::new();
    for (dir, count) in DIRS {
        let dir = golden_dir().join(dir);
        let cases = load_dir(&dir).unwrap();
        assert_eq!(cases.len(), count, "the {count} golden files in {}", dir.display());
        for (path, case) in cases {
            let case = case.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let report = check_case(&case, Some(&backend), None);
            println!("{report}");
            if !report.passed() {
                failed.push(report.to_string());
            }
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
