//! Tensors another library owns, computed on its stream: a backend that keeps every
//! buffer in memory owned by a stream of its own (as PyTorch does), hands the kernels only
//! the raw addresses (`foreign_tensor`, `foreign_slice`, `foreign_key_padding`) and that
//! stream's handle (`with_foreign_stream`), and reads the results back from its own
//! buffers, passes every golden file in f32 and bf16; dropping a foreign handle leaves the
//! owner's memory allocated and unchanged; a host address or a span ending outside device
//! memory never becomes a handle. Skips without a GPU (fails instead with
//! `ATTN_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(unsafe_code)]

mod cuda_support;

use attn_core::error::TensorName;
use attn_core::{Attention, AttnInputs, DilatedConfig, Grads, Masks, Result, Saved, Supported};
use attn_core::{AttnShape, Pass, TensorView, TensorViewMut};
use attn_kernels::cuda::{CudaDevice, CudaElement, DeviceBlock, DeviceKeyPadding, DeviceSaved, DeviceTensor};
use attn_kernels::cuda::{
    Foreign, backward_call, check_device_span, foreign_key_padding, foreign_slice, foreign_tensor, forward_call_into,
};
use attn_testkit::Typed;
use attn_testkit::golden::assert_attention_dirs_pass;
use cuda_support::device_or_skip;
use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;

/// The whole-call entry points on foreign handles over buffers that `owner` (a stream of
/// its own) allocated and filled.
#[derive(Debug)]
struct OwnedElsewhere {
    owner: CudaDevice,
}

fn addr<T>(owner: &CudaDevice, s: &CudaSlice<T>) -> u64 {
    s.device_ptr(owner.stream()).0
}

fn write_rows<T: CudaElement>(dst: &mut TensorViewMut<'_, T>, contiguous: &[T]) {
    let s = dst.shape();
    for (i, row) in contiguous.chunks(s.head_dim).enumerate() {
        let (b, t, h) = (i / (s.seq * s.heads), i / s.heads % s.seq, i % s.heads);
        dst.row_mut(b, t, h).copy_from_slice(row);
    }
}

impl OwnedElsewhere {
    /// The kernels' handle: the same device, launching on the owner's stream.
    fn kernels(&self) -> CudaDevice {
        // SAFETY: the owner's stream belongs to the device's primary context and lives as
        // long as `self.owner`, which outlives every call's handle.
        unsafe { self.owner.with_foreign_stream(self.owner.stream().cu_stream()) }
    }

    fn upload<T: CudaElement>(&self, x: &TensorView<'_, T>) -> Result<DeviceTensor<T>> {
        DeviceTensor::from_view(&self.owner, x)
    }

    fn borrow<T: CudaElement>(&self, dev: &CudaDevice, t: &DeviceTensor<T>) -> Result<Foreign<DeviceTensor<T>>> {
        // SAFETY: `t` is the owner's live allocation of `t.data.len()` elements and outlives
        // the handle; only work on the owner's stream touches it.
        unsafe {
            foreign_tensor(
                dev,
                TensorName::Other("borrowed"),
                (addr(&self.owner, &t.data), t.data.len()),
                t.shape,
                t.strides,
            )
        }
    }

    fn borrow_mask(&self, dev: &CudaDevice, m: &DeviceKeyPadding) -> Result<Foreign<DeviceKeyPadding>> {
        // SAFETY: as in `borrow`, for the mask's `batch * seq` bytes.
        unsafe { foreign_key_padding(dev, addr(&self.owner, &m.flags), m.batch, m.seq) }
    }

    fn mask(&self, masks: &Masks<'_>) -> Result<Option<DeviceKeyPadding>> {
        masks.key_padding.map(|m| DeviceKeyPadding::upload(&self.owner, &m)).transpose()
    }
}

impl<T: CudaElement> Attention<T> for OwnedElsewhere {
    fn name(&self) -> &str {
        "cuda-foreign"
    }

