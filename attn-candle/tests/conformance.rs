//! The golden files of `conformance/dilated`, `conformance/features`, `conformance/wide`
//! and `conformance/blocks` (block masks, through `AttnOptions`' masks) through the
//! candle op, forward and candle-autograd gradients, in f32, bf16 and f16 and in both
//! layouts (BSHD, and BHSD handed over transposed).

use crate::common;

use attn_testkit::golden::{assert_attention_dirs_pass, check_case, golden_dir, load_dir};
use candle_core::{DType, Device};
use common::{CandleOp, Layout};

#[test]
fn golden_files_pass_through_the_candle_op() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for layout in [Layout::Bshd, Layout::Bhsd] {
            assert_attention_dirs_pass(&CandleOp { dtype, layout, device: Device::Cpu });
        }
    }
}

#[test]
fn block_mask_files_pass_through_the_candle_op() {
    let dir = golden_dir().join("blocks");
    let cases = load_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert_eq!(cases.len(), 8, "the 8 block-mask files in {}", dir.display());
    let mut failed = Vec::new();
    for (path, case) in &cases {
        let case = case.as_ref().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for layout in [Layout::Bshd, Layout::Bhsd] {
                let report = check_case(case, Some(&CandleOp { dtype, layout, device: Device::Cpu }), None);
                println!("{report}");
                if !report.passed() {
                    failed.push(report.to_string());
                }
            }
        }
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}
