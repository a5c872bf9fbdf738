//! [`CudaBackend`]: whole-call dilated attention on the GPU from host views behind the
//! shared [`Attention`] interface: upload, run the block entry points over the full
//! sequence (one block each for q and k/v), download. Every feature is computed: grouped
//! k/v heads, a key padding mask (uploaded as u8 flags), packed sequences (per-sequence
//! launches), sliding windows (the config's band) and block masks (uploaded as they are).

use attn_core::error::TensorName;
use attn_core::{Attention, AttnInputs, Grads, Masks, Pass, Saved, Supported};
use attn_core::{AttnError, AttnShape, DilatedConfig, Result, TensorView, TensorViewMut};

use super::block::DeviceBlock;
use super::call::{DeviceSaved, backward_call};
use super::call::{ForwardPath, forward_call};
use super::device::{CudaDevice, cuda_err};
use super::tensor::{CudaElement, DeviceBlockMask, DeviceKeyPadding, DeviceTensor};
use crate::cuda::plan::launch_plan::writes_direct;
use crate::cuda::plan::patterns::forward_kernel;

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

/// The GPU behind the shared interface: one device, kernels compiled by NVRTC for it on
/// first use. k/v may have their own sequence length (cross-attention: positions start
/// at 0 for both) and fewer heads (grouped); inputs may carry masks and windows.
#[derive(Debug, Clone)]
pub struct CudaBackend {
    dev: CudaDevice,
}

impl CudaBackend {
    /// Open device `ordinal` ([`CudaDevice::new`]: a typed error without a driver,
    /// NVRTC or the device).
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(CudaBackend { dev: CudaDevice::new(ordinal)? })
    }

    /// A backend on an already opened device.
    pub fn on(dev: CudaDevice) -> Self {
        CudaBackend { dev }
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// Forward on contiguous buffers (a [`attn_core::Shape4`] is self-attention):
    /// `(out, lse)`.
    pub fn forward_vec<T: CudaElement>(
        &self,
        cfg: &DilatedConfig,
        shape: impl Into<AttnShape>,
        q: &[T],
        k: &[T],
        v: &[T],
    ) -> Result<(Vec<T>, Vec<f32>)> {
        let shape = shape.into();
        let inputs = AttnInputs::contiguous(cfg, shape, [q, k, v])?;
        let mut out = vec![T::default(); shape.q.numel()];
        let mut lse = vec![0.0f32; shape.q.lse_len()];
        self.forward_impl(&inputs, TensorViewMut::contiguous(TensorName::Output, &mut out, shape.q)?, &mut lse)?;
        Ok((out, lse))
    }

    /// Forward, then backward, on contiguous buffers: `[dq, dk, dv]`.
    pub fn backward_vec<T: CudaElement>(
        &self,
        cfg: &DilatedConfig,
        shape: impl Into<AttnShape>,
        [q, k, v]: [&[T]; 3],
        grad_out: &[T],
    ) -> Result<[Vec<T>; 3]> {
        let shape = shape.into();
        let (out, lse) = self.forward_vec(cfg, shape, q, k, v)?;
        let inputs = AttnInputs::contiguous(cfg, shape, [q, k, v])?;
        let saved = Saved { out: TensorView::contiguous(TensorName::Output, &out, shape.q)?, lse: &lse };
        let gv = TensorView::contiguous(TensorName::GradOutput, grad_out, shape.q)?;
        let mut dq = vec![T::default(); shape.q.numel()];
        let (mut dk, mut dv) = (vec![T::default(); shape.kv.numel()], vec![T::default(); shape.kv.numel()]);
        self.backward_impl(&inputs, saved, gv, None, Grads::contiguous(shape, [&mut dq, &mut dk, &mut dv])?)?;
        Ok([dq, dk, dv])
    }

    fn forward_impl<T: CudaElement>(
        &self,
        inputs: &AttnInputs<'_, T>,
        mut out: TensorViewMut<'_, T>,
        lse: &mut [f32],
    ) -> Result<()> {
        let (dev, cfg) = (&self.dev, inputs.cfg);
        let shape = inputs.shape_for("cuda", Supported::ALL)?;
        check_out(TensorName::Output, &out, shape.q)?;
        if lse.len() != shape.q.lse_len() {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Lse,
                expected: vec![shape.q.lse_len()],
                got: vec![lse.len()],
            });
        }
        let up = |x: &TensorView<'_, T>| DeviceTensor::from_view(dev, x);
        let (dq, dk, dv) = (up(&inputs.q)?, up(&inputs.k)?, up(&inputs.v)?);
        let mask = inputs.masks.key_padding.map(|m| DeviceKeyPadding::upload(dev, &m)).transpose()?;
        let blocks = inputs.masks.block.map(|m| DeviceBlockMask::upload(dev, &m)).transpose()?;
        let block = DeviceBlock {
            key_padding: mask.as_ref(),
            packing: inputs.masks.packing,
            block_mask: blocks.as_ref(),
            ..DeviceBlock::new(cfg, (&dq, 0), (&dk, &dv, 0))
        };
        let mut dout = DeviceTensor::<T>::zeros(dev, shape.q)?;
        let dlse = forward_call(dev, &block, &mut dout, ForwardPath::Direct)?;
        let host_lse = dev.stream.clone_dtoh(&dlse).map_err(cuda_err)?;
        dev.synchronize()?;
        write_rows(&mut out, &dout.to_host_contiguous(dev)?);
        lse.copy_from_slice(&host_lse);
        Ok(())
    }

    fn backward_impl<T: CudaElement>(
        &self,
        inputs: &AttnInputs<'_, T>,
        saved: Saved<'_, T>,
        grad_out: TensorView<'_, T>,
        grad_lse: Option<&[f32]>,
        mut grads: Grads<'_, T>,
    ) -> Result<()> {
        let (dev, cfg) = (&self.dev, inputs.cfg);
        let shape = inputs.shape_for("cuda", Supported::ALL)?;
        for (t, s) in [(TensorName::Output, saved.out.shape()), (TensorName::GradOutput, grad_out.shape())] {
            if s != shape.q {
                return Err(AttnError::ShapeMismatch {
                    tensor: t,
                    expected: shape.q.dims().to_vec(),
                    got: s.dims().to_vec(),
                });
            }
        }
        for (t, len) in [(TensorName::Lse, Some(saved.lse.len())), (TensorName::GradLse, grad_lse.map(<[f32]>::len))] {
            match len {
                Some(got) if got != shape.q.lse_len() => {
                    return Err(AttnError::ShapeMismatch {
                        tensor: t,
                        expected: vec![shape.q.lse_len()],
                        got: vec![got],
                    });
                }
                _ => {}
            }
        }
        check_out(TensorName::GradQuery, &grads.dq, shape.q)?;
        check_out(TensorName::GradKey, &grads.dk, shape.kv)?;
        check_out(TensorName::GradValue, &grads.dv, shape.kv)?;
        let up = |x: &TensorView<'_, T>| DeviceTensor::from_view(dev, x);
        let (tq, tk, tv) = (up(&inputs.q)?, up(&inputs.k)?, up(&inputs.v)?);
        let (tout, tgo) = (up(&saved.out)?, up(&grad_out)?);
        let dlse = dev.stream.clone_htod(saved.lse).map_err(cuda_err)?;
        let dglse = grad_lse.map(|g| dev.stream.clone_htod(g)).transpose().map_err(cuda_err)?;
        let mask = inputs.masks.key_padding.map(|m| DeviceKeyPadding::upload(dev, &m)).transpose()?;
        let blocks = inputs.masks.block.map(|m| DeviceBlockMask::upload(dev, &m)).transpose()?;
        let block = DeviceBlock {
            key_padding: mask.as_ref(),
            packing: inputs.masks.packing,
            block_mask: blocks.as_ref(),
            ..DeviceBlock::new(cfg, (&tq, 0), (&tk, &tv, 0))
        };
        let zeros = |s| DeviceTensor::<T>::zeros(dev, s);
        let (mut dq, mut dk, mut dv) = (zeros(shape.q)?, zeros(shape.kv)?, zeros(shape.kv)?);
        let saved = DeviceSaved { out: &tout, lse: &dlse };
        backward_call(dev, &block, saved, &tgo, dglse.as_ref(), [&mut dq, &mut dk, &mut dv])?;
        write_rows(&mut grads.dq, &dq.to_host_contiguous(dev)?);
        write_rows(&mut grads.dk, &dk.to_host_contiguous(dev)?);
        write_rows(&mut grads.dv, &dv.to_host_contiguous(dev)?);
        Ok(())
    }
}