    fn forward(&self, inputs: &AttnInputs<'_, T>, mut out: TensorViewMut<'_, T>, lse: &mut [f32]) -> Result<()> {
        let shape = inputs.shape_for("cuda-foreign", Supported::ALL_BUT_BLOCK_MASKS)?;
        let (q, k, v) = (self.upload(&inputs.q)?, self.upload(&inputs.k)?, self.upload(&inputs.v)?);
        let mask = self.mask(&inputs.masks)?;
        let owned_out = DeviceTensor::<T>::zeros(&self.owner, shape.q)?;
        let owned_lse = self.owner.stream().alloc_zeros::<f32>(shape.q.lse_len()).unwrap();
        {
            let dev = self.kernels();
            let (fq, fk, fv) = (self.borrow(&dev, &q)?, self.borrow(&dev, &k)?, self.borrow(&dev, &v)?);
            let fmask = mask.as_ref().map(|m| self.borrow_mask(&dev, m)).transpose()?;
            let mut fout = self.borrow(&dev, &owned_out)?;
            let lse_at = addr(&self.owner, &owned_lse);
            // SAFETY: as in `borrow`, for the owner's lse buffer.
            let mut flse = unsafe { foreign_slice::<f32>(&dev, TensorName::Lse, lse_at, owned_lse.len()) }?;
            let block = DeviceBlock {
                key_padding: fmask.as_deref(),
                packing: inputs.masks.packing,
                ..DeviceBlock::new(inputs.cfg, (&*fq, 0), (&*fk, &*fv, 0))
            };
            forward_call_into(&dev, &block, &mut fout, &mut flse)?;
        }
        write_rows(&mut out, &owned_out.to_host_contiguous(&self.owner)?);
        lse.copy_from_slice(&self.owner.stream().clone_dtoh(&owned_lse).unwrap());
        Ok(())
    }

    fn backward_with_lse_grad(
        &self,
        inputs: &AttnInputs<'_, T>,
        saved: Saved<'_, T>,
        grad_out: TensorView<'_, T>,
        grad_lse: Option<&[f32]>,
        mut grads: Grads<'_, T>,
    ) -> Result<()> {
        let shape = inputs.shape_for("cuda-foreign", Supported::ALL_BUT_BLOCK_MASKS)?;
        let (q, k, v) = (self.upload(&inputs.q)?, self.upload(&inputs.k)?, self.upload(&inputs.v)?);
        let (out, go) = (self.upload(&saved.out)?, self.upload(&grad_out)?);
        let lse = self.owner.stream().clone_htod(saved.lse).unwrap();
        let glse = grad_lse.map(|g| self.owner.stream().clone_htod(g).unwrap());
        let mask = self.mask(&inputs.masks)?;
        let zeros = |s| DeviceTensor::<T>::zeros(&self.owner, s);
        let owned = [zeros(shape.q)?, zeros(shape.kv)?, zeros(shape.kv)?];
        {
            let dev = self.kernels();
            let b = |t| self.borrow(&dev, t);
            let (fq, fk, fv, fout, fgo) = (b(&q)?, b(&k)?, b(&v)?, b(&out)?, b(&go)?);
            // SAFETY: as in `borrow`, for the owner's lse buffer.
            let flse = unsafe { foreign_slice::<f32>(&dev, TensorName::Lse, addr(&self.owner, &lse), lse.len()) }?;
            let fglse = match &glse {
                Some(g) => {
                    let at = addr(&self.owner, g);
                    // SAFETY: as in `borrow`, for the owner's grad_lse buffer.
                    Some(unsafe { foreign_slice::<f32>(&dev, TensorName::GradLse, at, g.len()) }?)
                }
                None => None,
            };
            let fmask = mask.as_ref().map(|m| self.borrow_mask(&dev, m)).transpose()?;
            let [mut dq, mut dk, mut dv] = [b(&owned[0])?, b(&owned[1])?, b(&owned[2])?];
            let block = DeviceBlock {
                key_padding: fmask.as_deref(),
                packing: inputs.masks.packing,
                ..DeviceBlock::new(inputs.cfg, (&*fq, 0), (&*fk, &*fv, 0))
            };
            let saved = DeviceSaved { out: &fout, lse: &flse };
            backward_call(&dev, &block, saved, &fgo, fglse.as_deref(), [&mut dq, &mut dk, &mut dv])?;
        }
        let [dq, dk, dv] = &owned;
        write_rows(&mut grads.dq, &dq.to_host_contiguous(&self.owner)?);
        write_rows(&mut grads.dk, &dk.to_host_contiguous(&self.owner)?);
        write_rows(&mut grads.dv, &dv.to_host_contiguous(&self.owner)?);
        Ok(())
    }

    fn workspace_bytes(&self, _cfg: &DilatedConfig, _shape: AttnShape, _pass: Pass) -> usize {
        0
    }
}

fn owned_elsewhere(test: &str) -> Option<OwnedElsewhere> {
    let dev = device_or_skip(test)?;
    Some(OwnedElsewhere { owner: dev.with_own_stream().unwrap() })
}

