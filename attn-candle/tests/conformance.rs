//! The golden files of `conformance/dilated` and `conformance/features` through the
//! candle op, forward and candle-autograd gradients, in f32, bf16 and f16 and in both
//! layouts (BSHD, and BHSD handed over transposed).

mod common;

use attn_testkit::golden::{check_case, golden_dir, load_dir};
use candle_core::DType;
use common::{CandleOp, Layout};

fn run_dir(dir: &str) {
    let cases = load_dir(&golden_dir().join(dir)).expect("golden directory");
    assert!(!cases.is_empty(), "{dir} holds no cases");
    let mut failures = Vec::new();
    for (path, case) in &cases {
        let case = case.as_ref().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for layout in [Layout::Bshd, Layout::Bhsd] {
                let report = check_case(case, Some(&CandleOp { dtype, layout }), None);
                if !report.passed() {
                    failures.push(report.to_string());
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn dilated_golden_files_pass_through_the_candle_op() {
    run_dir("dilated");
}

#[test]
fn feature_golden_files_pass_through_the_candle_op() {
    run_dir("features");
}
