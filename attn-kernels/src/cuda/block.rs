//! Block-level entry points on the GPU, the counterpart of `attn_kernels::block` for the
//! ring: a block of q rows (global positions `q_start..`) attends a block of k/v rows
//! (global positions `k_start..`) over all batches and heads; the forward LSE-merges into
//! a [`DevicePartial`], the backward accumulates into [`DeviceGrads`].
//!
//! Difference from the CPU block API: positions are one contiguous range per block
//! (ring chunks; zigzag = two calls), not an arbitrary position list.

use attn_core::error::TensorName;
use attn_core::{AttnError, DilatedConfig, Result, Shape4};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::device::CudaDevice;
use super::launch::launch;
use super::params::{AttnParams, BlockLayout, attn_params};
use super::plan::{
    BackwardKernel, ForwardKernel, MMA_BLOCK_M, PatternLaunch, THREADS, backward_kernel, forward_kernel,
    pattern_launches,
};
use super::source::MAX_HEAD_DIM;
use super::tensor::{CudaElement, DeviceGrads, DevicePartial, DeviceTensor, check_len};

/// Check that q, k, v agree (batch, heads, head_dim; k and v identical) and the config fits.
fn check_block<T: CudaElement>(
    cfg: &DilatedConfig,
    q: &DeviceTensor<T>,
    k: &DeviceTensor<T>,
    v: &DeviceTensor<T>,
    q_start: usize,
    k_start: usize,
) -> Result<()> {
    let (qs, ks) = (q.shape, k.shape);
    if v.shape != ks {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::Value,
            expected: ks.dims().to_vec(),
            got: v.shape.dims().to_vec(),
        });
    }
    if (ks.batch, ks.heads, ks.head_dim) != (qs.batch, qs.heads, qs.head_dim) {
        let expected = vec![qs.batch, ks.seq, qs.heads, qs.head_dim];
        return Err(AttnError::ShapeMismatch { tensor: TensorName::Key, expected, got: ks.dims().to_vec() });
    }
    cfg.validate_heads(qs.heads)?;
    if cfg.window().is_some() {
        return Err(AttnError::Unsupported { backend: "cuda", feature: "sliding windows" });
    }
    if qs.head_dim > MAX_HEAD_DIM {
        return Err(AttnError::InvalidArgument(format!(
            "the cuda backend supports head_dim <= {MAX_HEAD_DIM}, got {}",
            qs.head_dim
        )));
    }
    let fits = |start: usize, rows: usize| start.checked_add(rows).is_some_and(|e| e <= i64::MAX as usize / 2);
    if !fits(q_start, qs.seq) || !fits(k_start, ks.seq) {
        return Err(AttnError::InvalidArgument("block positions overflow".into()));
    }
    for (t, name) in [(q, TensorName::Query), (k, TensorName::Key), (v, TensorName::Value)] {
        if t.strides[3] != 1 {
            return Err(AttnError::NonUnitInnerStride { tensor: name, stride: t.strides[3] });
        }
        let needed = super::tensor::extent(t.shape, t.strides);
        if needed > t.data.len() {
            return Err(AttnError::BufferTooSmall { tensor: name, len: t.data.len(), needed });
        }
    }
    Ok(())
}

fn base_params<T: CudaElement>(
    cfg: &DilatedConfig,
    q: &DeviceTensor<T>,
    k: &DeviceTensor<T>,
    v: &DeviceTensor<T>,
    q_start: usize,
    k_start: usize,
    launch: &PatternLaunch,
) -> AttnParams {
    let layout = BlockLayout {
        q: (q.shape, q.strides),
        k: (k.shape, k.strides),
        v_strides: v.strides,
        g_strides: None,
        q_start,
        k_start,
    };
    attn_params(cfg, &layout, launch)
}