#[test]
fn golden_files_pass_on_foreign_buffers_in_bf16() {
    let Some(b) = owned_elsewhere("golden_files_pass_on_foreign_buffers_in_bf16") else { return };
    assert_attention_dirs_pass(&Typed::<_, bf16>::new(b));
}

#[test]
fn golden_files_pass_on_foreign_buffers_in_f32() {
    let Some(b) = owned_elsewhere("golden_files_pass_on_foreign_buffers_in_f32") else { return };
    assert_attention_dirs_pass(&Typed::<_, f32>::new(b));
}

#[test]
fn dropping_a_foreign_handle_leaves_the_owners_memory() {
    let Some(b) = owned_elsewhere("dropping_a_foreign_handle_leaves_the_owners_memory") else { return };
    let values: Vec<f32> = (0..4096).map(|i| i as f32 * 0.5).collect();
    let owned = b.owner.stream().clone_htod(&values).unwrap();
    for _ in 0..3 {
        let (dev, at) = (b.kernels(), addr(&b.owner, &owned));
        // SAFETY: `owned` is the owner's live allocation of `values.len()` f32s.
        let handle = unsafe { foreign_slice::<f32>(&dev, TensorName::Lse, at, owned.len()) };
        drop(handle.unwrap());
    }
    b.owner.synchronize().unwrap();
    assert_eq!(b.owner.stream().clone_dtoh(&owned).unwrap(), values);
    drop(owned);
    b.owner.synchronize().unwrap();
    b.owner.context().check_err().expect("freeing the owner's memory once, after its foreign handles, is clean");
}

#[test]
fn only_this_devices_memory_becomes_a_foreign_handle() {
    let Some(b) = owned_elsewhere("only_this_devices_memory_becomes_a_foreign_handle") else { return };
    let owned = b.owner.stream().alloc_zeros::<f32>(1024).unwrap();
    let at = addr(&b.owner, &owned);
    let name = TensorName::Query;
    check_device_span(&b.owner, name, at, 4096).expect("the whole allocation is this device's memory");
    check_device_span(&b.owner, name, at + 1024, 3072).expect("so is a span inside it");
    let host = vec![0f32; 1024];
    let refused =
        [(host.as_ptr() as u64, 4096, "a host address"), (at, 1 << 46, "a span ending far past any allocation")];
    for (address, bytes, what) in refused {
        let e = check_device_span(&b.owner, name, address, bytes).expect_err(what);
        assert!(e.to_string().contains("are not memory of CUDA device 0"), "{what}: {e}");
        // SAFETY: refused before any handle is made.
        assert!(unsafe { foreign_slice::<u8>(&b.kernels(), name, address, bytes) }.is_err(), "{what}");
    }
}

/// The lean call path on the device: forward and backward of one shape, three times, on the
/// owner's stream, allocate their scratch (the LongNet forward's partial, the backward's
/// delta and accumulators) on the first call only; another length allocates once more.
#[test]
fn repeated_whole_calls_allocate_scratch_on_the_first_only() {
    let Some(b) = owned_elsewhere("repeated_whole_calls_allocate_scratch_on_the_first_only") else { return };
    let cfg = DilatedConfig::builder()
        .segments(&[64, 128])
        .dilations(&[1, 2])
        .mixing(attn_core::Mixing::LongNet)
        .build()
        .unwrap();
    let run = |seq: usize| -> u64 {
        let shape = attn_core::Shape4::new(1, seq, 2, 64).unwrap();
        let n = shape.numel();
        let x: Vec<bf16> = (0..n).map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 64.0)).collect();
        let view = |name| TensorView::contiguous(name, &x, shape).unwrap();
        let inputs = AttnInputs::new(&cfg, view(TensorName::Query), view(TensorName::Key), view(TensorName::Value));
        let (mut out, mut lse) = (vec![bf16::ZERO; n], vec![0f32; shape.lse_len()]);
        b.forward(&inputs, TensorViewMut::contiguous(TensorName::Output, &mut out, shape).unwrap(), &mut lse).unwrap();
        let saved = Saved { out: TensorView::contiguous(TensorName::Output, &out, shape).unwrap(), lse: &lse };
        let (mut dq, mut dk, mut dv) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
        let grads = Grads::contiguous(shape.into(), [&mut dq, &mut dk, &mut dv]).unwrap();
        b.backward(&inputs, saved, view(TensorName::GradOutput), grads).unwrap();
        b.kernels().scratch_allocations()
    };
    let counts: Vec<u64> = [256, 256, 256, 192, 192].into_iter().map(run).collect();
    assert_eq!(counts, [5, 5, 5, 10, 10], "scratch allocations after each call");
}
