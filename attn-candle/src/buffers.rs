//! The op on plain f32 buffers, for conformance runners and tests: inputs rounded to a
//! candle dtype and handed over in either memory layout on a chosen device, one forward
//! and candle's `backward()` of `sum(out * grad_out)`, results back as row-major f32.

use candle_core::{DType, Device, Result, Tensor, Var};

/// How an input tensor sits in memory when the op receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputLayout {
    /// Contiguous `[batch, seq, heads, head_dim]`.
    Bshd,
    /// Contiguous `[batch, heads, seq, head_dim]`, handed over as `.transpose(1, 2)`.
    Bhsd,
}

/// A leaf variable on `device` holding `data` (row-major `[b, s, h, d]`) in `dtype` and
/// `layout`, and the `[b, s, h, d]` tensor an op receives.
pub fn leaf(
    device: &Device,
    data: &[f32],
    dims: [usize; 4],
    dtype: DType,
    layout: InputLayout,
) -> Result<(Var, Tensor)> {
    let t = Tensor::from_slice(data, dims.to_vec(), &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?;
    let var = match layout {
        InputLayout::Bshd => Var::from_tensor(&t)?,
        InputLayout::Bhsd => Var::from_tensor(&t.transpose(1, 2)?.contiguous()?)?,
    };
    let x = match layout {
        InputLayout::Bshd => var.as_tensor().clone(),
        InputLayout::Bhsd => var.as_tensor().transpose(1, 2)?,
    };
    Ok((var, x))
}

/// Everything one call produced, as row-major f32: out, LSE, `[dq, dk, dv]`.
#[derive(Debug, Clone)]
pub struct BufferRun {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
    pub grads: [Vec<f32>; 3],
}

/// Forward through `attend` (which returns `(out, lse)` of q, k, v), then `backward()`
/// of `sum(out * grad_out)`, on the host. `dims` are q's and k's `[b, s, h, d]`.
pub fn run_buffers(
    attend: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Vec<f32>)>,
    qkv: [&[f32]; 3],
    dims: [[usize; 4]; 2],
    grad_out: &[f32],
    dtype_layout: (DType, InputLayout),
) -> Result<BufferRun> {
    run_buffers_on(&Device::Cpu, attend, qkv, dims, grad_out, dtype_layout)
}

/// [`run_buffers`] with every tensor on `device`.
pub fn run_buffers_on(
    device: &Device,
    attend: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Vec<f32>)>,
    qkv: [&[f32]; 3],
    dims: [[usize; 4]; 2],
    grad_out: &[f32],
    (dtype, layout): (DType, InputLayout),
) -> Result<BufferRun> {
    let (qv, q) = leaf(device, qkv[0], dims[0], dtype, layout)?;
    let (kv, k) = leaf(device, qkv[1], dims[1], dtype, layout)?;
    let (vv, v) = leaf(device, qkv[2], dims[1], dtype, layout)?;
    let (out, lse) = attend(&q, &k, &v)?;
    let g = Tensor::from_slice(grad_out, dims[0].to_vec(), &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?;
    let grads = (&out * &g)?.sum_all()?.backward()?;
    let grad = |var: &Var| -> Result<Vec<f32>> {
        let g = grads.get(var.as_tensor()).ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?;
        let g = if layout == InputLayout::Bhsd { g.transpose(1, 2)? } else { g.clone() };
        g.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
    };
    Ok(BufferRun {
        out: out.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
        lse,
        grads: [grad(&qv)?, grad(&kv)?, grad(&vv)?],
    })
}
