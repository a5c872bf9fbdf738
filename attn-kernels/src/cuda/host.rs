//! Whole-call dilated attention on the GPU from host views: upload, run the block entry
//! points over the full sequence (one block each for q and k/v), download.

use attn_core::error::TensorName;
use attn_core::{AttnError, AttnShape, DilatedConfig, Result, TensorView, TensorViewMut};

use super::block::{backward_block, forward_block};
use super::device::{CudaDevice, cuda_err};
use super::epilogue::{delta, finish_forward, store_scaled};
use super::tensor::{CudaElement, DeviceGrads, DevicePartial, DeviceTensor};

fn shapes<T: CudaElement>(q: &TensorView<'_, T>, k: &TensorView<'_, T>, v: &TensorView<'_, T>) -> Result<AttnShape> {
    AttnShape::check(&q.shape().dims(), &k.shape().dims(), &v.shape().dims(), true)
}

fn write_rows<T: CudaElement>(dst: &mut TensorViewMut<'_, T>, contiguous: &[T]) {
    let s = dst.shape();
    let d = s.head_dim;
    let mut i = 0;
    for b in 0..s.batch {
        for t in 0..s.seq {
            for h in 0..s.heads {
                dst.row_mut(b, t, h).copy_from_slice(&contiguous[i..i + d]);
                i += d;
            }
        }
    }
}

fn check_out<T: CudaElement>(tensor: TensorName, dst: &TensorViewMut<'_, T>, want: attn_core::Shape4) -> Result<()> {
    if dst.shape() != want {
        return Err(AttnError::ShapeMismatch {
            tensor,
            expected: want.dims().to_vec(),
            got: dst.shape().dims().to_vec(),
        });
    }
    Ok(())
}

/// Dilated attention forward: writes `out` and returns the LSE `[batch, seq, heads]` (f32).
/// k/v may have their own sequence length (cross-attention: positions start at 0 for both).
pub fn forward<T: CudaElement>(
    dev: &CudaDevice,
    cfg: &DilatedConfig,
    q: &TensorView<'_, T>,
    k: &TensorView<'_, T>,
    v: &TensorView<'_, T>,
    out: &mut TensorViewMut<'_, T>,
) -> Result<Vec<f32>> {
    let shape = shapes(q, k, v)?;
    cfg.validate_heads(shape.q.heads)?;
    check_out(TensorName::Output, out, shape.q)?;
    let (dq, dk, dv) =
        (DeviceTensor::from_view(dev, q)?, DeviceTensor::from_view(dev, k)?, DeviceTensor::from_view(dev, v)?);
    let mut partial = DevicePartial::empty(dev, shape.q)?;
    forward_block(dev, cfg, &dq, 0, &dk, &dv, 0, &mut partial)?;
    let mut dout = DeviceTensor::<T>::zeros(dev, shape.q)?;
    let lse = finish_forward(dev, cfg, &partial, &mut dout)?;
    let lse = dev.stream.clone_dtoh(lse).map_err(cuda_err)?;
    dev.synchronize()?;
    write_rows(out, &dout.to_host_contiguous(dev)?);
    Ok(lse)
}

