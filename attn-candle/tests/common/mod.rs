//! Shared by the attn-candle tests: the op on f32 buffers for a test kit problem, and
//! the op behind the test kit's [`DilatedBackend`] interface (golden files).
#![allow(dead_code)]

pub mod compose;

use attn_candle::{AttnOptions, BufferRun, dilated_attention_with_lse, leaf, run_buffers_on};
use attn_core::{AttnError, DType as AttnDType, Masks};
use attn_testkit::golden::Problem;
use attn_testkit::judge::{Expected, judge_backward, judge_forward, verdict};
use attn_testkit::{DilatedBackend, FeatureCase, Forward32, Gradients32};
use candle_core::{DType, Device, Result, Tensor};

pub type Run = BufferRun;
pub use attn_candle::InputLayout as Layout;

/// The options a test kit problem describes.
pub fn options_of(cfg: &attn_core::DilatedConfig, masks: &Masks<'_>) -> AttnOptions {
    AttnOptions::new(cfg.clone()).with_masks((*masks).into())
}

/// The op on f32 inputs rounded to `dtype`, on the host.
pub fn run_op(problem: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32], dtype: DType, layout: Layout) -> Result<Run> {
    run_op_on(&Device::Cpu, problem, qkv, grad_out, dtype, layout)
}

/// [`run_op`] with every tensor on `device`.
pub fn run_op_on(
    device: &Device,
    problem: &Problem<'_>,
    qkv: [&[f32]; 3],
    grad_out: &[f32],
    dtype: DType,
    layout: Layout,
) -> Result<Run> {
    let opts = options_of(problem.cfg, &problem.masks);
    let attend = |q: &Tensor, k: &Tensor, v: &Tensor| {
        let r = dilated_attention_with_lse(q, k, v, &opts)?;
        Ok((r.out, r.lse.flatten_all()?.to_vec1()?))
    };
    let dims = [problem.shape.q.dims(), problem.shape.kv.dims()];
    run_buffers_on(device, attend, qkv, dims, grad_out, (dtype, layout))
}

/// The candle op in one dtype and layout, on one device, behind the test kit's interface.
#[derive(Debug, Clone)]
pub struct CandleOp {
    pub dtype: DType,
    pub layout: Layout,
    pub device: Device,
}

fn attn_err(e: candle_core::Error) -> AttnError {
    AttnError::InvalidArgument(e.to_string())
}

impl DilatedBackend for CandleOp {
    fn name(&self) -> String {
        let device = if self.device.is_cuda() { " cuda" } else { "" };
        format!("candle {:?} {:?}{device}", self.dtype, self.layout).to_lowercase()
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
        let r = run_op_on(&self.device, problem, qkv, &zeros, self.dtype, self.layout).map_err(attn_err)?;
        Ok(Forward32 { out: r.out, lse: r.lse })
    }
    fn backward(&self, problem: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> attn_core::Result<Gradients32> {
        let run = run_op_on(&self.device, problem, qkv, grad_out, self.dtype, self.layout).map_err(attn_err)?;
        let [dq, dk, dv] = run.grads;
        Ok(Gradients32 { dq, dk, dv })
    }
    fn backward_lse(
        &self,
        problem: &Problem<'_>,
        qkv: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: &[f32],
    ) -> attn_core::Result<Gradients32> {
        let [dq, dk, dv] = lse_gradients(self, problem, qkv, [grad_out, grad_lse]).map_err(attn_err)?;
        Ok(Gradients32 { dq, dk, dv })
    }
}

/// candle's `backward()` of `sum(out * grad_out) + sum(lse * grad_lse)` through the op:
/// `[dq, dk, dv]` as row-major f32.
pub fn lse_gradients(
    op: &CandleOp,
    problem: &Problem<'_>,
    qkv: [&[f32]; 3],
    [grad_out, grad_lse]: [&[f32]; 2],
) -> Result<[Vec<f32>; 3]> {
    let (dev, dtype, layout) = (&op.device, op.dtype, op.layout);
    let (qd, kd) = (problem.shape.q.dims(), problem.shape.kv.dims());
    let (qv, q) = leaf(dev, qkv[0], qd, dtype, layout)?;
    let (kv, k) = leaf(dev, qkv[1], kd, dtype, layout)?;
    let (vv, v) = leaf(dev, qkv[2], kd, dtype, layout)?;
    let r = dilated_attention_with_lse(&q, &k, &v, &options_of(problem.cfg, &problem.masks))?;
    let go = Tensor::from_slice(grad_out, qd.to_vec(), &Device::Cpu)?.to_dtype(dtype)?.to_device(dev)?;
    let gl = Tensor::from_slice(grad_lse, &qd[..3], &Device::Cpu)?.to_device(dev)?;
    let loss = ((&r.out * &go)?.sum_all()?.to_dtype(DType::F32)? + (&r.lse * &gl)?.sum_all()?)?;
    let grads = loss.backward()?;
    let grad = |var: &candle_core::Var| -> Result<Vec<f32>> {
        let g = grads.get(var.as_tensor()).ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?;
        let g = if layout == Layout::Bhsd { g.transpose(1, 2)? } else { g.clone() };
        g.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
    };
    Ok([grad(&qv)?, grad(&kv)?, grad(&vv)?])
}

/// `got` against `want` (another run of the same case: the composition, or the op on
/// another device), row by row within the f32 row bound (the repository's: f32 noise
/// times each row's norm and its magnitude's norm), magnitudes from the float64 reference.
pub fn agree(case: &FeatureCase, got: &Run, want: &Run) -> std::result::Result<(), String> {
    let [q, k, v, go] = case.inputs().map(|x| x.into_iter().map(f64::from).collect::<Vec<_>>());
    let mut expected = Expected::for_problem(&case.problem(), [&q, &k, &v], Some(&go)).map_err(|e| e.to_string())?;
    let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
    expected.fwd.out = wide(&want.out);
    expected.fwd.lse = wide(&want.lse);
    [expected.grads.dq, expected.grads.dk, expected.grads.dv] = want.grads.each_ref().map(|g| wide(g));
    let mut rows = judge_forward(&expected, &got.out, &got.lse, AttnDType::F32);
    let [dq, dk, dv] = &got.grads;
    rows.extend(judge_backward(&expected, [dq, dk, dv], AttnDType::F32));
    verdict(&rows)
}
