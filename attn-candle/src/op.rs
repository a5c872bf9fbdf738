//! The candle operation: [`DilatedAttentionOp`] is a `CustomOp3` over q, k, v whose
//! forward runs a backend's forward on candle's host storage in place (or, for tensors on
//! a CUDA device, the CUDA kernels on candle's device memory) and keeps the LSE, and
//! whose `bwd` runs the exact backward from that LSE; `LseGradientOp` hands a gradient
//! that reaches the returned LSE to that same backward.

use std::sync::{Arc, Mutex};

use attn_core::{AttnInputs, Grads, Saved, TensorName, TensorView, TensorViewMut};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use half::{bf16, f16};

use crate::error::{OnCuda, check_input, fail, to_candle};
use crate::host::{AnyAttention, HostElement, slice_of, unit_inner, view_of, with_view};
use crate::options::AttnOptions;

/// The LSE of one forward (`[batch, seq, heads]`, f32), shared by the op (for its
/// backward) and the caller (to read it): host values, or a tensor on the CUDA device
/// that computed it.
#[derive(Debug, Default)]
pub struct LseCell(Mutex<Option<KeptLse>>);

#[derive(Debug, Clone)]
enum KeptLse {
    Host(Vec<f32>),
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device(Tensor),
}

impl LseCell {
    /// Keeps the LSE of the op's one forward. A second forward is refused: the graph of
    /// the first would otherwise read the second's LSE in its backward (a wrong gradient
    /// whenever the shapes agree).
    fn put(&self, lse: KeptLse) -> candle_core::Result<()> {
        let mut slot = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_some() {
            return fail(attn_core::AttnError::InvalidArgument(
                "this DilatedAttentionOp has already run a forward and its backward reads that forward's LSE; \
                 build one op per call"
                    .into(),
            ));
        }
        *slot = Some(lse);
        Ok(())
    }

    fn kept(&self) -> Option<KeptLse> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// The kept LSE of a forward on the host, if it has run.
    pub fn get(&self) -> Option<Vec<f32>> {
        match self.kept()? {
            KeptLse::Host(lse) => Some(lse),
            KeptLse::Device(_) => None,
        }
    }

    /// The kept LSE as a `[batch, seq, heads]` f32 tensor on the device that computed it
    /// (`device` for a forward on the host), if the forward has run.
    pub fn tensor(
        &self,
        dims: (usize, usize, usize),
        device: &candle_core::Device,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(match self.kept() {
            None => None,
            Some(KeptLse::Host(lse)) => Some(Tensor::from_vec(lse, dims, device)?),
            Some(KeptLse::Device(t)) => Some(t),
        })
    }
}

/// One application of dilated attention: the backend, the options, and the LSE its
/// forward produced. Candle keeps the op object in the graph for the backward, so the
/// LSE travels with it and the backward never recomputes the forward. An op computes
/// one forward; applying it again is an error (build one per call).
pub struct DilatedAttentionOp {
    backend: Arc<dyn AnyAttention>,
    options: Arc<AttnOptions>,
    lse: Arc<LseCell>,
    pending: Arc<PendingLseGradient>,
    on_cuda: OnCuda,
}

impl std::fmt::Debug for DilatedAttentionOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DilatedAttentionOp")
            .field("backend", &Named::name(self.backend.as_ref()))
            .finish_non_exhaustive()
    }
}

/// The name a backend reports (every dtype reports the same one).
trait Named {
    fn name(&self) -> &str;
}

impl Named for dyn AnyAttention {
    fn name(&self) -> &str {
        attn_core::Attention::<f32>::name(self)
    }
}

impl DilatedAttentionOp {
    /// The op computing through `backend` on the host; tensors on a CUDA device are
    /// refused (a host backend, such as a ring rank, cannot compute them).
    pub fn new(backend: Arc<dyn AnyAttention>, options: Arc<AttnOptions>) -> Self {
        let (lse, pending) = (Arc::default(), Arc::default());
        DilatedAttentionOp { backend, options, lse, pending, on_cuda: OnCuda::Refuse }
    }

    /// The same op computing tensors on a CUDA device with the workspace's CUDA kernels
    /// (feature `cuda`; without it, such tensors are an error naming the feature).
    pub fn with_cuda_kernels(self) -> Self {
        DilatedAttentionOp { on_cuda: OnCuda::Kernels, ..self }
    }

