//! Tensors on a CUDA device (feature `cuda`): the op's forward and exact backward run the
//! workspace's CUDA kernels on candle's device memory, queued on candle's stream of that
//! device, so nothing passes through the host and the work is ordered with candle's own.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use attn_core::{AttnError, AttnShape, Masks, PackedSequences, Shape4, TensorName};
use attn_kernels::cuda::{
    CudaDevice as Kernels, CudaElement, DeviceBlock, DeviceBlockMask, DeviceKeyPadding, DeviceSaved,
};
use attn_kernels::cuda::{DeviceTensor, Foreign, backward_call, foreign_tensor, forward_call_into};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaDType;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, SyncOnDrop};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Layout, Shape, Storage, Tensor};

use crate::error::{fail, to_candle};
use crate::host::layout_parts;
use crate::options::AttnOptions;

/// An element type of both the CUDA kernels and candle's CUDA storage (f32, bf16, f16).
pub trait DeviceElement: CudaElement + CudaDType {}

impl<T: CudaElement + CudaDType> DeviceElement for T {}

/// The kernels on candle's device `dev`, launching on candle's stream. A device is opened
/// (driver, NVRTC and device checks; kernel choices read from the environment) once per
/// ordinal.
fn kernels_on(dev: &CudaDevice) -> attn_core::Result<Kernels> {
    static OPENED: OnceLock<Mutex<HashMap<usize, Kernels>>> = OnceLock::new();
    let stream = dev.cuda_stream();
    let ordinal = stream.context().ordinal();
    let mut opened = OPENED
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| AttnError::InvalidArgument("the CUDA device cache is poisoned".into()))?;
    let kernels = match opened.get(&ordinal) {
        Some(k) => k.clone(),
        None => {
            let k = Kernels::new(ordinal)?;
            opened.insert(ordinal, k.clone());
            k
        }
    };
    kernels.with_stream(stream)
}

/// The storage of a CUDA tensor, or an error naming the tensor that is elsewhere.
fn cuda_storage(name: TensorName, storage: &Storage) -> candle_core::Result<&CudaStorage> {
    match storage {
        Storage::Cuda(c) => Ok(c),
        _ => fail(AttnError::InvalidArgument(format!("{name} is not on the CUDA device of the other inputs"))),
    }
}

/// Candle's memory of one rank-4 input as a foreign tensor on `kernels` (never copied or
/// freed here), with the guard that records candle's read when the call is done.
fn input<'a, T: DeviceElement>(
    kernels: &Kernels,
    stream: &'a CudaStream,
    name: TensorName,
    storage: &'a CudaStorage,
    layout: &Layout,
) -> candle_core::Result<(Foreign<DeviceTensor<T>>, SyncOnDrop<'a>)> {
    let slice = storage.as_cuda_slice::<T>()?;
    let (shape, strides, start) = layout_parts(name, layout).map_err(to_candle)?;
    let len = slice
        .len()
        .checked_sub(start)
        .ok_or_else(|| to_candle(AttnError::BufferTooSmall { tensor: name, len: slice.len(), needed: start }))?;
    let (base, guard) = slice.device_ptr(stream);
    let addr = base + (start * std::mem::size_of::<T>()) as u64;
    // SAFETY: `addr` is `start` elements into candle's live allocation of `slice.len()`
    // elements, and `foreign_tensor` checks that the strides stay inside the `len` that
    // remain and that the span is this device's memory. Candle's storage lock is held by
    // the caller for the whole call, and the kernels run on candle's own stream.
    let tensor = unsafe { foreign_tensor(kernels, name, (addr, len), shape, strides) }.map_err(to_candle)?;
    Ok((tensor, guard))
}

/// A call's shapes and its masks on the device.
struct CallMasks<'a> {
    shape: AttnShape,
    key_padding: Option<DeviceKeyPadding>,
    packing: Option<PackedSequences<'a>>,
    /// Read by the row kernels (the launch plan routes masked blocks to them).
    block: Option<DeviceBlockMask>,
}