/// Dilated attention backward: gradients of `sum(out * grad_out)` given the forward's
/// `out` and `lse`; writes `dq`, `dk`, `dv` in `T` (accumulated in f32).
#[allow(clippy::too_many_arguments)]
pub fn backward<T: CudaElement>(
    dev: &CudaDevice,
    cfg: &DilatedConfig,
    q: &TensorView<'_, T>,
    k: &TensorView<'_, T>,
    v: &TensorView<'_, T>,
    out: &TensorView<'_, T>,
    lse: &[f32],
    grad_out: &TensorView<'_, T>,
    dq: &mut TensorViewMut<'_, T>,
    dk: &mut TensorViewMut<'_, T>,
    dv: &mut TensorViewMut<'_, T>,
) -> Result<()> {
    let shape = shapes(q, k, v)?;
    cfg.validate_heads(shape.q.heads)?;
    for (t, s) in [(TensorName::Output, out.shape()), (TensorName::GradOutput, grad_out.shape())] {
        if s != shape.q {
            return Err(AttnError::ShapeMismatch {
                tensor: t,
                expected: shape.q.dims().to_vec(),
                got: s.dims().to_vec(),
            });
        }
    }
    if lse.len() != shape.q.lse_len() {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::Lse,
            expected: vec![shape.q.lse_len()],
            got: vec![lse.len()],
        });
    }
    check_out(TensorName::GradQuery, dq, shape.q)?;
    check_out(TensorName::GradKey, dk, shape.kv)?;
    check_out(TensorName::GradValue, dv, shape.kv)?;
    let up = |x: &TensorView<'_, T>| DeviceTensor::from_view(dev, x);
    let (tq, tk, tv, tout, tgo) = (up(q)?, up(k)?, up(v)?, up(out)?, up(grad_out)?);
    let dlse = dev.stream.clone_htod(lse).map_err(cuda_err)?;
    let ddelta = delta(dev, &tgo, &tout)?;
    let mut grads = DeviceGrads::zeros(dev, shape.q, shape.kv)?;
    backward_block(dev, cfg, &tq, 0, &tk, &tv, 0, &tgo, &dlse, &ddelta, &mut grads)?;
    store_grad(dev, &grads.dq, dq, TensorName::GradQuery)?;
    store_grad(dev, &grads.dk, dk, TensorName::GradKey)?;
    store_grad(dev, &grads.dv, dv, TensorName::GradValue)?;
    Ok(())
}

fn store_grad<T: CudaElement>(
    dev: &CudaDevice,
    acc: &cudarc::driver::CudaSlice<f32>,
    dst: &mut TensorViewMut<'_, T>,
    name: TensorName,
) -> Result<()> {
    let mut t = DeviceTensor::<T>::zeros(dev, dst.shape())?;
    store_scaled(dev, name, acc, 1.0, &mut t)?;
    write_rows(dst, &t.to_host_contiguous(dev)?);
    Ok(())
}

/// [`forward`] on contiguous buffers: returns `(out, lse)`.
pub fn forward_vec<T: CudaElement>(
    dev: &CudaDevice,
    cfg: &DilatedConfig,
    shape: AttnShape,
    q: &[T],
    k: &[T],
    v: &[T],
) -> Result<(Vec<T>, Vec<f32>)> {
    let qv = TensorView::contiguous(TensorName::Query, q, shape.q)?;
    let kv = TensorView::contiguous(TensorName::Key, k, shape.kv)?;
    let vv = TensorView::contiguous(TensorName::Value, v, shape.kv)?;
    let mut out = vec![T::default(); shape.q.numel()];
    let lse = forward(dev, cfg, &qv, &kv, &vv, &mut TensorViewMut::contiguous(TensorName::Output, &mut out, shape.q)?)?;
    Ok((out, lse))
}

/// Forward then [`backward`] on contiguous buffers: returns `(dq, dk, dv)`.
pub fn backward_vec<T: CudaElement>(
    dev: &CudaDevice,
    cfg: &DilatedConfig,
    shape: AttnShape,
    [q, k, v]: [&[T]; 3],
    grad_out: &[T],
) -> Result<[Vec<T>; 3]> {
    let (out, lse) = forward_vec(dev, cfg, shape, q, k, v)?;
    let qv = TensorView::contiguous(TensorName::Query, q, shape.q)?;
    let kv = TensorView::contiguous(TensorName::Key, k, shape.kv)?;
    let vv = TensorView::contiguous(TensorName::Value, v, shape.kv)?;
    let ov = TensorView::contiguous(TensorName::Output, &out, shape.q)?;
    let gv = TensorView::contiguous(TensorName::GradOutput, grad_out, shape.q)?;
    let mut dq = vec![T::default(); shape.q.numel()];
    let mut dk = vec![T::default(); shape.kv.numel()];
    let mut dv = vec![T::default(); shape.kv.numel()];
    backward(
        dev,
        cfg,
        &qv,
        &kv,
        &vv,
        &ov,
        &lse,
        &gv,
        &mut TensorViewMut::contiguous(TensorName::GradQuery, &mut dq, shape.q)?,
        &mut TensorViewMut::contiguous(TensorName::GradKey, &mut dk, shape.kv)?,
        &mut TensorViewMut::contiguous(TensorName::GradValue, &mut dv, shape.kv)?,
    )?;
    Ok([dq, dk, dv])
}
