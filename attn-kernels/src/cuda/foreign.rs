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

use super::device::CudaDevice;
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

/// `len` elements of `T` at device address `addr`, owned elsewhere.
///
/// # Safety
/// `addr` must address at least `len` elements of `T` in memory of `dev`'s context that
/// stays allocated while the handle lives, and nothing else may write it meanwhile except
/// through work ordered on `dev`'s stream.
pub unsafe fn foreign_slice<T>(dev: &CudaDevice, addr: u64, len: usize) -> Foreign<CudaSlice<T>> {
    // SAFETY: the caller guarantees the allocation (see above); `Foreign` never frees it.
    Foreign(ManuallyDrop::new(unsafe { dev.stream.upgrade_device_ptr::<T>(addr, len) }))
}

/// A strided `[batch, seq, heads, head_dim]` tensor at device address `addr` holding `len`
/// elements, owned elsewhere. The strides must reach no element past `len`.
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
    let data = unsafe { foreign_slice::<T>(dev, addr, len) }.into_inner();
    Ok(Foreign(ManuallyDrop::new(DeviceTensor { data, shape, strides })))
}

/// A contiguous `[batch, seq]` key padding mask of bytes (non-zero = padding) at device
/// address `addr`, owned elsewhere.
///
/// # Safety
/// As [`foreign_slice`], for `batch * seq` bytes.
pub unsafe fn foreign_key_padding(dev: &CudaDevice, addr: u64, batch: usize, seq: usize) -> Foreign<DeviceKeyPadding> {
    let len = batch.saturating_mul(seq);
    // SAFETY: as this function's contract; the flags are forgotten with the mask.
    let flags = unsafe { foreign_slice::<u8>(dev, addr, len) }.into_inner();
    Foreign(ManuallyDrop::new(DeviceKeyPadding { flags, batch, seq }))
}
