//! Row-wise epilogues on the GPU: write the merged partial as the output dtype (times the
//! heads' `out_scale`), compute `delta = dot(grad_out, out) - grad_lse`, and write f32 gradient
//! accumulators into strided tensors of the input dtype.

use attn_core::error::TensorName;
use attn_core::{AttnError, DilatedConfig, Result, Shape4};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::device::{CudaDevice, cuda_err};
use super::launch::launch;
use super::params::{RowParams, strides3};
use super::plan::out_scale;
use super::tensor::{CudaElement, DevicePartial, DeviceTensor, check_len};

pub(crate) fn row_params(shape: Shape4, a: [usize; 4], b: [usize; 4], scale: f32) -> RowParams {
    let [a_sb, a_ss, a_sh] = strides3(a);
    let [b_sb, b_ss, b_sh] = strides3(b);
    RowParams {
        batch: shape.batch as i64,
        seq: shape.seq as i64,
        heads: shape.heads as i64,
        d: shape.head_dim as i64,
        a_sb,
        a_ss,
        a_sh,
        b_sb,
        b_ss,
        b_sh,
        scale,
        pad: 0,
    }
}

/// The launch of `store_rows_*` over a tensor of `shape` (a grid-stride loop, 256 threads a block).
pub(crate) fn store_launch(shape: Shape4) -> LaunchConfig {
    let blocks = shape.numel().div_ceil(256).clamp(1, 65_535) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// The launch of `delta_rows_*` over the rows of `shape` (a warp a row, 8 warps a block).
pub(crate) fn delta_launch(shape: Shape4) -> Result<LaunchConfig> {
    let warps_per_block = 8usize;
    let blocks = u32::try_from(shape.lse_len().div_ceil(warps_per_block))
        .map_err(|_| AttnError::InvalidArgument("too many rows for one launch".into()))?;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * warps_per_block as u32, 1, 1), shared_mem_bytes: 0 })
}

fn check_dst<T: CudaElement>(tensor: TensorName, dst: &DeviceTensor<T>, shape: Shape4) -> Result<()> {
    if dst.shape != shape || dst.strides[3] != 1 {
        return Err(AttnError::ShapeMismatch {
            tensor,
            expected: shape.dims().to_vec(),
            got: dst.shape.dims().to_vec(),
        });
    }
    let needed = super::tensor::extent(dst.shape, dst.strides);
    if needed > dst.data.len() {
        return Err(AttnError::BufferTooSmall { tensor, len: dst.data.len(), needed });
    }
    Ok(())
}

/// `dst = scale * src` converted to `T`; `src` is contiguous f32 of `dst`'s shape.
pub fn store_scaled<T: CudaElement>(
    dev: &CudaDevice,
    tensor: TensorName,
    src: &CudaSlice<f32>,
    scale: f32,
    dst: &mut DeviceTensor<T>,
) -> Result<()> {
    let shape = dst.shape;
    check_dst(tensor, dst, shape)?;
    check_len(tensor, src.len(), shape.numel())?;
    let p = row_params(shape, dst.strides, dst.strides, scale);
    let f = dev.function(T::SUFFIX, &format!("store_rows_{}", T::SUFFIX), 0)?;
    let lc = store_launch(shape);
    // Signature: (const float* src, T* dst, RowParams).
    let mut args = dev.stream.launch_builder(&f);
    args.arg(src).arg(&mut dst.data).arg(&p);
    launch(args, lc)
}

/// Write the finished forward: `out = out_scale * partial.out` in `T`; returns the LSE
/// (the partial's, `[batch, seq, heads]`) still on the device.
pub fn finish_forward<'a, T: CudaElement>(
    dev: &CudaDevice,
    cfg: &DilatedConfig,
    partial: &'a DevicePartial,
    out: &mut DeviceTensor<T>,
) -> Result<&'a CudaSlice<f32>> {
    if out.shape != partial.shape {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::Output,
            expected: partial.shape.dims().to_vec(),
            got: out.shape.dims().to_vec(),
        });
    }
    store_scaled(dev, TensorName::Output, &partial.out, out_scale(cfg), out)?;
    Ok(&partial.lse)
}

/// The launch of `fill_lse_*` over `len` values (a grid-stride loop, 256 threads a block).
pub(crate) fn fill_launch(len: usize) -> LaunchConfig {
    let blocks = len.div_ceil(256).clamp(1, 65_535) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// A new f32 buffer of `len` values, each `value` (filled by `T`'s module: a call
/// compiles no other dtype's kernels).
pub(crate) fn fill_lse<T: CudaElement>(dev: &CudaDevice, len: usize, value: f32) -> Result<CudaSlice<f32>> {
    let mut dst = dev.stream.alloc_zeros::<f32>(len).map_err(cuda_err)?;
    let lc = fill_launch(len);
    let f = dev.function(T::SUFFIX, &format!("fill_lse_{}", T::SUFFIX), 0)?;
    let n = len as i64;
    // Signature: (float* dst, float value, long long n).
    let mut args = dev.stream.launch_builder(&f);
    args.arg(&mut dst).arg(&value).arg(&n);
    launch(args, lc)?;
    Ok(dst)
}

/// `delta[b, s, h] = dot(grad_out[b, s, h, :], out[b, s, h, :]) - grad_lse[b, s, h]` in
/// f32. `lse_grad` is `(grad_lse, lse)` (`None`: no gradient into the LSE); `grad_lse` is
/// read only where `lse` is finite.
pub fn delta<T: CudaElement>(
    dev: &CudaDevice,
    grad_out: &DeviceTensor<T>,
    out: &DeviceTensor<T>,
    lse_grad: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
) -> Result<CudaSlice<f32>> {
    let shape = grad_out.shape;
    check_dst(TensorName::GradOutput, grad_out, shape)?;
    check_dst(TensorName::Output, out, shape)?;
    if let Some((g, l)) = lse_grad {
        check_len(TensorName::GradLse, g.len(), shape.lse_len())?;
        check_len(TensorName::Lse, l.len(), shape.lse_len())?;
    }
    let mut delta = dev.stream.alloc_zeros::<f32>(shape.lse_len()).map_err(cuda_err)?;
    let p = row_params(shape, grad_out.strides, out.strides, 1.0);
    let f = dev.function(T::SUFFIX, &format!("delta_rows_{}", T::SUFFIX), 0)?;
    let lc = delta_launch(shape)?;
    // Signature: (const T* go, const T* out, const float* grad_lse, const float* lse,
    // float* delta, RowParams); a null grad_lse is none.
    let null: u64 = 0;
    let mut args = dev.stream.launch_builder(&f);
    args.arg(&grad_out.data).arg(&out.data);
    match lse_grad {
        Some((g, l)) => args.arg(g).arg(l),
        None => args.arg(&null).arg(&null),
    };
    args.arg(&mut delta).arg(&p);
    launch(args, lc)?;
    Ok(delta)
}