impl<T: CudaElement> Attention<T> for CudaBackend {
    fn name(&self) -> &str {
        "cuda"
    }

    fn forward(&self, inputs: &AttnInputs<'_, T>, out: TensorViewMut<'_, T>, lse: &mut [f32]) -> Result<()> {
        self.forward_impl(inputs, out, lse)
    }

    fn backward_with_lse_grad(
        &self,
        inputs: &AttnInputs<'_, T>,
        saved: Saved<'_, T>,
        grad_out: TensorView<'_, T>,
        grad_lse: Option<&[f32]>,
        grads: Grads<'_, T>,
    ) -> Result<()> {
        self.backward_impl(inputs, saved, grad_out, grad_lse, grads)
    }

    /// Device memory: the uploaded inputs and outputs in `T`, the f32 lse, the f32 partial
    /// output where the forward does not write its output straight from the kernel, and
    /// the gradient accumulators.
    fn workspace_bytes(&self, cfg: &DilatedConfig, shape: AttnShape, pass: Pass) -> usize {
        let (q, kv, lse) = (shape.q.numel() as u128, shape.kv.numel() as u128, shape.q.lse_len() as u128);
        let elem = std::mem::size_of::<T>() as u128;
        let direct =
            writes_direct(cfg, &forward_kernel(T::DTYPE, T::SUFFIX, shape.q.head_dim, self.dev.forward_options()));
        let bytes = match pass {
            Pass::Forward => elem * (2 * q + 2 * kv) + 4 * (lse + if direct { 0 } else { q }),
            Pass::Backward => elem * (4 * q + 4 * kv) + 4 * (q + 2 * kv + 2 * lse) + elem * (q + 2 * kv),
        };
        usize::try_from(bytes).unwrap_or(usize::MAX)
    }

    /// As [`Attention::workspace_bytes`], plus the key padding mask uploaded as one byte
    /// per key (packed sequences run per sequence on the same buffers), and a block mask's
    /// entries with the f32 partial of its forward (a block-masked forward runs on the row
    /// kernels, which merge into one).
    fn workspace_bytes_masked(&self, cfg: &DilatedConfig, shape: AttnShape, masks: &Masks<'_>, pass: Pass) -> usize {
        let flags = masks.key_padding.map_or(0, |m| m.flags().len());
        let blocks = masks.block.map_or(0, |m| {
            let kernel = forward_kernel(T::DTYPE, T::SUFFIX, shape.q.head_dim, self.dev.forward_options());
            let partial = pass == Pass::Forward && writes_direct(cfg, &kernel);
            m.keep().len().saturating_add(if partial { 4 * shape.q.numel() } else { 0 })
        });
        Attention::<T>::workspace_bytes(self, cfg, shape, pass).saturating_add(flags).saturating_add(blocks)
    }
}
