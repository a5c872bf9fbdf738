//! Whole calls on device tensors the caller holds (the host backend's uploads, or a
//! framework's tensors through `foreign`): the forward writing out and lse into given
//! buffers, and the exact backward writing dq, dk and dv in the inputs' dtype.

use attn_core::error::TensorName;
use attn_core::{AttnError, Result, Shape4};
use cudarc::driver::CudaSlice;

use super::block::{DeviceBlock, DeviceUpstream, ForwardPath, backward_block, forward_call};
use super::device::{CudaDevice, cuda_err};
use super::epilogue::{delta, store_scaled};
use super::tensor::{CudaElement, DeviceGrads, DeviceTensor, check_len};

/// [`forward_call`] (the direct path where it applies) with the lse written into `lse`,
/// f32 `[batch, rows, heads]`, instead of a new buffer.
pub fn forward_call_into<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    out: &mut DeviceTensor<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    check_len(TensorName::Lse, lse.len(), block.q.shape.lse_len())?;
    let computed = forward_call(dev, block, out, ForwardPath::Direct)?;
    dev.stream.memcpy_dtod(&computed, lse).map_err(cuda_err)
}

/// What the forward of a whole call left for its backward: the output (q's shape) and the
/// f32 lse `[batch, rows, heads]`.
#[derive(Debug, Clone, Copy)]
pub struct DeviceSaved<'a, T: CudaElement> {
    pub out: &'a DeviceTensor<T>,
    pub lse: &'a CudaSlice<f32>,
}

fn expect_shape<T>(tensor: TensorName, t: &DeviceTensor<T>, want: Shape4) -> Result<()> {
    if t.shape != want {
        return Err(AttnError::ShapeMismatch { tensor, expected: want.dims().to_vec(), got: t.shape.dims().to_vec() });
    }
    Ok(())
}

/// The exact backward of a whole call (the block holds every query and key): the
/// gradients of `sum(out * grad_out) + sum(lse * grad_lse)` (`grad_lse` f32 like the lse,
/// `None` for zeros) written into `dq` (q's shape) and `dk`, `dv` (k's), any strides with
/// head_dim stride 1, in `T`, from f32 accumulators.
pub fn backward_call<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    saved: DeviceSaved<'_, T>,
    grad_out: &DeviceTensor<T>,
    grad_lse: Option<&CudaSlice<f32>>,
    [dq, dk, dv]: [&mut DeviceTensor<T>; 3],
) -> Result<()> {
    let (qs, ks) = (block.q.shape, block.k.shape);
    expect_shape(TensorName::Output, saved.out, qs)?;
    expect_shape(TensorName::GradOutput, grad_out, qs)?;
    expect_shape(TensorName::GradQuery, dq, qs)?;
    expect_shape(TensorName::GradKey, dk, ks)?;
    expect_shape(TensorName::GradValue, dv, ks)?;
    check_len(TensorName::Lse, saved.lse.len(), qs.lse_len())?;
    let dsum = delta(dev, grad_out, saved.out, grad_lse.map(|g| (g, saved.lse)))?;
    let mut acc = DeviceGrads::zeros(dev, qs, ks)?;
    let upstream = DeviceUpstream { grad_out, lse: saved.lse, delta: &dsum };
    backward_block(dev, block, &upstream, &mut acc)?;
    store_scaled(dev, TensorName::GradQuery, &acc.dq, 1.0, dq)?;
    store_scaled(dev, TensorName::GradKey, &acc.dk, 1.0, dk)?;
    store_scaled(dev, TensorName::GradValue, &acc.dv, 1.0, dv)
}
