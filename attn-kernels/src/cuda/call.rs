//! Whole calls on device tensors the caller holds (the host backend's uploads, or a
//! framework's tensors through `foreign`): the forward writing out and lse into given
//! buffers, and the exact backward writing dq, dk and dv in the inputs' dtype. Their f32
//! scratch (the forward's partial where the output cannot come straight from the kernel,
//! the backward's accumulators and delta) comes from the caller ([`BackwardScratch`], a
//! framework's allocator) or from the stream's pool on the device ([`super::scratch`]), so
//! a repeated shape allocates no device memory after its first call.

use attn_core::error::TensorName;
use attn_core::{AttnError, Result, Shape4};
use cudarc::driver::CudaSlice;

use super::block::{
    DeviceBlock, DeviceUpstream, backward_block_direct, backward_block_into, check_contiguous_out,
    direct_gradient_plan, forward_block_into, forward_direct_into,
};
use super::device::{CudaDevice, cuda_err};
use super::epilogue::{delta_into, store_scaled};
use super::launch_plan::Planned;
use super::plan::out_scale;
use super::scratch::{ScratchSlot, backward_scratch};
use super::tensor::fill_into;
use super::tensor::{CudaElement, DeviceGradsMut, DeviceTensor, check_len};

/// How a whole-call forward ([`forward_call`]) reaches its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardPath {
    /// Straight into the output where every head has one pattern and the tensor-core
    /// kernel runs (no f32 partial, no epilogue); through the partial otherwise.
    Direct,
    /// Always through an f32 partial and [`finish_forward`](crate::cuda::finish_forward),
    /// as a ring step does.
    Partial,
}

/// The forward of a whole call (the block holds every query and key): `out` (contiguous,
/// q's shape) written in `T` with the heads' output scale; returns the lse `[batch, rows,
/// heads]` in a new buffer. `path` chooses [`ForwardPath::Direct`] where it applies.
pub fn forward_call<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    out: &mut DeviceTensor<T>,
    path: ForwardPath,
) -> Result<CudaSlice<f32>> {
    let mut lse = dev.stream.alloc_zeros::<f32>(block.q.shape.lse_len()).map_err(cuda_err)?;
    forward_call_by(dev, block, out, &mut lse, path)?;
    Ok(lse)
}

/// [`forward_call`] (the direct path where it applies) with the lse written into `lse`,
/// f32 `[batch, rows, heads]`: no device allocation once the stream's pool holds the
/// partial of this shape (none at all on the direct path).
pub fn forward_call_into<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    out: &mut DeviceTensor<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    forward_call_by(dev, block, out, lse, ForwardPath::Direct)
}

/// [`forward_call_into`] by `path`.
pub fn forward_call_by<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    out: &mut DeviceTensor<T>,
    lse: &mut CudaSlice<f32>,
    path: ForwardPath,
) -> Result<()> {
    let shape = block.q.shape;
    check_len(TensorName::Lse, lse.len(), shape.lse_len())?;
    if path == ForwardPath::Direct && forward_direct_into(dev, block, out, lse)? {
        return Ok(());
    }
    check_contiguous_out(out, shape)?;
    // The partial path: an f32 output from the pool, the caller's lse as its lse.
    let mut partial = dev.take_scratch(ScratchSlot::PartialOut, shape.numel())?;
    let done = forward_through(dev, block, &mut partial, out, lse);
    dev.give_scratch(ScratchSlot::PartialOut, partial);
    done
}

/// The partial path: `partial` (and `lse`) emptied, every pattern merged into them, then
/// the output written with the heads' scale.
fn forward_through<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    partial: &mut CudaSlice<f32>,
    out: &mut DeviceTensor<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    dev.stream.memset_zeros(partial).map_err(cuda_err)?;
    fill_into::<T>(dev, lse, f32::NEG_INFINITY)?;
    forward_block_into(dev, block, partial, lse)?;
    store_scaled(dev, TensorName::Output, partial, out_scale(block.cfg), out)
}

/// What the forward of a whole call left for its backward: the output (q's shape) and the
/// f32 lse `[batch, rows, heads]`.
#[derive(Debug, Clone, Copy)]
pub struct DeviceSaved<'a, T: CudaElement> {
    pub out: &'a DeviceTensor<T>,
    pub lse: &'a CudaSlice<f32>,
}

/// The f32 scratch of a whole-call backward, from the caller: `delta` `[batch, rows,
/// heads]`, `dq` like q, `dk` and `dv` like k (contents need not be zero: the call zeroes
/// the accumulators on the stream).
#[derive(Debug)]
pub struct BackwardScratch<'a> {
    pub delta: &'a mut CudaSlice<f32>,
    pub dq: &'a mut CudaSlice<f32>,
    pub dk: &'a mut CudaSlice<f32>,
    pub dv: &'a mut CudaSlice<f32>,
}