impl CallMasks<'_> {
    /// A block of the call on q and k, v (at position 0) under these masks.
    fn block<'b, T: CudaElement>(
        &'b self,
        options: &'b AttnOptions,
        q: &'b DeviceTensor<T>,
        (k, v): (&'b DeviceTensor<T>, &'b DeviceTensor<T>),
    ) -> DeviceBlock<'b, T> {
        DeviceBlock {
            key_padding: self.key_padding.as_ref(),
            packing: self.packing,
            block_mask: self.block.as_ref(),
            ..DeviceBlock::new(&options.config, (q, 0), (k, v, 0))
        }
    }
}

/// The shapes of q, k, v checked against the config, and the masks against the shapes:
/// the key padding mask and the block mask uploaded, and the packed sequences.
fn checked_masks<'a>(
    kernels: &Kernels,
    options: &'a AttnOptions,
    dims: [&[usize]; 3],
) -> attn_core::Result<CallMasks<'a>> {
    let shape = AttnShape::of_call(&options.config, dims)?;
    let masks = options.masks();
    Masks::check_sizes(masks.key_padding.map(|m| (m.batch(), m.seq())), masks.packing, &shape)?;
    if let Some(b) = masks.block {
        b.check(&shape, masks.packing)?;
    }
    let key_padding = masks.key_padding.map(|m| DeviceKeyPadding::upload(kernels, &m)).transpose()?;
    let block = masks.block.map(|m| DeviceBlockMask::upload(kernels, &m)).transpose()?;
    Ok(CallMasks { shape, key_padding, packing: masks.packing, block })
}

/// A new contiguous tensor on `dev` holding `t`'s memory.
fn tensor_of<T: DeviceElement>(t: DeviceTensor<T>, dev: &CudaDevice, shape: Shape4) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(t.data, dev.clone()));
    Tensor::from_storage(storage, shape.dims().to_vec(), BackpropOp::none(), false)
}

/// The forward on CUDA storage: the output storage and shape, and the LSE as a detached
/// `[batch, seq, heads]` f32 tensor on the same device.
pub(crate) fn forward<T: DeviceElement>(
    options: &AttnOptions,
    [s1, s2, s3]: [&CudaStorage; 3],
    [l1, l2, l3]: [&Layout; 3],
) -> candle_core::Result<(CudaStorage, Shape, Tensor)> {
    let dev = s1.device();
    let kernels = kernels_on(dev).map_err(to_candle)?;
    let stream = kernels.stream().clone();
    let masks = checked_masks(&kernels, options, [l1.dims(), l2.dims(), l3.dims()]).map_err(to_candle)?;
    let shape = masks.shape;
    let (q, _q_read) = input::<T>(&kernels, &stream, TensorName::Query, s1, l1)?;
    let (k, _k_read) = input::<T>(&kernels, &stream, TensorName::Key, s2, l2)?;
    let (v, _v_read) = input::<T>(&kernels, &stream, TensorName::Value, s3, l3)?;
    let block = masks.block(options, &q, (&k, &v));
    let mut out = DeviceTensor::<T>::zeros(&kernels, shape.q).map_err(to_candle)?;
    let mut lse = stream.alloc_zeros::<f32>(shape.q.lse_len()).map_err(|e| to_candle(AttnError::backend("cuda", e)))?;
    forward_call_into(&kernels, &block, &mut out, &mut lse).map_err(to_candle)?;
    let [b, s, h, _] = shape.q.dims();
    let lse = Storage::Cuda(CudaStorage::wrap_cuda_slice(lse, dev.clone()));
    let lse = Tensor::from_storage(lse, (b, s, h), BackpropOp::none(), false);
    Ok((CudaStorage::wrap_cuda_slice(out.data, dev.clone()), Shape::from_dims(&shape.q.dims()), lse))
}

