//! Device memory and streams that another library owns (a PyTorch tensor, its current
//! stream): cudarc handles over them for the length of one call, never freed or destroyed
//! here, so the kernels read and write a framework's tensors in place, ordered on its
//! stream.
#![allow(unsafe_code)]

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};

use attn_core::error::TensorName;
use attn_core::{AttnError, Result, Shape4};
use cudarc::driver::CudaSlice;
use cudarc::driver::sys::{CUpointer_attribute, CUresult, cuPointerGetAttribute};

use super::device::{CudaDevice, cuda_err};
use super::tensor::{CudaElement, DeviceKeyPadding, DeviceTensor, extent};

/// A raw CUDA stream handle (`CUstream`), as a framework hands it over.
pub type RawStream = cudarc::driver::sys::CUstream;

/// A handle whose device memory belongs to someone else: dropping it forgets the memory.
pub trait Forget {
    /// Give up the handle without freeing its memory.
    fn forget(self);
}

impl<T> Forget for CudaSlice<T> {
    fn forget(self) {
        // `leak` waits for the slice's pending work where cudarc tracks it, then hands
        // the address back without freeing it.
        let _ = self.leak();
    }
}

impl<T> Forget for DeviceTensor<T> {
    fn forget(self) {
        self.data.forget();
    }
}

impl Forget for DeviceKeyPadding {
    fn forget(self) {
        self.flags.forget();
    }
}

/// A cudarc handle over memory another library owns, used like the handle itself;
/// dropping it forgets the memory instead of freeing it.
#[derive(Debug)]
pub struct Foreign<H: Forget>(ManuallyDrop<H>);

impl<H: Forget> Foreign<H> {
    /// The handle itself, to be moved into a larger handle that forgets it in turn.
    fn into_inner(self) -> H {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so the value is taken exactly once.
        unsafe { ManuallyDrop::take(&mut this.0) }
    }
}

impl<H: Forget> Deref for Foreign<H> {
    type Target = H;
    fn deref(&self) -> &H {
        &self.0
    }
}

impl<H: Forget> DerefMut for Foreign<H> {
    fn deref_mut(&mut self) -> &mut H {
        &mut self.0
    }
}

impl<H: Forget> Drop for Foreign<H> {
    fn drop(&mut self) {
        // SAFETY: `drop` runs once and nothing reads the value after it.
        unsafe { ManuallyDrop::take(&mut self.0) }.forget();
    }
}

impl CudaDevice {
    /// The same device with its launches, copies and scratch allocations queued on
    /// `stream`, a stream another library created (0: the legacy default stream), so the
    /// kernels are ordered after that library's earlier work and before its later work.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context that outlives the
    /// returned handle and everything made from it.
    pub unsafe fn with_foreign_stream(&self, stream: RawStream) -> Self {
        // SAFETY: the caller guarantees the stream belongs to this context and outlives the
        // handle; the wrapper never destroys it.
        let stream = unsafe { self.ctx.wrap_borrowed_stream(stream) };
        let mut dev = self.clone();
        dev.stream = stream;
        dev
    }
}

/// Check that the first and the last of the `bytes` at `addr` are memory of `dev`'s
/// device as the driver records it: a host address, another device's memory or a span
/// ending outside any allocation is a typed error naming `tensor`, not a fault inside a
/// kernel. (Only the ends are asked: allocators such as PyTorch's expandable segments map
/// one tensor over several allocations.)
pub fn check_device_span(dev: &CudaDevice, tensor: TensorName, addr: u64, bytes: usize) -> Result<()> {
    dev.ctx.bind_to_thread().map_err(cuda_err)?;
    let not_here = |why: String| {
        AttnError::InvalidArgument(format!(
            "{tensor}: {bytes} bytes at {addr:#x} are not memory of CUDA device {}: {why}",
            dev.ctx.ordinal()
        ))
    };
    let last =
        addr.checked_add((bytes as u64).saturating_sub(1)).ok_or_else(|| not_here("the span overflows".into()))?;
    for (end, at) in [("first", addr), ("last", last)] {
        let ordinal = pointer_attribute::<i32>(CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, at)
            .map_err(|e| not_here(format!("the driver does not know its {end} byte ({e:?})")))?;
        if usize::try_from(ordinal).ok() != Some(dev.ctx.ordinal()) {
            return Err(not_here(format!("its {end} byte is on device {ordinal}")));
        }
    }
    Ok(())
}