    /// What the op does with tensors on a CUDA device.
    pub(crate) fn on_cuda(&self) -> OnCuda {
        self.on_cuda
    }

    /// The cell the forward writes its LSE into.
    pub fn lse_cell(&self) -> Arc<LseCell> {
        self.lse.clone()
    }

    fn forward_t<T: HostElement>(
        &self,
        [s1, s2, s3]: [&CpuStorage; 3],
        [l1, l2, l3]: [&Layout; 3],
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let q = view_of(TensorName::Query, slice_of::<T>(TensorName::Query, s1)?, l1).map_err(to_candle)?;
        let k = view_of(TensorName::Key, slice_of::<T>(TensorName::Key, s2)?, l2).map_err(to_candle)?;
        let v = view_of(TensorName::Value, slice_of::<T>(TensorName::Value, s3)?, l3).map_err(to_candle)?;
        let masks = self.options.masks();
        let inputs = AttnInputs::new(&self.options.config, q, k, v).with_masks(masks);
        let shape = q.shape();
        let mut out = vec![T::default(); shape.numel()];
        let mut lse = vec![0.0f32; shape.lse_len()];
        let out_view = TensorViewMut::contiguous(TensorName::Output, &mut out, shape).map_err(to_candle)?;
        T::backend(self.backend.as_ref()).forward(&inputs, out_view, &mut lse).map_err(to_candle)?;
        self.lse.put(KeptLse::Host(lse))?;
        Ok((T::to_cpu_storage_owned(out), Shape::from_dims(&shape.dims())))
    }

    /// The gradients of `sum(out * grad) + sum(lse * grad_lse)` with respect to q, k, v.
    fn backward_t<T: HostElement>(
        &self,
        qkv: [&Tensor; 3],
        out: &Tensor,
        grad: &Tensor,
        grad_lse: Option<&Tensor>,
    ) -> candle_core::Result<[Tensor; 3]> {
        // The forward of host tensors kept its LSE on the host (tensors on a CUDA device
        // take `backward_cuda`).
        let lse = self.lse.get().ok_or_else(|| {
            to_candle(attn_core::AttnError::InvalidArgument("no LSE of a forward on the host is kept".into()))
        })?;
        let grad = unit_inner(grad)?;
        let grad_lse = grad_lse.map(|g| g.flatten_all()?.to_vec1::<f32>()).transpose()?;
        let [q, k, v] = qkv;
        let (qd, kd) = (q.dims().to_vec(), k.dims().to_vec());
        let q_shape = attn_core::Shape4::from_dims(TensorName::Query, &qd).map_err(to_candle)?;
        let kv_shape = attn_core::Shape4::from_dims(TensorName::Key, &kd).map_err(to_candle)?;
        let shape = attn_core::AttnShape { q: q_shape, kv: kv_shape };
        let mut dq = vec![T::default(); q_shape.numel()];
        let (mut dk, mut dv) = (vec![T::default(); kv_shape.numel()], vec![T::default(); kv_shape.numel()]);
        with_view::<T, _>(TensorName::Query, q, |qv| {
            with_view::<T, _>(TensorName::Key, k, |kv| {
                with_view::<T, _>(TensorName::Value, v, |vv| {
                    with_view::<T, _>(TensorName::Output, out, |ov| {
                        with_view::<T, _>(TensorName::GradOutput, &grad, |gv| {
                            self.run_backward(
                                [qv, kv, vv],
                                Saved { out: ov, lse: &lse },
                                (gv, grad_lse.as_deref()),
                                Grads::contiguous(shape, [&mut dq, &mut dk, &mut dv]).map_err(to_candle)?,
                            )
                        })
                    })
                })
            })
        })?;
        let dev = q.device();
        Ok([Tensor::from_vec(dq, qd, dev)?, Tensor::from_vec(dk, kd.clone(), dev)?, Tensor::from_vec(dv, kd, dev)?])
    }

