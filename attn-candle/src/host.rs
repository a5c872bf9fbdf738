//! The element types the op computes (f32, bf16, f16) and strided views of candle's
//! host storage: a `[batch, seq, heads, head_dim]` layout with unit inner stride
//! (contiguous BSHD, a transposed BHSD tensor, a slice of a fused projection) is read
//! in place, never copied.

use attn_core::{Attention, AttnError, Element, Feature, Shape4, TensorName, TensorView};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Storage, Tensor, WithDType};
use half::{bf16, f16};

use crate::error::{fail, to_candle};

/// A backend computing every dtype the op accepts: the CPU kernels, a ring rank, the
/// reference.
pub trait AnyAttention: Attention<f32> + Attention<bf16> + Attention<f16> {}

impl<B: Attention<f32> + Attention<bf16> + Attention<f16>> AnyAttention for B {}

/// An element type of both the kernels and candle.
pub trait HostElement: Element + WithDType {
    /// `backend` computing in this type.
    fn backend(backend: &dyn AnyAttention) -> &dyn Attention<Self>;
}

impl HostElement for f32 {
    fn backend(backend: &dyn AnyAttention) -> &dyn Attention<f32> {
        backend
    }
}

impl HostElement for bf16 {
    fn backend(backend: &dyn AnyAttention) -> &dyn Attention<bf16> {
        backend
    }
}

impl HostElement for f16 {
    fn backend(backend: &dyn AnyAttention) -> &dyn Attention<f16> {
        backend
    }
}

/// The shape, strides and start offset (in elements) of a rank-4 tensor under `layout`.
/// A dimension of size 1 may carry any stride (candle leaves them arbitrary), so its
/// stride is taken as 1.
pub(crate) fn layout_parts(name: TensorName, layout: &Layout) -> attn_core::Result<(Shape4, [usize; 4], usize)> {
    let shape = Shape4::from_dims(name, layout.dims())?;
    let s = layout.stride();
    let mut strides = [s[0], s[1], s[2], s[3]];
    for (st, &d) in strides.iter_mut().zip(&shape.dims()) {
        if d == 1 {
            *st = 1;
        }
    }
    Ok((shape, strides, layout.start_offset()))
}

/// The view of a rank-4 tensor stored in `data` under `layout`.
pub fn view_of<'a, T: Element>(
    name: TensorName,
    data: &'a [T],
    layout: &Layout,
) -> attn_core::Result<TensorView<'a, T>> {
    let (shape, strides, start) = layout_parts(name, layout)?;
    let data = data.get(start..).ok_or(AttnError::BufferTooSmall { tensor: name, len: data.len(), needed: start })?;
    TensorView::strided(name, data, shape, strides)
}

/// The host slice of `storage` as `T`, or a dtype error naming `name`.
pub fn slice_of<T: HostElement>(name: TensorName, storage: &CpuStorage) -> candle_core::Result<&[T]> {
    match T::cpu_storage_as_slice(storage) {
        Ok(s) => Ok(s),
        Err(_) => fail(AttnError::DTypeMismatch {
            tensor: name,
            expected: <T as Element>::DTYPE.as_str(),
            got: format!("{:?}", storage.dtype()).to_lowercase(),
        }),
    }
}

/// Runs `f` on the host view of `t` (read in place under candle's storage lock).
pub fn with_view<T: HostElement, R>(
    name: TensorName,
    t: &Tensor,
    f: impl FnOnce(TensorView<'_, T>) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => f(view_of(name, slice_of::<T>(name, cpu)?, layout).map_err(to_candle)?),
        _ => {
            crate::error::check_device(t.device(), crate::error::OnCuda::Refuse)?;
            fail(AttnError::Unsupported { backend: "candle", feature: Feature::Other("tensors off the host") })
        }
    }
}

/// `t` itself when its head_dim stride is 1 (or head_dim is 1), else a contiguous copy:
/// the kernels read rows of head_dim consecutive elements.
pub fn unit_inner(t: &Tensor) -> candle_core::Result<Tensor> {
    let inner_ok = t.dims().last().is_none_or(|&d| d <= 1) || t.stride().last() == Some(&1);
    if inner_ok { Ok(t.clone()) } else { t.contiguous() }
}
