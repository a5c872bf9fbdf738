//! The forward and backward on CUDA tensors (feature `cuda`): every tensor's memory is
//! wrapped as a foreign device handle (never copied, never freed here) and the kernels
//! are queued on the caller's current stream, so the call is ordered with the
//! framework's work like one of its own ops and returns without synchronising.

use attn_core::{DilatedConfig, Result};
use pyo3::Python;

use crate::call::{BackwardArgs, ForwardArgs, MaskArgs};

/// Where the kernels run: the device ordinal and the raw handle of the stream to queue on
/// (0: the legacy default stream).
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct Placement {
    pub device: usize,
    pub stream: usize,
}

#[cfg(feature = "cuda")]
pub(crate) mod imp {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    use attn_core::{AttnError, AttnShape, BlockMaskBuf, DilatedConfig, Masks, PackedSequences, Result, TensorName};
    use attn_kernels::cuda::DeviceTensor;
    use attn_kernels::cuda::backward_scratch_lens;
    use attn_kernels::cuda::{BackwardScratch, Foreign, RawStream, backward_call, backward_call_in, forward_call_into};
    use attn_kernels::cuda::{CudaDevice, CudaElement, DeviceBlock, DeviceBlockMask, DeviceKeyPadding, DeviceSaved};
    use attn_kernels::cuda::{foreign_key_padding, foreign_slice, foreign_tensor};
    use pyo3::Python;

    use super::Placement;
    use crate::call::{
        BackwardArgs, CheckedBackward, ForwardArgs, MaskArgs, by_dtype, checked_backward, checked_forward, cu_seqlens,
        lse_dims, read_block_mask,
    };
    use crate::raw::{Access, Checked, check_disjoint};

    /// The devices opened so far, by ordinal (opening checks the driver, NVRTC and the
    /// device, and reads the kernel choices from the environment, once).
    pub fn device(ordinal: usize) -> Result<CudaDevice> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, CudaDevice>>> = OnceLock::new();
        let map = DEVICES.get_or_init(|| Mutex::new(HashMap::new()));
        // The map stays whole whatever a panicking holder did (it only ever inserts).
        let mut map = map.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = CudaDevice::new(ordinal)?;
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    /// The device of `at` launching on its stream.
    pub(crate) fn on_stream(at: Placement) -> Result<CudaDevice> {
        let dev = device(at.device)?;
        // SAFETY: the Python wrapper passes `torch.cuda.current_stream(device).cuda_stream`
        // of the tensors' device, a stream of that device's primary context that PyTorch
        // keeps alive past this call.
        Ok(unsafe { dev.with_foreign_stream(at.stream as RawStream) })
    }

    /// A tensor's memory as a foreign handle on `dev`.
    fn wrap<T: CudaElement>(dev: &CudaDevice, c: &Checked, name: TensorName) -> Result<Foreign<DeviceTensor<T>>> {
        let (span, shape, strides) = c.device_parts4()?;
        // SAFETY: `c` was checked against the tensor's sizes and strides, and
        // `foreign_tensor` checks that its span is `dev`'s memory; the Python wrapper holds
        // the tensor for the whole call, and the kernels touch it only on the caller's
        // current stream.
        unsafe { foreign_tensor(dev, name, span, shape, strides) }
    }

    /// The key padding mask, a contiguous `[batch, key_seq]` bool/uint8 tensor on the
    /// device, checked apart from the written buffers.
    struct Mask(Option<(Checked, usize, usize)>);

    impl Mask {
        fn check(args: &MaskArgs, written: &[&Checked]) -> Result<Self> {
            let Some(raw) = &args.key_padding else { return Ok(Mask(None)) };
            let name = TensorName::KeyPaddingMask;
            if !matches!(raw.dtype(), "bool" | "uint8") {
                return Err(AttnError::DTypeMismatch { tensor: name, expected: "bool", got: raw.dtype().into() });
            }
            let c = raw.check(name, 2, 1, 1)?;
            let (batch, seq) = (c.dims()[0], c.dims()[1]);
            c.expect_contiguous(&[batch, seq])?;
            let mut all: Vec<(&Checked, Access)> = written.iter().map(|w| (*w, Access::Write)).collect();
            all.push((&c, Access::Read));
            check_disjoint(&all)?;
            Ok(Mask(Some((c, batch, seq))))
        }

        /// The mask's `(batch, key_seq)`.
        fn sizes(&self) -> Option<(usize, usize)> {
            self.0.as_ref().map(|(_, batch, seq)| (*batch, *seq))
        }

