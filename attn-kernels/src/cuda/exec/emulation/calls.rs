//! The emulation's block and whole-call steps on host buffers, as the device's
//! (`crate::cuda::forward_block`, `forward_call`, `backward_call`, `backward_block`), and
//! the epilogue launches they use (store, lse fill, delta).

use std::ffi::c_void;

use attn_core::error::TensorName;
use attn_core::{AttnError, Result, Shape4};

use super::Emulator;
use super::buffers::{HostAccs, HostArgs, HostOuts, check_buffers, missing, need};
use crate::cuda::exec::call::ForwardPath;
use crate::cuda::exec::epilogue::{delta_kernel, row_params, store_kernel};
use crate::cuda::exec::scratch::{HostMemory, ScratchPool, ScratchSlot, backward_slots};
use crate::cuda::exec::tensor::{CudaElement, fill_launch};
use crate::cuda::plan::launch_plan::{
    BlockGeometry, DirectGrads, plan_backward, plan_backward_direct, plan_forward, plan_forward_direct,
};
use crate::cuda::plan::patterns::{BackwardWrites, out_scale};

impl Emulator {
    /// [`crate::cuda::forward_block`] on host buffers: LSE-merge the block into `acc.q_acc`
    /// (out) and `acc.lse`.
    pub fn forward_block<T: CudaElement>(
        &self,
        g: &BlockGeometry<'_>,
        a: &HostArgs<'_, T>,
        acc: HostAccs<'_>,
    ) -> Result<()> {
        self.forward_block_in(g, a, acc, None)
    }

    /// [`forward_block`](Self::forward_block), a persistent launch's work counter from `pool`.
    fn forward_block_in<T: CudaElement>(
        &self,
        g: &BlockGeometry<'_>,
        a: &HostArgs<'_, T>,
        acc: HostAccs<'_>,
        pool: Option<&mut ScratchPool<Vec<f32>>>,
    ) -> Result<()> {
        check_buffers(g, a, &acc)?;
        self.execute(&plan_forward(g, T::DTYPE, T::SUFFIX, self.forward)?, a, acc, HostOuts::default(), pool)
    }

    /// [`crate::cuda::forward_call`] on host buffers: the forward of a whole call (`g`
    /// without packing offsets past the call, `g.g_strides` the output's contiguous
    /// strides) written into `out` (in `T`, q's shape) and `lse`, straight from the kernel
    /// under [`ForwardPath::Direct`] where that applies, through a partial from `pool`
    /// otherwise (as the device takes it from its stream's pool).
    pub fn forward_call<T: CudaElement>(
        &self,
        g: &BlockGeometry<'_>,
        a: &HostArgs<'_, T>,
        path: ForwardPath,
        (out, lse): (&mut [T], &mut [f32]),
        pool: &mut ScratchPool<Vec<f32>>,
    ) -> Result<()> {
        let shape = g.q.0;
        if g.g_strides != Some(shape.contiguous_strides()) {
            return Err(AttnError::InvalidArgument("a whole-call forward writes a contiguous output".into()));
        }
        need(TensorName::Output, out.len(), shape.numel())?;
        let direct = match path {
            ForwardPath::Direct => plan_forward_direct(g, T::DTYPE, T::SUFFIX, self.forward)?,
            ForwardPath::Partial => None,
        };
        self.fill_lse::<T>(lse, f32::NEG_INFINITY)?;
        let Some(plan) = direct else {
            let mut partial = pool.take(&HostMemory, ScratchSlot::PartialOut, shape.numel())?;
            partial.fill(0.0);
            let acc = HostAccs { q_acc: &mut partial, lse: Some(lse), dk: None, dv: None };
            let done = self
                .forward_block_in(g, a, acc, Some(&mut *pool))
                .and_then(|()| self.store_scaled(shape, &partial, out_scale(g.cfg), out));
            pool.give(ScratchSlot::PartialOut, partial);
            return done;
        };
        // The direct kernels never read the accumulator: an empty one passes the checks.
        let mut none = vec![0.0f32; shape.numel()];
        let acc = HostAccs { q_acc: &mut none, lse: Some(lse), dk: None, dv: None };
        check_buffers(g, a, &acc)?;
        out.fill(T::default());
        self.execute(&plan, a, acc, HostOuts { out: Some(out), ..HostOuts::default() }, Some(pool))
    }