/// The lengths of [`BackwardScratch`]'s buffers for q of `q` and k/v of `kv`: delta, dq,
/// dk, dv.
pub fn backward_scratch_lens(q: Shape4, kv: Shape4) -> [usize; 4] {
    backward_scratch(q, kv).map(|(_, len)| len)
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
/// head_dim stride 1, in `T`, from f32 accumulators kept in the stream's scratch pool
/// (dk and dv none where the device writes them directly:
/// [`BackwardWrites`](super::plan::BackwardWrites)).
pub fn backward_call<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    saved: DeviceSaved<'_, T>,
    grad_out: &DeviceTensor<T>,
    grad_lse: Option<&CudaSlice<f32>>,
    grads: [&mut DeviceTensor<T>; 3],
) -> Result<()> {
    let direct = direct_gradient_plan(dev, block, grad_out, [&*grads[1], &*grads[2]])?;
    let slots = backward_scratch(block.q.shape, block.k.shape);
    let slots = if direct.is_some() { &slots[..2] } else { &slots[..] };
    let mut bufs = Vec::with_capacity(slots.len());
    for &(slot, len) in slots {
        match dev.take_scratch(slot, len) {
            Ok(b) => bufs.push(b),
            Err(e) => {
                slots.iter().zip(bufs).for_each(|(&(slot, _), b)| dev.give_scratch(slot, b));
                return Err(e);
            }
        }
    }
    let done = match (&mut bufs[..], direct) {
        ([delta, dq], Some(plan)) => {
            backward_whole(dev, block, (saved, grad_out, grad_lse), grads, (delta, dq), Writes::Direct(plan))
        }
        ([delta, dq, dk, dv], None) => {
            backward_whole(dev, block, (saved, grad_out, grad_lse), grads, (delta, dq), Writes::Into(dk, dv))
        }
        _ => unreachable!("two scratch slots with a direct plan, four without"),
    };
    slots.iter().zip(bufs).for_each(|(&(slot, _), b)| dev.give_scratch(slot, b));
    done
}

/// [`backward_call`] with the caller's scratch (a framework's allocator): no device
/// allocation at all (dk and dv scratch unused where the device writes them directly).
pub fn backward_call_in<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    saved: DeviceSaved<'_, T>,
    grad_out: &DeviceTensor<T>,
    grad_lse: Option<&CudaSlice<f32>>,
    grads: [&mut DeviceTensor<T>; 3],
    scratch: BackwardScratch<'_>,
) -> Result<()> {
    let (qs, ks) = (block.q.shape, block.k.shape);
    let BackwardScratch { delta, dq: dq_acc, dk: dk_acc, dv: dv_acc } = scratch;
    let names = [TensorName::Other("delta scratch"), TensorName::GradQuery, TensorName::GradKey, TensorName::GradValue];
    let lens = [delta.len(), dq_acc.len(), dk_acc.len(), dv_acc.len()];
    for ((name, got), want) in names.into_iter().zip(lens).zip(backward_scratch_lens(qs, ks)) {
        check_len(name, got, want)?;
    }
    let writes = match direct_gradient_plan(dev, block, grad_out, [&*grads[1], &*grads[2]])? {
        Some(plan) => Writes::Direct(plan),
        None => Writes::Into(dk_acc, dv_acc),
    };
    backward_whole(dev, block, (saved, grad_out, grad_lse), grads, (delta, dq_acc), writes)
}

/// Where a whole call's backward puts dk and dv: f32 accumulators converted after, or the
/// gradients themselves by a [`direct_gradient_plan`].
enum Writes<'a> {
    Into(&'a mut CudaSlice<f32>, &'a mut CudaSlice<f32>),
    Direct(Vec<Planned>),
}

/// The steps of a whole call's backward after its scratch is in hand.
fn backward_whole<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    (saved, grad_out, grad_lse): (DeviceSaved<'_, T>, &DeviceTensor<T>, Option<&CudaSlice<f32>>),
    [dq, dk, dv]: [&mut DeviceTensor<T>; 3],
    (delta, dq_acc): (&mut CudaSlice<f32>, &mut CudaSlice<f32>),
    writes: Writes<'_>,
) -> Result<()> {
    let (qs, ks) = (block.q.shape, block.k.shape);
    expect_shape(TensorName::Output, saved.out, qs)?;
    expect_shape(TensorName::GradOutput, grad_out, qs)?;
    expect_shape(TensorName::GradQuery, dq, qs)?;
    expect_shape(TensorName::GradKey, dk, ks)?;
    expect_shape(TensorName::GradValue, dv, ks)?;
    check_len(TensorName::Lse, saved.lse.len(), qs.lse_len())?;
    delta_into(dev, grad_out, saved.out, grad_lse.map(|g| (g, saved.lse)), delta)?;
    dev.stream.memset_zeros(dq_acc).map_err(cuda_err)?;
    let upstream = DeviceUpstream { grad_out, lse: saved.lse, delta };
    match writes {
        Writes::Into(dk_acc, dv_acc) => {
            for acc in [&mut *dk_acc, &mut *dv_acc] {
                dev.stream.memset_zeros(acc).map_err(cuda_err)?;
            }
            let accs =
                DeviceGradsMut { dq: &mut *dq_acc, dk: &mut *dk_acc, dv: &mut *dv_acc, q_shape: qs, kv_shape: ks };
            backward_block_into(dev, block, &upstream, accs)?;
            store_scaled(dev, TensorName::GradKey, dk_acc, 1.0, dk)?;
            store_scaled(dev, TensorName::GradValue, dv_acc, 1.0, dv)?;
        }
        Writes::Direct(plan) => {
            for g in [&mut *dk, &mut *dv] {
                dev.stream.memset_zeros(&mut g.data).map_err(cuda_err)?;
            }
            backward_block_direct(dev, block, &upstream, &plan, dq_acc, [dk, dv])?;
        }
    }
    store_scaled(dev, TensorName::GradQuery, dq_acc, 1.0, dq)
}
