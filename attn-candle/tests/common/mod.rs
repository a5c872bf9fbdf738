//! Shared by the attn-candle tests: the op on f32 buffers for a test kit problem, and
//! the op behind the test kit's [`DilatedBackend`] interface (golden files).
#![allow(dead_code)]

pub mod compose;

use attn_candle::{AttnOptions, BufferRun, KeyPaddingMask, dilated_attention_with_lse, run_buffers};
use attn_core::{AttnError, DType as AttnDType, Masks};
use attn_testkit::golden::Problem;
use attn_testkit::{DilatedBackend, Forward32, Gradients32};
use candle_core::{DType, Result, Tensor};

pub type Run = BufferRun;
pub use attn_candle::InputLayout as Layout;

/// The options a test kit problem describes.
pub fn options_of(cfg: &attn_core::DilatedConfig, masks: &Masks<'_>) -> AttnOptions {
    let mut opts = AttnOptions::new(cfg.clone());
    if let Some(p) = masks.key_padding {
        opts = opts.with_key_padding(KeyPaddingMask::new(p.flags().to_vec(), p.batch(), p.seq()).expect("valid mask"));
    }
    if let Some(packing) = masks.packing {
        opts = opts.with_cu_seqlens(packing.cu_seqlens().to_vec()).expect("valid cu_seqlens");
    }
    opts
}

/// The op on f32 inputs rounded to `dtype`.
pub fn run_op(problem: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32], dtype: DType, layout: Layout) -> Result<Run> {
    let opts = options_of(problem.cfg, &problem.masks);
    let attend = |q: &Tensor, k: &Tensor, v: &Tensor| {
        let r = dilated_attention_with_lse(q, k, v, &opts)?;
        Ok((r.out, r.lse.flatten_all()?.to_vec1()?))
    };
    run_buffers(attend, qkv, [problem.shape.q.dims(), problem.shape.kv.dims()], grad_out, (dtype, layout))
}

/// The candle op in one dtype and layout behind the test kit's interface.
#[derive(Debug, Clone, Copy)]
pub struct CandleOp {
    pub dtype: DType,
    pub layout: Layout,
}

fn attn_err(e: candle_core::Error) -> AttnError {
    AttnError::InvalidArgument(e.to_string())
}

impl DilatedBackend for CandleOp {
    fn name(&self) -> String {
        format!("candle {:?} {:?}", self.dtype, self.layout).to_lowercase()
    }
    fn dtype(&self) -> AttnDType {
        match self.dtype {
            DType::BF16 => AttnDType::BF16,
            DType::F16 => AttnDType::F16,
            _ => AttnDType::F32,
        }
    }
    fn forward(&self, problem: &Problem<'_>, qkv: [&[f32]; 3]) -> attn_core::Result<Forward32> {
        let zeros = vec![0.0; problem.shape.q.numel()];
        let r = run_op(problem, qkv, &zeros, self.dtype, self.layout).map_err(attn_err)?;
        Ok(Forward32 { out: r.out, lse: r.lse })
    }
    fn backward(&self, problem: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> attn_core::Result<Gradients32> {
        let [dq, dk, dv] = run_op(problem, qkv, grad_out, self.dtype, self.layout).map_err(attn_err)?.grads;
        Ok(Gradients32 { dq, dk, dv })
    }
}
