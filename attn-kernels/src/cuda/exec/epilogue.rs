//! Row-wise epilogues on the GPU: write the merged partial as the output dtype (times the
//! heads' `out_scale`), compute `delta = dot(grad_out, out) - grad_lse`, and write f32 gradient
//! accumulators into strided tensors of the input dtype.

use attn_core::error::TensorName;
use attn_core::{AttnError, DilatedConfig, Result, Shape4};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::device::{CudaDevice, cuda_err};
use super::launch::launch;
use super::tensor::{CudaElement, DevicePartial, DeviceTensor, check_len};
use crate::cuda::plan::params::{RowParams, strides3};
use crate::cuda::plan::patterns::out_scale;

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

/// Whether a tensor of `shape` with `strides` starting at byte address `start` allows the
/// 8-value (16-byte) accesses of the `_v8` epilogues: `d % 8 == 0`, every row stride a
/// multiple of 8 elements, the start on a 16-byte boundary (for `elem` bytes an element,
/// 2 or 4), and fewer than 2^31 8-value chunks (their 32-bit index math).
pub(crate) fn v8_layout(shape: Shape4, strides: [usize; 4], start: u64, elem: usize) -> bool {
    let bytes = 8 * elem;
    shape.head_dim.is_multiple_of(8)
        && strides[..3].iter().all(|s| s.is_multiple_of(8))
        && start.is_multiple_of(16)
        && (bytes == 16 || bytes == 32)
        && (shape.numel() / 8) < (1 << 31)
}

/// The kernel and launch of `store_rows` over a tensor of `shape` (a grid-stride loop, 256
/// threads a block): the 8-value kernel where the destination's layout allows it.
pub(crate) fn store_kernel(
    suffix: &str,
    shape: Shape4,
    dst_strides: [usize; 4],
    dst_start: u64,
    elem: usize,
) -> (String, LaunchConfig) {
    let (name, work) = match v8_layout(shape, dst_strides, dst_start, elem) {
        true => (format!("store_rows_v8_{suffix}"), shape.numel() / 8),
        false => (format!("store_rows_{suffix}"), shape.numel()),
    };
    let blocks = work.div_ceil(256).clamp(1, 65_535) as u32;
    (name, LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
}

/// The kernel and launch of `delta_rows` over the rows of `shape` (a warp a row, 8 warps a
/// block): the 16-byte loads where both tensors (`(strides, start)` each) allow them and
/// the dtype is 16-bit.
pub(crate) fn delta_kernel(
    suffix: &str,
    shape: Shape4,
    [(gs, g0), (os, o0)]: [([usize; 4], u64); 2],
    elem: usize,
) -> Result<(String, LaunchConfig)> {
    let warps_per_block = 8usize;
    let blocks = u32::try_from(shape.lse_len().div_ceil(warps_per_block))
        .map_err(|_| AttnError::InvalidArgument("too many rows for one launch".into()))?;
    let v8 = elem == 2 && v8_layout(shape, gs, g0, elem) && v8_layout(shape, os, o0, elem);
    let name = if v8 { format!("delta_rows_v8_{suffix}") } else { format!("delta_rows_{suffix}") };
    let lc =
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * warps_per_block as u32, 1, 1), shared_mem_bytes: 0 };
    Ok((name, lc))
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
    let start = dst.data.device_ptr(&dev.stream).0;
    let (name, lc) = store_kernel(T::SUFFIX, shape, dst.strides, start, size_of::<T>());
    let f = dev.function(T::SUFFIX, &name, 0)?;
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

/// `delta[b, s, h] = dot(grad_out[b, s, h, :], out[b, s, h, :]) - grad_lse[b, s, h]` in
/// f32. `lse_grad` is `(grad_lse, lse)` (`None`: no gradient into the LSE); `grad_lse` is
/// read only where `lse` is finite.
pub fn delta<T: CudaElement>(
    dev: &CudaDevice,
    grad_out: &DeviceTensor<T>,
    out: &DeviceTensor<T>,
    lse_grad: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
) -> Result<CudaSlice<f32>> {
    let mut delta = dev.stream.alloc_zeros::<f32>(grad_out.shape.lse_len()).map_err(cuda_err)?;
    delta_into(dev, grad_out, out, lse_grad, &mut delta)?;
    Ok(delta)
}

/// [`delta`] written into `delta` (f32 `[batch, rows, heads]`), allocating nothing.
pub fn delta_into<T: CudaElement>(
    dev: &CudaDevice,
    grad_out: &DeviceTensor<T>,
    out: &DeviceTensor<T>,
    lse_grad: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
    delta: &mut CudaSlice<f32>,
) -> Result<()> {
    let shape = grad_out.shape;
    check_dst(TensorName::GradOutput, grad_out, shape)?;
    check_dst(TensorName::Output, out, shape)?;
    if let Some((g, l)) = lse_grad {
        check_len(TensorName::GradLse, g.len(), shape.lse_len())?;
        check_len(TensorName::Lse, l.len(), shape.lse_len())?;
    }
    check_len(TensorName::Other("delta"), delta.len(), shape.lse_len())?;
    let p = row_params(shape, grad_out.strides, out.strides, 1.0);
    let at = |t: &DeviceTensor<T>| (t.strides, t.data.device_ptr(&dev.stream).0);
    let (name, lc) = delta_kernel(T::SUFFIX, shape, [at(grad_out), at(out)], size_of::<T>())?;
    let f = dev.function(T::SUFFIX, &name, 0)?;
    // Signature: (const T* go, const T* out, const float* grad_lse, const float* lse,
    // float* delta, RowParams); a null grad_lse is none.
    let null: u64 = 0;
    let mut args = dev.stream.launch_builder(&f);
    args.arg(&grad_out.data).arg(&out.data);
    match lse_grad {
        Some((g, l)) => args.arg(g).arg(l),
        None => args.arg(&null).arg(&null),
    };
    args.arg(delta).arg(&p);
    launch(args, lc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_epilogues_run_only_where_the_layout_allows() {
        let s = Shape4::new(2, 10, 4, 64).unwrap();
        let c = s.contiguous_strides();
        assert_eq!(store_kernel("bf16", s, c, 4096, 2).0, "store_rows_v8_bf16");
        assert_eq!(store_kernel("f32", s, c, 4096, 4).0, "store_rows_v8_f32");
        // Off a 16-byte boundary, a row stride off a multiple of 8, a head dim off 8.
        assert_eq!(store_kernel("bf16", s, c, 4098, 2).0, "store_rows_bf16");
        assert_eq!(store_kernel("bf16", s, [2560, 260, 65, 1], 4096, 2).0, "store_rows_bf16");
        let odd = Shape4::new(2, 10, 4, 60).unwrap();
        assert_eq!(store_kernel("bf16", odd, odd.contiguous_strides(), 4096, 2).0, "store_rows_bf16");
        // The vector store runs one thread per 8 values.
        assert_eq!(store_kernel("bf16", s, c, 0, 2).1.grid_dim.0 as usize, (s.numel() / 8).div_ceil(256));
        let ok = (c, 4096);
        assert_eq!(delta_kernel("f16", s, [ok, ok], 2).unwrap().0, "delta_rows_v8_f16");
        assert_eq!(delta_kernel("f32", s, [ok, ok], 4).unwrap().0, "delta_rows_f32");
        assert_eq!(delta_kernel("f16", s, [ok, (c, 4100)], 2).unwrap().0, "delta_rows_f16");
    }
}
