//! Shared by the attn-candle tests: candle tensors from f32 buffers in either layout,
//! one forward + `backward()` through the op, and the op behind the test kit's
//! [`DilatedBackend`] interface (for golden files and the row judge).
#![allow(dead_code)]

pub mod compose;

use attn_candle::{AttnOptions, KeyPaddingMask, dilated_attention_with_lse};
use attn_core::{AttnError, DType as AttnDType, Masks};
use attn_testkit::golden::Problem;
use attn_testkit::{DilatedBackend, Forward32, Gradients32};
use candle_core::{DType, Device, Result, Tensor, Var};

/// How an input tensor is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Contiguous `[batch, seq, heads, head_dim]`.
    Bshd,
    /// Contiguous `[batch, heads, seq, head_dim]`, handed over as `.transpose(1, 2)`.
    Bhsd,
}

/// A leaf variable holding `data` (`[b, s, h, d]` row-major) in `dtype` and `layout`,
/// and the `[b, s, h, d]` tensor the op receives.
pub fn leaf(data: &[f32], dims: [usize; 4], dtype: DType, layout: Layout) -> Result<(Var, Tensor)> {
    let t = Tensor::from_slice(data, dims.to_vec(), &Device::Cpu)?.to_dtype(dtype)?;
    match layout {
        Layout::Bshd => {
            let var = Var::from_tensor(&t)?;
            let x = var.as_tensor().clone();
            Ok((var, x))
        }
        Layout::Bhsd => {
            let var = Var::from_tensor(&t.transpose(1, 2)?.contiguous()?)?;
            let x = var.as_tensor().transpose(1, 2)?;
            Ok((var, x))
        }
    }
}

/// A gradient of a leaf made by [`leaf`], as row-major `[b, s, h, d]` f32.
fn grad_bshd(grad: &Tensor, layout: Layout) -> Result<Vec<f32>> {
    let g = if layout == Layout::Bhsd { grad.transpose(1, 2)? } else { grad.clone() };
    g.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// Everything one call produces, as f32.
#[derive(Debug, Clone)]
pub struct Run {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
    pub grads: [Vec<f32>; 3],
}

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

/// Forward, then `backward()` of `sum(out * grad_out)`, through `attend` (the op or the
/// composition: it returns `(out, lse)` of the three inputs).
pub fn run_with(
    attend: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Vec<f32>)>,
    qkv: [&[f32]; 3],
    dims: [[usize; 4]; 2],
    grad_out: &[f32],
    dtype: DType,
    layout: Layout,
) -> Result<Run> {
    let (qv, q) = leaf(qkv[0], dims[0], dtype, layout)?;
    let (kv, k) = leaf(qkv[1], dims[1], dtype, layout)?;
    let (vv, v) = leaf(qkv[2], dims[1], dtype, layout)?;
    let (out, lse) = attend(&q, &k, &v)?;
    let g = Tensor::from_slice(grad_out, dims[0].to_vec(), &Device::Cpu)?.to_dtype(dtype)?;
    let grads = (&out * &g)?.sum_all()?.backward()?;
    let missing = || candle_core::Error::Msg("no gradient".into());
    let grad = |var: &Var| -> Result<Vec<f32>> { grad_bshd(grads.get(var.as_tensor()).ok_or_else(missing)?, layout) };
    Ok(Run {
        out: out.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
        lse,
        grads: [grad(&qv)?, grad(&kv)?, grad(&vv)?],
    })
}

/// The op on f32 inputs rounded to `dtype`.
pub fn run_op(problem: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32], dtype: DType, layout: Layout) -> Result<Run> {
    let opts = options_of(problem.cfg, &problem.masks);
    let attend = |q: &Tensor, k: &Tensor, v: &Tensor| {
        let r = dilated_attention_with_lse(q, k, v, &opts)?;
        Ok((r.out, r.lse.flatten_all()?.to_vec1()?))
    };
    run_with(attend, qkv, [problem.shape.q.dims(), problem.shape.kv.dims()], grad_out, dtype, layout)
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