fn grid(rows: usize, per_block: usize, heads: usize, batch: usize) -> Result<Option<LaunchConfig>> {
    let x = rows.div_ceil(per_block);
    if x == 0 {
        return Ok(None);
    }
    let too_big = || AttnError::InvalidArgument(format!("launch grid too large ({x} x {heads} x {batch})"));
    let gx = u32::try_from(x).ok().filter(|&g| g < i32::MAX as u32).ok_or_else(too_big)?;
    let gy = u32::try_from(heads).ok().filter(|&g| g <= 65_535).ok_or_else(too_big)?;
    let gz = u32::try_from(batch).ok().filter(|&g| g <= 65_535).ok_or_else(too_big)?;
    Ok(Some(LaunchConfig { grid_dim: (gx, gy, gz), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }))
}

/// A block on the device: q rows starting at global position `q_start`, k/v rows at
/// `k_start`, under every pattern of `cfg`.
#[derive(Debug, Clone, Copy)]
pub struct DeviceBlock<'a, T: CudaElement> {
    pub cfg: &'a DilatedConfig,
    pub q: &'a DeviceTensor<T>,
    pub q_start: usize,
    pub k: &'a DeviceTensor<T>,
    pub v: &'a DeviceTensor<T>,
    pub k_start: usize,
}

/// What the backward of a block reads for its q rows: `grad_out` (q's shape), the heads'
/// FINAL lse and `delta = dot(grad_out, out)` (both f32 `[batch, q_rows, heads]`).
#[derive(Debug, Clone, Copy)]
pub struct DeviceUpstream<'a, T: CudaElement> {
    pub grad_out: &'a DeviceTensor<T>,
    pub lse: &'a CudaSlice<f32>,
    pub delta: &'a CudaSlice<f32>,
}

/// Attend the block's q rows to its k/v rows (global positions) with every pattern of
/// its config and LSE-merge into `partial` (shape of q). Calling it for every key block,
/// in any order, gives the attention over all of them; then [`finish_forward`](crate::cuda::finish_forward).
pub fn forward_block<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    partial: &mut DevicePartial,
) -> Result<()> {
    let DeviceBlock { cfg, q, q_start, k, v, k_start } = *block;
    check_block(cfg, q, k, v, q_start, k_start)?;
    check_partial(partial, q.shape)?;
    let (kernel, per_block, smem) = match forward_kernel(T::DTYPE, T::SUFFIX, q.shape.head_dim) {
        ForwardKernel::Mma { name, smem_bytes, .. } => (name, MMA_BLOCK_M, smem_bytes),
        ForwardKernel::Rows { name } => (name, (THREADS / 32) as usize, 0),
    };
    let f = dev.function(T::SUFFIX, &kernel, smem)?;
    for pl in pattern_launches(cfg, q.shape.heads) {
        let Some(mut lc) = grid(pl.max_selected(q_start, q.shape.seq), per_block, pl.heads.len(), q.shape.batch)?
        else {
            continue;
        };
        lc.shared_mem_bytes = smem as u32;
        let params = base_params(cfg, q, k, v, q_start, k_start, &pl);
        // Signature: (q, k, v, o_acc, lse_acc, AttnParams) for both forward kernels.
        let mut args = dev.stream.launch_builder(&f);
        args.arg(&q.data).arg(&k.data).arg(&v.data).arg(&mut partial.out).arg(&mut partial.lse).arg(&params);
        launch(args, lc)?;
    }
    Ok(())
}

fn check_partial(partial: &DevicePartial, q: Shape4) -> Result<()> {
    if partial.shape != q {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::Output,
            expected: q.dims().to_vec(),
            got: partial.shape.dims().to_vec(),
        });
    }
    check_len(TensorName::Output, partial.out.len(), q.numel())?;
    check_len(TensorName::Lse, partial.lse.len(), q.lse_len())
}