/// The gradients of `sum(out * grad) + sum(lse * grad_lse)` with respect to q, k, v,
/// from the forward's `out` and `lse`, all on one CUDA device (`lses` is `(lse,
/// grad_lse)`, the second contiguous where given); `grad` must have a unit head_dim
/// stride.
pub(crate) fn backward<T: DeviceElement>(
    options: &AttnOptions,
    qkv: [&Tensor; 3],
    out: &Tensor,
    grad: &Tensor,
    (lse, grad_lse): (&Tensor, Option<&Tensor>),
) -> candle_core::Result<[Tensor; 3]> {
    let [q, k, v] = qkv;
    let names = [TensorName::Query, TensorName::Key, TensorName::Value, TensorName::Output, TensorName::GradOutput];
    let locked = [q, k, v, out, grad].map(|t| t.storage_and_layout());
    let (lse_storage, lse_layout) = lse.storage_and_layout();
    let storages = [0, 1, 2, 3, 4].map(|i| cuda_storage(names[i], &locked[i].0));
    let [sq, sk, sv, so, sg] = storages;
    let (sq, sk, sv, so, sg) = (sq?, sk?, sv?, so?, sg?);
    let dev = sq.device();
    let kernels = kernels_on(dev).map_err(to_candle)?;
    let stream = kernels.stream().clone();
    let masks = checked_masks(&kernels, options, [q.dims(), k.dims(), v.dims()]).map_err(to_candle)?;
    let shape = masks.shape;
    let lse_slice = cuda_storage(TensorName::Lse, &lse_storage)?.as_cuda_slice::<f32>()?;
    if !lse_layout.is_contiguous() || lse_layout.start_offset() != 0 || lse_slice.len() != shape.q.lse_len() {
        return fail(AttnError::InvalidArgument("the kept LSE is not the forward's contiguous tensor".into()));
    }
    let grad_lse_locked = grad_lse.map(Tensor::storage_and_layout);
    let grad_lse_slice = match &grad_lse_locked {
        Some((storage, layout)) => {
            let slice = cuda_storage(TensorName::GradLse, storage)?.as_cuda_slice::<f32>()?;
            if slice.len() != shape.q.lse_len() {
                let (expected, got) = (vec![shape.q.lse_len()], vec![slice.len()]);
                return fail(AttnError::ShapeMismatch { tensor: TensorName::GradLse, expected, got });
            }
            if !layout.is_contiguous() || layout.start_offset() != 0 {
                return fail(AttnError::InvalidArgument("the LSE's gradient is not one contiguous tensor".into()));
            }
            Some(slice)
        }
        None => None,
    };
    let (fq, _q_read) = input::<T>(&kernels, &stream, names[0], sq, locked[0].1)?;
    let (fk, _k_read) = input::<T>(&kernels, &stream, names[1], sk, locked[1].1)?;
    let (fv, _v_read) = input::<T>(&kernels, &stream, names[2], sv, locked[2].1)?;
    let (fo, _o_read) = input::<T>(&kernels, &stream, names[3], so, locked[3].1)?;
    let (fg, _g_read) = input::<T>(&kernels, &stream, names[4], sg, locked[4].1)?;
    let block = masks.block(options, &fq, (&fk, &fv));
    let zeros = |s: Shape4| DeviceTensor::<T>::zeros(&kernels, s).map_err(to_candle);
    let (mut dq, mut dk, mut dv) = (zeros(shape.q)?, zeros(shape.kv)?, zeros(shape.kv)?);
    let saved = DeviceSaved { out: &fo, lse: lse_slice };
    backward_call(&kernels, &block, saved, &fg, grad_lse_slice, [&mut dq, &mut dk, &mut dv]).map_err(to_candle)?;
    Ok([tensor_of(dq, dev, shape.q), tensor_of(dk, dev, shape.kv), tensor_of(dv, dev, shape.kv)])
}
