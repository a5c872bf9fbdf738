//! Every golden file in `conformance/dilated` and `conformance/features` (forward, lse
//! where present, dq/dk/dv) through the CPU backend: f32 on the detected and the
//! portable kernels, bf16 and f16 judged row by row against the reference on the rounded
//! inputs. The feature files cover grouped key/value heads, key padding, packed
//! sequences and sliding windows.

use attn_core::Element;
use attn_kernels::{CpuBackend, Isa};
use attn_testkit::Typed;
use attn_testkit::golden::{check_case, golden_dir, load_dir};
use half::{bf16, f16};

/// The directories and their file counts.
const DIRS: [(&str, usize); 2] = [("dilated", 9), ("features", 9)];

fn run_all<T: Element>(isa: Isa) {
    let backend = Typed::<_, T>::new(CpuBackend::new(2).unwrap().with_isa(isa).unwrap());
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
fn golden_f32_detected_isa() {
    run_all::<f32>(Isa::detect());
}

#[test]
fn golden_f32_portable() {
    run_all::<f32>(Isa::Portable);
}

#[test]
fn golden_bf16() {
    run_all::<bf16>(Isa::detect());
}

#[test]
fn golden_f16() {
    run_all::<f16>(Isa::detect());
}