/// Accumulate the gradients of one (q block, k block) pair into `grads` (f32), given the
/// [`DeviceUpstream`] of its q rows.
pub fn backward_block<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    upstream: &DeviceUpstream<'_, T>,
    grads: &mut DeviceGrads,
) -> Result<()> {
    let DeviceBlock { cfg, q, q_start, k, v, k_start } = *block;
    let DeviceUpstream { grad_out, lse, delta } = *upstream;
    check_block(cfg, q, k, v, q_start, k_start)?;
    if grad_out.shape != q.shape || grad_out.strides[3] != 1 {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::GradOutput,
            expected: q.shape.dims().to_vec(),
            got: grad_out.shape.dims().to_vec(),
        });
    }
    let needed = super::tensor::extent(grad_out.shape, grad_out.strides);
    if needed > grad_out.data.len() {
        return Err(AttnError::BufferTooSmall { tensor: TensorName::GradOutput, len: grad_out.data.len(), needed });
    }
    check_len(TensorName::Lse, lse.len(), q.shape.lse_len())?;
    check_len(TensorName::Other("delta"), delta.len(), q.shape.lse_len())?;
    if grads.q_shape != q.shape || grads.kv_shape != k.shape {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::GradQuery,
            expected: [q.shape.dims(), k.shape.dims()].concat(),
            got: [grads.q_shape.dims(), grads.kv_shape.dims()].concat(),
        });
    }
    check_len(TensorName::GradQuery, grads.dq.len(), q.shape.numel())?;
    check_len(TensorName::GradKey, grads.dk.len(), k.shape.numel())?;
    check_len(TensorName::GradValue, grads.dv.len(), k.shape.numel())?;
    let kernel = backward_kernel(T::DTYPE, T::SUFFIX, q.shape.head_dim);
    let warps = (THREADS / 32) as usize;
    for pl in pattern_launches(cfg, q.shape.heads) {
        let layout = BlockLayout {
            q: (q.shape, q.strides),
            k: (k.shape, k.strides),
            v_strides: v.strides,
            g_strides: Some(grad_out.strides),
            q_start,
            k_start,
        };
        let params = attn_params(cfg, &layout, &pl);
        let q_rows = pl.max_selected(q_start, q.shape.seq);
        let k_rows = pl.max_selected(k_start, k.shape.seq);
        match &kernel {
            BackwardKernel::Mma { name, block_n, smem_bytes } => {
                let f = dev.function(T::SUFFIX, name, *smem_bytes)?;
                if let Some(mut lc) = grid(k_rows, *block_n, pl.heads.len(), q.shape.batch)? {
                    lc.shared_mem_bytes = *smem_bytes as u32;
                    // Signature: (q, k, v, go, lse, delta, dq_acc, dk_acc, dv_acc, AttnParams).
                    let mut args = dev.stream.launch_builder(&f);
                    args.arg(&q.data).arg(&k.data).arg(&v.data).arg(&grad_out.data).arg(lse).arg(delta);
                    args.arg(&mut grads.dq).arg(&mut grads.dk).arg(&mut grads.dv).arg(&params);
                    launch(args, lc)?;
                }
            }
            BackwardKernel::Rows { dq, dkv } => {
                let (f_dq, f_dkv) = (dev.function(T::SUFFIX, dq, 0)?, dev.function(T::SUFFIX, dkv, 0)?);
                if let Some(lc) = grid(q_rows, warps, pl.heads.len(), q.shape.batch)? {
                    // Signature: (q, k, v, go, lse, delta, dq_acc, AttnParams).
                    let mut args = dev.stream.launch_builder(&f_dq);
                    args.arg(&q.data).arg(&k.data).arg(&v.data).arg(&grad_out.data).arg(lse).arg(delta);
                    args.arg(&mut grads.dq).arg(&params);
                    launch(args, lc)?;
                }
                if let Some(lc) = grid(k_rows, warps, pl.heads.len(), q.shape.batch)? {
                    // Signature: (q, k, v, go, lse, delta, dk_acc, dv_acc, AttnParams).
                    let mut args = dev.stream.launch_builder(&f_dkv);
                    args.arg(&q.data).arg(&k.data).arg(&v.data).arg(&grad_out.data).arg(lse).arg(delta);
                    args.arg(&mut grads.dk).arg(&mut grads.dv).arg(&params);
                    launch(args, lc)?;
                }
            }
        }
    }
    Ok(())
}
