//! The golden files of `conformance/dilated`, `conformance/features` and `conformance/wide` through the
//! candle op, forward and candle-autograd gradients, in f32, bf16 and f16 and in both
//! layouts (BSHD, and BHSD handed over transposed).

use crate::common;

use attn_testkit::golden::assert_attention_dirs_pass;
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