    fn run_backward<T: HostElement>(
        &self,
        [q, k, v]: [TensorView<'_, T>; 3],
        saved: Saved<'_, T>,
        (grad, grad_lse): (TensorView<'_, T>, Option<&[f32]>),
        grads: Grads<'_, T>,
    ) -> candle_core::Result<()> {
        let masks = self.options.masks();
        let inputs = AttnInputs::new(&self.options.config, q, k, v).with_masks(masks);
        T::backend(self.backend.as_ref())
            .backward_with_lse_grad(&inputs, saved, grad, grad_lse, grads)
            .map_err(to_candle)
    }

    /// The backward of a forward on a CUDA device, from the LSE it kept there.
    #[cfg(feature = "cuda")]
    fn backward_cuda(
        &self,
        qkv: [&Tensor; 3],
        out: &Tensor,
        grad: &Tensor,
        grad_lse: Option<&Tensor>,
    ) -> candle_core::Result<[Tensor; 3]> {
        let lse = match self.lse.kept() {
            Some(KeptLse::Device(lse)) => lse,
            _ => return fail(attn_core::AttnError::InvalidArgument("no LSE kept on the device".into())),
        };
        let grad = unit_inner(grad)?;
        // The kernels read the LSE's gradient as one contiguous f32 buffer.
        let grad_lse = grad_lse.map(|g| g.to_dtype(candle_core::DType::F32)?.force_contiguous()).transpose()?;
        let (o, lses) = (&self.options, (&lse, grad_lse.as_ref()));
        match qkv[0].dtype() {
            candle_core::DType::F32 => crate::cuda::backward::<f32>(o, qkv, out, &grad, lses),
            candle_core::DType::BF16 => crate::cuda::backward::<bf16>(o, qkv, out, &grad, lses),
            _ => crate::cuda::backward::<f16>(o, qkv, out, &grad, lses),
        }
    }
}

impl CustomOp3 for DilatedAttentionOp {
    fn name(&self) -> &'static str {
        "dilated-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (s, l) = ([s1, s2, s3], [l1, l2, l3]);
        match s1 {
            CpuStorage::F32(_) => self.forward_t::<f32>(s, l),
            CpuStorage::BF16(_) => self.forward_t::<bf16>(s, l),
            CpuStorage::F16(_) => self.forward_t::<f16>(s, l),
            other => fail(attn_core::AttnError::DTypeMismatch {
                tensor: TensorName::Query,
                expected: "f32, bf16 or f16",
                got: format!("{:?}", other.dtype()).to_lowercase(),
            }),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::error::check_device(&candle_core::Device::Cuda(s1.device().clone()), self.on_cuda)?;
        let (s, l) = ([s1, s2, s3], [l1, l2, l3]);
        let (out, shape, lse) = match s1.dtype() {
            candle_core::DType::F32 => crate::cuda::forward::<f32>(&self.options, s, l)?,
            candle_core::DType::BF16 => crate::cuda::forward::<bf16>(&self.options, s, l)?,
            candle_core::DType::F16 => crate::cuda::forward::<f16>(&self.options, s, l)?,
            other => {
                return fail(attn_core::AttnError::DTypeMismatch {
                    tensor: TensorName::Query,
                    expected: "f32, bf16 or f16",
                    got: format!("{other:?}").to_lowercase(),
                });
            }
        };
        self.lse.put(KeptLse::Device(lse))?;
        Ok((out, shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The LSE's gradient, where the loss reached it (`LseGradientOp`, run before this).
        let grad_lse = self.pending.take();
        let [dq, dk, dv] = self.backward_any([q, k, v], res, grad_res, grad_lse.as_ref())?;
        // Inputs candle does not track (constants) get no gradient to keep.
        let tracked = |t: &Tensor, g: Tensor| t.track_op().then_some(g);
        Ok((tracked(q, dq), tracked(k, dk), tracked(v, dv)))
    }
}

impl DilatedAttentionOp {
    /// dq, dk, dv on the device of q, of `sum(out * grad_res) + sum(lse * grad_lse)`.
    fn backward_any(
        &self,
        qkv: [&Tensor; 3],
        res: &Tensor,
        grad_res: &Tensor,
        grad_lse: Option<&Tensor>,
    ) -> candle_core::Result<[Tensor; 3]> {
        #[cfg(feature = "cuda")]
        if qkv[0].device().is_cuda() {
            return self.backward_cuda(qkv, res, grad_res, grad_lse);
        }
        match qkv[0].dtype() {
            candle_core::DType::F32 => self.backward_t::<f32>(qkv, res, grad_res, grad_lse),
            candle_core::DType::BF16 => self.backward_t::<bf16>(qkv, res, grad_res, grad_lse),
            _ => self.backward_t::<f16>(qkv, res, grad_res, grad_lse),
        }
    }
}

/// The LSE's share of the graph: a `CustomOp1` over the attention's output whose forward
/// is zeros (`[batch, seq, heads]` f32, added to the kept LSE) and whose `bwd` leaves the
/// gradient that reached the LSE for the attention op's own `bwd`. Taking the output as
/// its input makes it a consumer of the output, so candle runs its `bwd` first; the zero
/// gradient it returns for the output makes the attention's `bwd` run even where the
/// loss reaches the LSE alone. One backward thus serves both gradients (on ring ranks,
/// one collective backward per call whichever of them a rank's loss uses).
struct LseGradientOp {
    pending: Arc<PendingLseGradient>,
}

/// The LSE's gradient between `LseGradientOp::bwd` and the attention op's `bwd`.
#[derive(Debug, Default)]
struct PendingLseGradient(Mutex<Option<Tensor>>);

impl PendingLseGradient {
    fn put(&self, grad: Tensor) {
        *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(grad);
    }

    fn take(&self) -> Option<Tensor> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }
}

/// `[batch, seq, heads]` of an output laid out `[batch, seq, heads, head_dim]`.
fn lse_shape(out: &Layout) -> candle_core::Result<Shape> {
    match out.dims() {
        [b, s, h, _] => Ok(Shape::from_dims(&[*b, *s, *h])),
        d => fail(attn_core::AttnError::RankMismatch { tensor: TensorName::Output, expected: 4, got: d.len() }),
    }
}

impl candle_core::CustomOp1 for LseGradientOp {
    fn name(&self) -> &'static str {
        "dilated-attention-lse"
    }

    fn cpu_fwd(&self, _: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let shape = lse_shape(layout)?;
        Ok((CpuStorage::F32(vec![0.0; shape.elem_count()]), shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendDevice;
        let shape = lse_shape(layout)?;
        Ok((storage.device().zeros_impl(&shape, candle_core::DType::F32)?, shape))
    }

    fn bwd(&self, out: &Tensor, _res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.pending.put(grad_res.clone());
        Ok(Some(out.zeros_like()?))
    }
}

/// The output and LSE of one call.
#[derive(Debug, Clone)]
pub struct AttnOutput {
    /// `[batch, seq, heads, head_dim]`, q's dtype, differentiable.
    pub out: Tensor,
    /// `[batch, seq, heads]`, f32, differentiable: a loss of it (partial results merged
    /// by their LSEs) gets its gradients from the attention's backward. The LSE's
    /// gradient waits in the op for that backward, so after a `backward()` that failed
    /// before reaching it, build the graph again rather than differentiate it once more.
    pub lse: Tensor,
}

/// Dilated attention of `[batch, seq, heads, head_dim]` host tensors through `backend`,
/// with the LSE.
pub fn attention_on(
    backend: Arc<dyn AnyAttention>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: &AttnOptions,
) -> candle_core::Result<AttnOutput> {
    attend(DilatedAttentionOp::new(backend, Arc::new(options.clone())), q, k, v)
}

/// `op` applied to q, k, v after the checks candle would not make, with the LSE.
pub(crate) fn attend(op: DilatedAttentionOp, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<AttnOutput> {
    let (cell, pending) = (op.lse_cell(), op.pending.clone());
    let out = attend_output(op, q, k, v)?;
    let (b, s, h, _) = out.dims4()?;
    let lse = cell.tensor((b, s, h), out.device())?;
    let lse = lse.ok_or_else(|| to_candle(attn_core::AttnError::InvalidArgument("forward kept no LSE".into())))?;
    if !out.track_op() {
        return Ok(AttnOutput { out, lse });
    }
    let lse_share = out.apply_op1(LseGradientOp { pending })?;
    Ok(AttnOutput { out, lse: (lse + lse_share)? })
}

/// [`attend`] for callers that drop the LSE: the output alone, without the LSE's share of
/// the graph.
pub(crate) fn attend_output(op: DilatedAttentionOp, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
    let on_cuda = op.on_cuda();
    check_input(TensorName::Query, q, None, on_cuda)?;
    check_input(TensorName::Key, k, Some(q.dtype()), on_cuda)?;
    check_input(TensorName::Value, v, Some(q.dtype()), on_cuda)?;
    let [q, k, v] = [q, k, v].map(unit_inner);
    let (q, k, v) = (q?, k?, v?);
    q.apply_op3(&k, &v, op)
}