    /// [`crate::cuda::backward_call`] on host buffers: the gradients of a whole call (`a`
    /// holding q, k, v, grad_out, the forward's lse and the key padding; `out` the forward's
    /// output) written into `dq`, `dk`, `dv` (in `T`, contiguous), the f32 accumulators and
    /// delta taken from `pool` and given back, as the device's pooled call does.
    pub fn backward_call<T: CudaElement>(
        &self,
        g: &BlockGeometry<'_>,
        a: &HostArgs<'_, T>,
        (out, grad_lse): (&[T], Option<&[f32]>),
        pool: &mut ScratchPool<Vec<f32>>,
        [dq, dk, dv]: [&mut [T]; 3],
    ) -> Result<()> {
        let (qs, ks) = (g.q.0, g.k.0);
        let (go, lse) = (a.g.ok_or_else(|| missing("grad_out"))?, a.lse.ok_or_else(|| missing("the lse"))?);
        // Direct gradients where asked and planned (the outputs are contiguous; so must the
        // inputs be, to be laid out like them).
        let allowed = DirectGrads::from_parts(
            g.q.1 == qs.contiguous_strides(),
            g.k.1 == ks.contiguous_strides() && g.v_strides == ks.contiguous_strides(),
        );
        let direct = match (self.backward.writes, allowed) {
            (BackwardWrites::Direct, Some(allowed)) => {
                plan_backward_direct(g, T::DTYPE, T::SUFFIX, self.backward, allowed)?
            }
            _ => None,
        };
        let slots = backward_slots(qs, ks, direct.as_ref().map(|d| d.grads));
        let mut bufs: [Option<Vec<f32>>; 4] = Default::default();
        for (buf, slot) in bufs.iter_mut().zip(slots) {
            *buf = slot.map(|(slot, len)| pool.take(&HostMemory, slot, len)).transpose()?;
        }
        let done = (|| {
            let [delta, dq_acc, dk_acc, dv_acc] = &mut bufs;
            let delta = delta.as_mut().ok_or_else(|| missing("delta scratch"))?;
            self.delta_into(qs, go, out, grad_lse.map(|g| (g, lse)), delta)?;
            let args = HostArgs { delta: Some(&delta[..]), ..*a };
            for acc in [&mut *dq_acc, &mut *dk_acc, &mut *dv_acc].into_iter().flatten() {
                acc.fill(0.0);
            }
            // Accumulated gradients need their scratch; direct ones none (an empty stand-in
            // passes the checks, the direct kernels never read it).
            let mut none = Vec::new();
            match &direct {
                Some(plan) => {
                    let q_acc = match dq_acc.as_mut() {
                        Some(acc) => acc,
                        None => {
                            none = vec![0.0f32; qs.numel()];
                            &mut none
                        }
                    };
                    let acc = HostAccs { q_acc, lse: None, dk: dk_acc.as_deref_mut(), dv: dv_acc.as_deref_mut() };
                    check_buffers(g, &args, &acc)?;
                    let dq_out = plan.grads.dq().then(|| {
                        dq.fill(T::default());
                        &mut *dq
                    });
                    let dkv = plan.grads.dkv().then(|| {
                        dk.fill(T::default());
                        dv.fill(T::default());
                        (&mut *dk, &mut *dv)
                    });
                    self.execute(&plan.launches, &args, acc, HostOuts { out: None, dq: dq_out, dkv }, None)?;
                }
                None => {
                    let (Some(q_acc), Some(dk), Some(dv)) = (dq_acc.as_mut(), dk_acc.as_mut(), dv_acc.as_mut()) else {
                        return Err(missing("every accumulator"));
                    };
                    let acc = HostAccs { q_acc, lse: None, dk: Some(&mut dk[..]), dv: Some(&mut dv[..]) };
                    self.backward_block(g, &args, acc)?;
                }
            }
            drop(none);
            if let Some(acc) = dq_acc {
                self.store_scaled(qs, acc, 1.0, dq)?;
            }
            if let (Some(dk_acc), Some(dv_acc)) = (dk_acc, dv_acc) {
                self.store_scaled(ks, dk_acc, 1.0, dk)?;
                self.store_scaled(ks, dv_acc, 1.0, dv)?;
            }
            Ok(())
        })();
        for (buf, slot) in bufs.into_iter().zip(slots) {
            if let (Some(buf), Some((slot, _))) = (buf, slot) {
                pool.give(slot, buf);
            }
        }
        done
    }