        fn wrap(&self, dev: &CudaDevice) -> Result<Option<Foreign<DeviceKeyPadding>>> {
            self.0
                .as_ref()
                .map(|(c, batch, seq)| {
                    // SAFETY: as in `wrap`: a checked, contiguous `batch * seq` byte tensor.
                    unsafe { foreign_key_padding(dev, c.device_span().0, *batch, *seq) }
                })
                .transpose()
        }
    }

    /// A written tensor must be contiguous with exactly `want` sizes (the wrapper allocates
    /// it so): its rows can then never overlap.
    fn written(c: &Checked, want: &[usize]) -> Result<()> {
        c.expect_contiguous(want)
    }

    /// The packed sequences of `cu_seqlens`, checked.
    fn packing(cu: &Option<Vec<usize>>) -> Result<Option<PackedSequences<'_>>> {
        cu.as_deref().map(PackedSequences::new).transpose()
    }

    /// A call's masks, checked: the key padding mask, the sequence offsets and the block
    /// mask (a host tensor, the wrapper's copy: its values are checked here and it is
    /// uploaded on the call's stream).
    struct CallMasks {
        mask: Mask,
        cu: Option<Vec<usize>>,
        block: Option<BlockMaskBuf>,
    }

    /// What both passes check besides their own tensors: the key padding mask (apart
    /// from the `written` buffers), `cu_seqlens`, the block mask, and q, k, v against the
    /// config and the masks' sizes.
    fn checked_masks(
        cfg: &DilatedConfig,
        [q, k, v]: [&Checked; 3],
        mask_args: &MaskArgs,
        written: &[&Checked],
    ) -> Result<CallMasks> {
        let block = read_block_mask(mask_args, written)?;
        let mask = Mask::check(mask_args, written)?;
        let cu = cu_seqlens(mask_args)?;
        let shape = AttnShape::of_call(cfg, [q.dims(), k.dims(), v.dims()])?;
        Masks::check_sizes(mask.sizes(), packing(&cu)?, &shape)?;
        if let Some(b) = &block {
            b.view().check(&shape, packing(&cu)?)?;
        }
        Ok(CallMasks { mask, cu, block })
    }

    /// q, k, v and the key padding mask of a call as foreign handles on one device, and
    /// the block mask uploaded to it.
    struct DeviceInputs<T: CudaElement> {
        q: Foreign<DeviceTensor<T>>,
        k: Foreign<DeviceTensor<T>>,
        v: Foreign<DeviceTensor<T>>,
        mask: Option<Foreign<DeviceKeyPadding>>,
        block_mask: Option<DeviceBlockMask>,
    }

    impl<T: CudaElement> DeviceInputs<T> {
        fn wrap(dev: &CudaDevice, [q, k, v]: [&Checked; 3], masks: &CallMasks) -> Result<Self> {
            Ok(DeviceInputs {
                q: wrap(dev, q, TensorName::Query)?,
                k: wrap(dev, k, TensorName::Key)?,
                v: wrap(dev, v, TensorName::Value)?,
                mask: masks.mask.wrap(dev)?,
                block_mask: masks.block.as_ref().map(|b| DeviceBlockMask::upload(dev, &b.view())).transpose()?,
            })
        }

        /// The whole call as one block of `cfg`.
        fn block<'a>(&'a self, cfg: &'a DilatedConfig, packing: Option<PackedSequences<'a>>) -> DeviceBlock<'a, T> {
            DeviceBlock {
                key_padding: self.mask.as_deref(),
                packing,
                block_mask: self.block_mask.as_ref(),
                ..DeviceBlock::new(cfg, (&*self.q, 0), (&*self.k, &*self.v, 0))
            }
        }
    }

    pub fn forward(
        py: Python<'_>,
        cfg: &DilatedConfig,
        args: &ForwardArgs,
        masks: &MaskArgs,
        at: Placement,
    ) -> Result<()> {
        by_dtype!(&args.q, forward_typed(py, cfg, args, masks, at))
    }

    fn forward_typed<T: CudaElement>(
        py: Python<'_>,
        cfg: &DilatedConfig,
        args: &ForwardArgs,
        mask_args: &MaskArgs,
        at: Placement,
    ) -> Result<()> {
        let [q, k, v, out, lse] = checked_forward::<T>(args)?;
        written(&out, q.dims())?;
        written(&lse, &lse_dims(&q))?;
        let masks = checked_masks(cfg, [&q, &k, &v], mask_args, &[&out, &lse])?;
        py.detach(|| {
            let dev = on_stream(at)?;
            let inputs = DeviceInputs::<T>::wrap(&dev, [&q, &k, &v], &masks)?;
            let mut fout = wrap::<T>(&dev, &out, TensorName::Output)?;
            let (at, len) = lse.device_span();
            // SAFETY: as in `wrap`: the checked, contiguous f32 lse tensor.
            let mut flse = unsafe { foreign_slice::<f32>(&dev, TensorName::Lse, at, len) }?;
            forward_call_into(&dev, &inputs.block(cfg, packing(&masks.cu)?), &mut fout, &mut flse)
        })
    }

    pub fn backward(
        py: Python<'_>,
        cfg: &DilatedConfig,
        args: &BackwardArgs,
        masks: &MaskArgs,
        at: Placement,
    ) -> Result<()> {
        by_dtype!(&args.q, backward_typed(py, cfg, args, masks, at))
    }

    fn backward_typed<T: CudaElement>(
        py: Python<'_>,
        cfg: &DilatedConfig,
        args: &BackwardArgs,
        mask_args: &MaskArgs,
        at: Placement,
    ) -> Result<()> {
        let CheckedBackward { saved: [q, k, v, out, lse], grad_out, grad_lse, grads: [dq, dk, dv] } =
            checked_backward::<T>(args)?;
        let scratch = checked_scratch(args, &q, &k, [&q, &k, &v, &out, &lse, &grad_out, &dq, &dk, &dv])?;
        lse.expect_contiguous(&lse_dims(&q))?;
        if let Some(g) = &grad_lse {
            g.expect_contiguous(&lse_dims(&q))?;
        }
        written(&dq, q.dims())?;
        written(&dk, k.dims())?;
        written(&dv, v.dims())?;
        let masks = checked_masks(cfg, [&q, &k, &v], mask_args, &[&dq, &dk, &dv])?;
        py.detach(|| {
            let dev = on_stream(at)?;
            let inputs = DeviceInputs::<T>::wrap(&dev, [&q, &k, &v], &masks)?;
            let w = |c: &Checked, name| wrap::<T>(&dev, c, name);
            let (fout, fgo) = (w(&out, TensorName::Output)?, w(&grad_out, TensorName::GradOutput)?);
            let (mut fdq, mut fdk, mut fdv) =
                (w(&dq, TensorName::GradQuery)?, w(&dk, TensorName::GradKey)?, w(&dv, TensorName::GradValue)?);
            let (at, len) = lse.device_span();
            // SAFETY: as in `wrap`: the checked, contiguous f32 lse tensor.
            let flse = unsafe { foreign_slice::<f32>(&dev, TensorName::Lse, at, len) }?;
            let fglse = match &grad_lse {
                Some(g) => {
                    let (at, len) = g.device_span();
                    // SAFETY: as in `wrap`: the checked, contiguous f32 grad_lse tensor.
                    Some(unsafe { foreign_slice::<f32>(&dev, TensorName::GradLse, at, len) }?)
                }
                None => None,
            };
            let saved = DeviceSaved { out: &fout, lse: &flse };
            let grads = [&mut *fdq, &mut *fdk, &mut *fdv];
            let block = inputs.block(cfg, packing(&masks.cu)?);
            let Some(scratch) = &scratch else {
                return backward_call(&dev, &block, saved, &fgo, fglse.as_deref(), grads);
            };
            // The accumulators first (16-byte aligned where the tensor is, for the vector
            // epilogues), then delta.
            let lens = backward_scratch_lens(block.q.shape, block.k.shape);
            let (base, _) = scratch.device_span();
            let mut at = base;
            let mut parts = Vec::with_capacity(4);
            for (name, len) in
                [(TensorName::GradQuery, lens[1]), (TensorName::GradKey, lens[2]), (TensorName::GradValue, lens[3])]
                    .into_iter()
                    .chain([(TensorName::Other("delta scratch"), lens[0])])
            {
                // SAFETY: as in `wrap`: consecutive spans of the checked, contiguous f32
                // scratch tensor, which no other buffer of the call overlaps.
                parts.push(unsafe { foreign_slice::<f32>(&dev, name, at, len) }?);
                at += 4 * len as u64;
            }
            let [dq_acc, dk_acc, dv_acc, delta] = &mut parts[..] else { unreachable!("four scratch parts") };
            let scratch = BackwardScratch { delta, dq: dq_acc, dk: dk_acc, dv: dv_acc };
            backward_call_in(&dev, &block, saved, &fgo, fglse.as_deref(), grads, scratch)
        })
    }

    /// The caller's scratch for the backward, where given: one contiguous float32 tensor
    /// of exactly the accumulators' and delta's values, overlapping no other tensor.
    fn checked_scratch(
        args: &BackwardArgs,
        q: &Checked,
        k: &Checked,
        others: [&Checked; 9],
    ) -> Result<Option<Checked>> {
        let Some(raw) = &args.scratch else { return Ok(None) };
        let name = TensorName::Other("scratch");
        raw.expect_dtype(name, "float32")?;
        let c = raw.check(name, 1, 4, 4)?;
        let (qs, ks) = (q.device_parts4()?.1, k.device_parts4()?.1);
        let total: usize = backward_scratch_lens(qs, ks).iter().sum();
        c.expect_contiguous(&[total])?;
        let mut all: Vec<(&Checked, Access)> = others.iter().map(|&t| (t, Access::Read)).collect();
        all.push((&c, Access::Write));
        check_disjoint(&all)?;
        Ok(Some(c))
    }

    /// Why the kernels cannot run on device `ordinal`, or `None` where they can.
    pub fn unavailable_reason(ordinal: usize) -> Option<String> {
        device(ordinal).err().map(|e| e.to_string())
    }
}

