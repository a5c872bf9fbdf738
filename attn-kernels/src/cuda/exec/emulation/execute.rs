//! Running planned launches on the emulation: each launch's arguments pointed at the host
//! buffers in the kernel's order, the sm_90a launches given their tensor maps, and a
//! persistent launch's work counter checked to be left zeroed.

use std::ffi::c_void;

use attn_core::Result;
use attn_core::error::TensorName;
use cudarc::driver::LaunchConfig;

use super::buffers::{HostAccs, HostArgs, HostOuts, at, at_mut, missing, need};
use super::{Emulator, emu_err, maps};
use crate::cuda::exec::scratch::{HostMemory, ScratchPool, ScratchSlot, WORK_COUNTER_LEN};
use crate::cuda::exec::tensor::CudaElement;
use crate::cuda::plan::launch_plan::{Planned, Signature};

/// Blocks a persistent launch's grid is cut to in the emulation (the device's: SMs times
/// blocks an SM holds): fewer than most launches' items, so blocks take several each.
const EMULATED_RESIDENT_BLOCKS: u32 = 3;

impl Emulator {
    /// Run planned launches on host buffers (`outs`: what direct launches write), the
    /// persistent ones' work counter from `pool` where there is one (else a new one).
    pub(super) fn execute<T: CudaElement>(
        &self,
        plan: &[Planned],
        a: &HostArgs<'_, T>,
        acc: HostAccs<'_>,
        outs: HostOuts<'_, T>,
        pool: Option<&mut ScratchPool<Vec<f32>>>,
    ) -> Result<()> {
        if !plan.iter().any(|p| p.work) {
            return self.execute_with(plan, a, acc, outs, &mut []);
        }
        let mut fresh = ScratchPool::default();
        let pool = pool.unwrap_or(&mut fresh);
        let mut work = pool.take(&HostMemory, ScratchSlot::WorkCounter, WORK_COUNTER_LEN)?;
        let done = self.execute_with(plan, a, acc, outs, &mut work);
        // Each launch's last block zeroes the counter: the next launch needs no fill.
        let left = work.iter().map(|w| w.to_bits()).collect::<Vec<u32>>();
        pool.give(ScratchSlot::WorkCounter, work);
        done?;
        match left.iter().all(|&w| w == 0) {
            true => Ok(()),
            false => Err(emu_err(format!("a persistent launch left its work counter at {left:?}, not zeroed"))),
        }
    }