    /// [`crate::cuda::backward_block`] on host buffers: add the block's gradients to
    /// `acc.q_acc` (dq), `acc.dk` and `acc.dv`.
    pub fn backward_block<T: CudaElement>(
        &self,
        g: &BlockGeometry<'_>,
        a: &HostArgs<'_, T>,
        acc: HostAccs<'_>,
    ) -> Result<()> {
        if g.g_strides.is_none() {
            return Err(missing("grad_out strides"));
        }
        check_buffers(g, a, &acc)?;
        self.execute(&plan_backward(g, T::DTYPE, T::SUFFIX, self.backward)?, a, acc, HostOuts::default(), None)
    }

    /// [`crate::cuda::store_scaled`] into a contiguous host tensor: `dst = scale * src` in `T`.
    pub fn store_scaled<T: CudaElement>(&self, shape: Shape4, src: &[f32], scale: f32, dst: &mut [T]) -> Result<()> {
        need(TensorName::Other("f32 source"), src.len(), shape.numel())?;
        need(TensorName::Output, dst.len(), shape.numel())?;
        let strides = shape.contiguous_strides();
        let mut p = row_params(shape, strides, strides, scale);
        let (name, lc) = store_kernel(T::SUFFIX, shape, strides, dst.as_ptr() as u64, size_of::<T>());
        let (mut s, mut d) = (src.as_ptr(), dst.as_mut_ptr());
        let mut args: Vec<*mut c_void> = vec![(&raw mut s).cast(), (&raw mut d).cast(), (&raw mut p).cast()];
        self.launch(&name, lc, &mut args)
    }

    /// The device's lse fill (`fill_lse_*` of `T`'s module): every value of `dst` set to `value`.
    pub fn fill_lse<T: CudaElement>(&self, dst: &mut [f32], value: f32) -> Result<()> {
        let (mut d, mut v, mut n) = (dst.as_mut_ptr(), value, dst.len() as i64);
        let mut args: Vec<*mut c_void> = vec![(&raw mut d).cast(), (&raw mut v).cast(), (&raw mut n).cast()];
        let lc = fill_launch(dst.len());
        self.launch(&format!("fill_lse_{}", T::SUFFIX), lc, &mut args)
    }

    /// [`crate::cuda::delta`] of contiguous host tensors: `dot(grad_out, out) - grad_lse`
    /// per row, `lse_grad` being `(grad_lse, lse)` (`grad_lse` read where `lse` is finite).
    pub fn delta<T: CudaElement>(
        &self,
        shape: Shape4,
        grad_out: &[T],
        out: &[T],
        lse_grad: Option<(&[f32], &[f32])>,
    ) -> Result<Vec<f32>> {
        let mut delta = vec![0.0f32; shape.lse_len()];
        self.delta_into(shape, grad_out, out, lse_grad, &mut delta)?;
        Ok(delta)
    }

    /// [`Self::delta`] written into `delta`.
    pub fn delta_into<T: CudaElement>(
        &self,
        shape: Shape4,
        grad_out: &[T],
        out: &[T],
        lse_grad: Option<(&[f32], &[f32])>,
        delta: &mut [f32],
    ) -> Result<()> {
        need(TensorName::GradOutput, grad_out.len(), shape.numel())?;
        need(TensorName::Output, out.len(), shape.numel())?;
        need(TensorName::Other("delta"), delta.len(), shape.lse_len())?;
        if let Some((g, l)) = lse_grad {
            need(TensorName::GradLse, g.len(), shape.lse_len())?;
            need(TensorName::Lse, l.len(), shape.lse_len())?;
        }
        let strides = shape.contiguous_strides();
        let mut p = row_params(shape, strides, strides, 1.0);
        let at = |x: &[T]| (strides, x.as_ptr() as u64);
        let (name, lc) = delta_kernel(T::SUFFIX, shape, [at(grad_out), at(out)], size_of::<T>())?;
        let (mut g, mut o, mut dl) = (grad_out.as_ptr(), out.as_ptr(), delta.as_mut_ptr());
        let (mut gl, mut l) = lse_grad.map_or((std::ptr::null(), std::ptr::null()), |(g, l)| (g.as_ptr(), l.as_ptr()));
        let mut args: Vec<*mut c_void> = vec![
            (&raw mut g).cast(),
            (&raw mut o).cast(),
            (&raw mut gl).cast(),
            (&raw mut l).cast(),
            (&raw mut dl).cast(),
            (&raw mut p).cast(),
        ];
        self.launch(&name, lc, &mut args)
    }
}