/// One attribute of the allocation holding `addr`.
fn pointer_attribute<V: Default>(attr: CUpointer_attribute, addr: u64) -> std::result::Result<V, CUresult> {
    let mut value = V::default();
    // SAFETY: `value` is a live, writable `V`, the type the driver writes for the
    // attribute asked for (an int for the device ordinal).
    let rc = unsafe { cuPointerGetAttribute((&mut value as *mut V).cast(), attr, addr) };
    if rc == CUresult::CUDA_SUCCESS { Ok(value) } else { Err(rc) }
}

/// `len` elements of `T` at device address `addr`, owned elsewhere (named `tensor` in
/// errors); [`check_device_span`] first.
///
/// # Safety
/// The memory must stay allocated while the handle lives, and nothing else may write it
/// meanwhile except through work ordered on `dev`'s stream.
pub unsafe fn foreign_slice<T>(
    dev: &CudaDevice,
    tensor: TensorName,
    addr: u64,
    len: usize,
) -> Result<Foreign<CudaSlice<T>>> {
    let bytes =
        len.checked_mul(std::mem::size_of::<T>()).ok_or(AttnError::ShapeOverflow { tensor, dims: vec![len] })?;
    check_device_span(dev, tensor, addr, bytes)?;
    // SAFETY: the span starts and ends in this device's memory (checked above), which the
    // caller keeps allocated; `Foreign` never frees it.
    Ok(Foreign(ManuallyDrop::new(unsafe { dev.stream.upgrade_device_ptr::<T>(addr, len) })))
}

/// A strided `[batch, seq, heads, head_dim]` tensor at device address `addr` holding `len`
/// elements, owned elsewhere. The strides must reach no element past `len`, and the span
/// must be this device's memory ([`check_device_span`]).
///
/// # Safety
/// As [`foreign_slice`].
pub unsafe fn foreign_tensor<T: CudaElement>(
    dev: &CudaDevice,
    tensor: TensorName,
    (addr, len): (u64, usize),
    shape: Shape4,
    strides: [usize; 4],
) -> Result<Foreign<DeviceTensor<T>>> {
    let needed = extent(shape, strides);
    if needed > len {
        return Err(AttnError::BufferTooSmall { tensor, len, needed });
    }
    // SAFETY: as this function's contract; the slice is forgotten with the tensor.
    let data = unsafe { foreign_slice::<T>(dev, tensor, addr, len) }?.into_inner();
    Ok(Foreign(ManuallyDrop::new(DeviceTensor { data, shape, strides })))
}

/// A contiguous `[batch, seq]` key padding mask of bytes (non-zero = padding) at device
/// address `addr`, owned elsewhere ([`check_device_span`] first).
///
/// # Safety
/// As [`foreign_slice`].
pub unsafe fn foreign_key_padding(
    dev: &CudaDevice,
    addr: u64,
    batch: usize,
    seq: usize,
) -> Result<Foreign<DeviceKeyPadding>> {
    let tensor = TensorName::KeyPaddingMask;
    let len = batch.checked_mul(seq).ok_or(AttnError::ShapeOverflow { tensor, dims: vec![batch, seq] })?;
    // SAFETY: as this function's contract; the flags are forgotten with the mask.
    let flags = unsafe { foreign_slice::<u8>(dev, tensor, addr, len) }?.into_inner();
    Ok(Foreign(ManuallyDrop::new(DeviceKeyPadding { flags, batch, seq })))
}