/// `call()`, with a panic inside it turned into a typed error naming it: cudarc unwraps a
/// few driver results (an event it creates per borrowed buffer fails once an earlier fault
/// has broken the context), and Python should see a RuntimeError, not a PanicException.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn unwinding_to_error(call: impl FnOnce() -> Result<()>) -> Result<()> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("no message");
        Err(attn_core::AttnError::backend("cuda", std::io::Error::other(format!("the CUDA call panicked: {what}"))))
    })
}

/// Forward on CUDA tensors: writes `out` and `lse` on the caller's stream.
pub fn forward(py: Python<'_>, cfg: &DilatedConfig, args: &ForwardArgs, masks: &MaskArgs, at: Placement) -> Result<()> {
    #[cfg(feature = "cuda")]
    return unwinding_to_error(|| imp::forward(py, cfg, args, masks, at));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (py, cfg, args, masks, at);
        Err(not_compiled())
    }
}

/// Backward on CUDA tensors: writes `dq`, `dk` and `dv` on the caller's stream.
pub fn backward(
    py: Python<'_>,
    cfg: &DilatedConfig,
    args: &BackwardArgs,
    masks: &MaskArgs,
    at: Placement,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    return unwinding_to_error(|| imp::backward(py, cfg, args, masks, at));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (py, cfg, args, masks, at);
        Err(not_compiled())
    }
}