    /// [`execute`](Self::execute) with the work counter `work` (empty where no launch is
    /// persistent).
    fn execute_with<T: CudaElement>(
        &self,
        plan: &[Planned],
        a: &HostArgs<'_, T>,
        acc: HostAccs<'_>,
        outs: HostOuts<'_, T>,
        work: &mut [f32],
    ) -> Result<()> {
        let HostAccs { q_acc, mut lse, mut dk, mut dv } = acc;
        let HostOuts { out: mut direct, dq: mut dq_out, mut dkv } = outs;
        let start = |s: &[T]| s.as_ptr() as u64;
        let g_start = a.g.map(start).or_else(|| direct.as_deref().map(start));
        let starts = [Some(start(a.q)), Some(start(a.k)), Some(start(a.v)), g_start];
        for planned in plan {
            let (p, maps) = maps::hopper_launch(&self.lib, planned, ([a.q, a.k, a.v], a.g), starts)?;
            let o = p.offsets;
            let mut params = p.params_at(starts, size_of::<T>());
            if p.kpad {
                params.kpad += a.kpad.ok_or_else(|| missing("a key padding mask"))?.as_ptr() as u64;
            }
            if p.bmask {
                params.bmask += a.bmask.ok_or_else(|| missing("a block mask"))?.as_ptr() as u64;
            }
            let mut grid_dim = p.grid;
            if p.work {
                need(TensorName::Other("work counter"), work.len(), WORK_COUNTER_LEN)?;
                params.work = work.as_mut_ptr() as u64;
                grid_dim.0 = grid_dim.0.min(EMULATED_RESIDENT_BLOCKS);
            }
            let (mut q, mut k, mut v) =
                (at(TensorName::Query, a.q, o.q)?, at(TensorName::Key, a.k, o.k)?, at(TensorName::Value, a.v, o.v)?);
            let mut args: Vec<*mut c_void> =
                vec![(&raw mut q).cast::<c_void>(), (&raw mut k).cast::<c_void>(), (&raw mut v).cast::<c_void>()];
            let (mut out, mut lse_acc);
            let (mut g, mut l, mut dl, mut dq, mut dkp, mut dvp);
            let (mut out_t, mut dqo, mut dko, mut dvo);
            if matches!(p.signature, Signature::Forward | Signature::ForwardDirect) {
                if p.signature == Signature::Forward {
                    out = at_mut(TensorName::Output, q_acc, o.q_acc)?;
                    args.push((&raw mut out).cast());
                } else {
                    let dst = direct.as_deref_mut().ok_or_else(|| missing("an output"))?;
                    out_t = at_mut(TensorName::Output, dst, o.g)?;
                    args.push((&raw mut out_t).cast());
                }
                let lse = lse.as_deref_mut().ok_or_else(|| missing("an lse accumulator"))?;
                lse_acc = at_mut(TensorName::Lse, lse, o.q_rows)?;
                args.push((&raw mut lse_acc).cast());
            } else {
                g = at(TensorName::GradOutput, a.g.ok_or_else(|| missing("grad_out"))?, o.g)?;
                l = at(TensorName::Lse, a.lse.ok_or_else(|| missing("the lse"))?, o.q_rows)?;
                dl = at(TensorName::Other("delta"), a.delta.ok_or_else(|| missing("delta"))?, o.q_rows)?;
                args.extend([(&raw mut g).cast(), (&raw mut l).cast(), (&raw mut dl).cast()]);
                if p.signature == Signature::BackwardDq && p.params.out_direct != 0 {
                    dqo = at_mut(TensorName::GradQuery, dq_out.as_deref_mut().ok_or_else(|| missing("dq"))?, o.q)?;
                    args.push((&raw mut dqo).cast());
                } else if matches!(p.signature, Signature::BackwardAll | Signature::BackwardDq) {
                    dq = at_mut(TensorName::GradQuery, q_acc, o.q_acc)?;
                    args.push((&raw mut dq).cast());
                }
                if matches!(p.signature, Signature::BackwardAll | Signature::BackwardDkv) && p.params.out_direct != 0 {
                    let (dk_out, dv_out) = dkv.as_mut().ok_or_else(|| missing("dk and dv"))?;
                    dko = at_mut(TensorName::GradKey, dk_out, o.k)?;
                    dvo = at_mut(TensorName::GradValue, dv_out, o.v)?;
                    args.extend([(&raw mut dko).cast(), (&raw mut dvo).cast()]);
                } else if matches!(p.signature, Signature::BackwardAll | Signature::BackwardDkv) {
                    dkp = at_mut(TensorName::GradKey, dk.as_deref_mut().ok_or_else(|| missing("dk"))?, o.k_acc)?;
                    dvp = at_mut(TensorName::GradValue, dv.as_deref_mut().ok_or_else(|| missing("dv"))?, o.k_acc)?;
                    args.extend([(&raw mut dkp).cast(), (&raw mut dvp).cast()]);
                }
            }
            args.push((&raw mut params).cast());
            let mut map_ptr = maps.as_ref().map(maps::EmulatedMaps::as_ptr);
            if let Some(m) = map_ptr.as_mut() {
                args.push((m as *mut *const c_void).cast());
            }
            let lc = LaunchConfig { grid_dim, block_dim: (p.threads, 1, 1), shared_mem_bytes: p.smem_bytes };
            self.launch(&p.kernel, lc, &mut args)?;
        }
        Ok(())
    }
}
