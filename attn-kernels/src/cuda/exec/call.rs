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
    CallAccs, DeviceBlock, DeviceUpstream, backward_block_direct, backward_block_into, check_contiguous_out,
    direct_gradient_plan, forward_block_into, forward_direct_into,
};
use super::device::{CudaDevice, cuda_err};
use super::epilogue::{delta_into, store_scaled};
use super::scratch::{ScratchSlot, backward_scratch, backward_slots};
use super::tensor::fill_into;
use super::tensor::{CudaElement, DeviceGradsMut, DeviceTensor, check_len};
use crate::cuda::plan::launch_plan::{DirectBackward, DirectGrads};
use crate::cuda::plan::patterns::out_scale;

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
/// (none for the gradients the device writes directly:
/// [`BackwardWrites`](crate::cuda::plan::patterns::BackwardWrites)).
pub fn backward_call<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    saved: DeviceSaved<'_, T>,
    grad_out: &DeviceTensor<T>,
    grad_lse: Option<&CudaSlice<f32>>,
    grads: [&mut DeviceTensor<T>; 3],
) -> Result<()> {
    let direct = direct_gradient_plan(dev, block, grad_out, [&*grads[0], &*grads[1], &*grads[2]])?;
    let slots = backward_slots(block.q.shape, block.k.shape, direct.as_ref().map(|d| d.grads));
    let mut bufs: [Option<CudaSlice<f32>>; 4] = Default::default();
    for (buf, slot) in bufs.iter_mut().zip(slots) {
        // A failed take drops what was taken: the next call allocates it again.
        *buf = slot.map(|(slot, len)| dev.take_scratch(slot, len)).transpose()?;
    }
    let [delta, dq, dk, dv] = &mut bufs;
    let done = match delta {
        Some(delta) => {
            let accs = CallAccs { dq: dq.as_mut(), dkv: dk.as_mut().zip(dv.as_mut()) };
            backward_whole(dev, block, (saved, grad_out, grad_lse), grads, delta, accs, direct.as_ref())
        }
        None => Err(AttnError::InvalidArgument("a whole-call backward takes a delta scratch".into())),
    };
    for (buf, slot) in bufs.into_iter().zip(slots) {
        if let (Some(buf), Some((slot, _))) = (buf, slot) {
            dev.give_scratch(slot, buf);
        }
    }
    done
}

/// [`backward_call`] with the caller's scratch (a framework's allocator): no device
/// allocation at all (the accumulators of directly written gradients unused).
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
    let direct = direct_gradient_plan(dev, block, grad_out, [&*grads[0], &*grads[1], &*grads[2]])?;
    let writes = direct.as_ref().map(|d| d.grads);
    let accs = CallAccs {
        dq: (!writes.is_some_and(DirectGrads::dq)).then_some(dq_acc),
        dkv: (!writes.is_some_and(DirectGrads::dkv)).then_some((dk_acc, dv_acc)),
    };
    backward_whole(dev, block, (saved, grad_out, grad_lse), grads, delta, accs, direct.as_ref())
}

/// The steps of a whole call's backward after its scratch is in hand: `accs` holds an
/// accumulator for each gradient `direct` does not write (all of them without a plan).
fn backward_whole<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    (saved, grad_out, grad_lse): (DeviceSaved<'_, T>, &DeviceTensor<T>, Option<&CudaSlice<f32>>),
    [dq, dk, dv]: [&mut DeviceTensor<T>; 3],
    delta: &mut CudaSlice<f32>,
    mut accs: CallAccs<'_>,
    direct: Option<&DirectBackward>,
) -> Result<()> {
    let (qs, ks) = (block.q.shape, block.k.shape);
    expect_shape(TensorName::Output, saved.out, qs)?;
    expect_shape(TensorName::GradOutput, grad_out, qs)?;
    expect_shape(TensorName::GradQuery, dq, qs)?;
    expect_shape(TensorName::GradKey, dk, ks)?;
    expect_shape(TensorName::GradValue, dv, ks)?;
    check_len(TensorName::Lse, saved.lse.len(), qs.lse_len())?;
    delta_into(dev, grad_out, saved.out, grad_lse.map(|g| (g, saved.lse)), delta)?;
    let upstream = DeviceUpstream { grad_out, lse: saved.lse, delta };
    // Every accumulator and every directly written gradient starts from zero (rows no
    // pattern selects, and padded keys, keep it).
    if let Some(acc) = accs.dq.as_deref_mut() {
        dev.stream.memset_zeros(acc).map_err(cuda_err)?;
    }
    if let Some((dk_acc, dv_acc)) = accs.dkv.as_mut() {
        dev.stream.memset_zeros(&mut **dk_acc).map_err(cuda_err)?;
        dev.stream.memset_zeros(&mut **dv_acc).map_err(cuda_err)?;
    }
    match direct {
        Some(plan) => {
            let written = [(plan.grads.dq(), &mut *dq), (plan.grads.dkv(), &mut *dk), (plan.grads.dkv(), &mut *dv)];
            for (_, g) in written.into_iter().filter(|(direct, _)| *direct) {
                dev.stream.memset_zeros(&mut g.data).map_err(cuda_err)?;
            }
            let reborrowed =
                CallAccs { dq: accs.dq.as_deref_mut(), dkv: accs.dkv.as_mut().map(|(k, v)| (&mut **k, &mut **v)) };
            backward_block_direct(dev, block, &upstream, plan, reborrowed, [&mut *dq, &mut *dk, &mut *dv])?;
        }
        None => {
            let (Some(dq_acc), Some((dk_acc, dv_acc))) = (accs.dq.as_deref_mut(), accs.dkv.as_mut()) else {
                return Err(AttnError::InvalidArgument(
                    "a backward without a direct plan takes every accumulator".into(),
                ));
            };
            let grads = DeviceGradsMut { dq: dq_acc, dk: dk_acc, dv: dv_acc, q_shape: qs, kv_shape: ks };
            backward_block_into(dev, block, &upstream, grads)?;
        }
    }
    if let Some(acc) = accs.dq {
        store_scaled(dev, TensorName::GradQuery, acc, 1.0, dq)?;
    }
    if let Some((dk_acc, dv_acc)) = accs.dkv {
        store_scaled(dev, TensorName::GradKey, dk_acc, 1.0, dk)?;
        store_scaled(dev, TensorName::GradValue, dv_acc, 1.0, dv)?;
    }
    Ok(())
}