/// Why the CUDA kernels cannot run on device `ordinal` (no `cuda` feature, no driver,
/// NVRTC or device, a device older than sm_80), or `None` where they can.
pub fn unavailable_reason(ordinal: usize) -> Option<String> {
    #[cfg(feature = "cuda")]
    return imp::unavailable_reason(ordinal);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Some(not_compiled().to_string())
    }
}

/// Directories to search for libnvrtc after the dynamic linker's path (the Python side
/// passes the lib directories of PyTorch's NVIDIA wheels); nothing without `cuda`.
pub fn add_library_search_dirs(dirs: Vec<String>) {
    #[cfg(feature = "cuda")]
    attn_kernels::cuda::add_library_search_dirs(dirs.into_iter().map(Into::into));
    #[cfg(not(feature = "cuda"))]
    let _ = dirs;
}

/// The libnvrtc the kernels compile with (its file or linker name, and version), or why
/// none loads.
pub fn nvrtc_library() -> Result<(String, (i32, i32))> {
    #[cfg(feature = "cuda")]
    return attn_kernels::cuda::nvrtc_library().map(|lib| (lib.path().to_string(), lib.version()));
    #[cfg(not(feature = "cuda"))]
    Err(not_compiled())
}

#[cfg(not(feature = "cuda"))]
fn not_compiled() -> attn_core::AttnError {
    attn_core::AttnError::NotCompiled { backend: "cuda", feature: "cuda" }
}

#[cfg(test)]
mod unwinding_tests {
    use super::*;

    #[test]
    fn a_panic_in_a_cuda_call_is_a_backend_error() {
        let err = unwinding_to_error(|| panic!("event creation failed: CUDA_ERROR_ILLEGAL_ADDRESS")).unwrap_err();
        assert!(matches!(err, attn_core::AttnError::Backend { backend: "cuda", .. }), "{err:?}");
        assert!(err.to_string().contains("panicked: event creation failed"), "{err}");
        let err = unwinding_to_error(|| std::panic::panic_any(7u8)).unwrap_err();
        assert!(err.to_string().contains("panicked: no message"), "{err}");
        assert!(unwinding_to_error(|| Ok(())).is_ok());
    }
}

#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    #[test]
    fn without_the_feature_the_reason_names_it() {
        let reason = super::unavailable_reason(0).expect("a build without `cuda` cannot run the kernels");
        assert!(reason.contains("enable the `cuda` feature"), "{reason}");
    }
}
