//! Ring attention over a torch.distributed group: one rank's forward and exact backward
//! on its rows (`attn_ring::ring_forward_with` / `ring_backward_with` over a
//! `GroupedComm` of [`TorchP2p`] rounds), with the interpreter released while the ring
//! computes.
//!
//! The global sequence length is agreed first: every rank's row count is all-gathered
//! over the same transport, and counts that are not the layout's split of their sum are
//! `RankDisagreement` on every rank. Masks and `cu_seqlens` are whole-sequence values;
//! the ring's handshake compares them (by digest) with every other rank's.

use std::time::Duration;

use attn_core::{AttnError, AttnShape, DilatedConfig, Element, Result, Shape4};
use attn_ring::comm::GroupedComm;
use attn_ring::{BackwardOutputs, Communicator, Layout, RingOptions, RingProblem, Strategy};
use pyo3::prelude::*;

use crate::call::{BackwardArgs, CheckedBackward, ForwardArgs, MaskArgs, checked_backward, checked_forward, lse_dims};
use crate::call::{by_dtype, read_masks};
use crate::torch_p2p::TorchP2p;

/// What every call of one rank shares: the transport, its place in the group, the
/// layout, the strategy, the timeout and the compute threads.
#[derive(Debug)]
pub struct RingSetup {
    pub rank: usize,
    pub world: usize,
    pub layout: Layout,
    pub strategy: Strategy,
    pub timeout: Duration,
    pub threads: usize,
}

impl RingSetup {
    pub(crate) fn comm(&self, transport: Py<PyAny>) -> Result<GroupedComm<TorchP2p>> {
        Ok(GroupedComm::with_transport(TorchP2p::new(transport, self.rank, self.world, self.timeout)?))
    }

    fn options(&self) -> RingOptions {
        RingOptions::default().with_threads(self.threads)
    }

    /// The call's global problem: the sequence length agreed over `comm`, the global
    /// shapes of q and k with that length, and the whole-sequence masks.
    pub(crate) fn problem<C: Communicator>(
        &self,
        comm: &mut C,
        cfg: &DilatedConfig,
        q: Shape4,
        kv: Shape4,
        masks: attn_core::OwnedMasks,
    ) -> Result<RingProblem> {
        let seq = agree_seq(comm, self.layout, q.seq)?;
        let global = |s: Shape4| Shape4 { seq, ..s };
        let shape = AttnShape { q: global(q), kv: global(kv) };
        Ok(RingProblem::new(cfg, shape, self.layout, self.strategy, self.world).with_masks(masks))
    }
}

/// The global sequence length from every rank's `rows`: their sum, where each rank holds
/// exactly the layout's share of it (the same verdict on every rank).
pub fn agree_seq<C: Communicator>(comm: &mut C, layout: Layout, rows: usize) -> Result<usize> {
    let all = comm.all_gather((rows as u64).to_le_bytes().to_vec())?;
    let world = comm.world_size();
    let mut counts = Vec::with_capacity(all.len());
    for (r, bytes) in all.iter().enumerate() {
        let word: [u8; 8] = bytes.as_slice().try_into().map_err(|_| AttnError::Comm {
            rank: comm.rank(),
            message: format!("rank {r} sent a row count of {} bytes", bytes.len()),
        })?;
        counts.push(usize::try_from(u64::from_le_bytes(word)).unwrap_or(usize::MAX));
    }
    let seq = counts.iter().try_fold(0usize, |s, &n| s.checked_add(n));
    let seq = seq.ok_or_else(|| AttnError::RankDisagreement(format!("row counts {counts:?} overflow")))?;
    layout.check(seq, world)?;
    for (r, &n) in counts.iter().enumerate() {
        let want = layout.rows(seq, world, r);
        if n != want {
            return Err(AttnError::RankDisagreement(format!(
                "rank {r} holds {n} rows, but the {} layout of {seq} rows over {world} ranks gives it {want} \
                 (row counts {counts:?})",
                layout.as_str()
            )));
        }
    }
    Ok(seq)
}

/// After a failed call: a `Comm` or `Timeout` error may leave transfers posted that no
/// later round matches, so the transport's group is marked broken (`mark_broken(why)`)
/// and refuses later calls; other errors are reached by every rank alike and leave the
/// group in step.
pub(crate) fn after_call(py: Python<'_>, rank: usize, transport: &Py<PyAny>, result: Result<()>) -> Result<()> {
    if let Err(e @ (AttnError::Comm { .. } | AttnError::Timeout { .. })) = &result {
        transport.bind(py).call_method1("mark_broken", (e.to_string(),)).map_err(|err| AttnError::Comm {
            rank,
            message: format!("{e}; marking the group broken failed too: {err}"),
        })?;
    }
    result
}

/// Run this rank's forward: writes `out` and `lse` (this rank's rows).
pub fn forward(
    py: Python<'_>,
    setup: &RingSetup,
    transport: Py<PyAny>,
    cfg: &DilatedConfig,
    args: &ForwardArgs,
    masks: &MaskArgs,
) -> Result<()> {
    let result = by_dtype!(&args.q, forward_typed(py, setup, transport.clone_ref(py), cfg, args, masks));
    after_call(py, setup.rank, &transport, result)
}

fn forward_typed<T: Element>(
    py: Python<'_>,
    setup: &RingSetup,
    transport: Py<PyAny>,
    cfg: &DilatedConfig,
    args: &ForwardArgs,
    mask_args: &MaskArgs,
) -> Result<()> {
    let [q, k, v, out, lse] = checked_forward::<T>(args)?;
    let owned = read_masks(mask_args, &[&out, &lse])?;
    let (qv, kv, vv) = (q.view::<T>()?, k.view::<T>()?, v.view::<T>()?);
    let mut out_view = out.view_mut::<T>()?;
    let lse = lse.contiguous_f32_mut(&lse_dims(&q))?;
    let mut comm = setup.comm(transport)?;
    let opts = setup.options();
    py.detach(move || {
        let problem = setup.problem(&mut comm, cfg, qv.shape(), kv.shape(), owned)?;
        attn_ring::ring_forward_with(&mut comm, &problem, &opts, [qv, kv, vv], &mut out_view, lse).map(|_| ())
    })
}

/// Run this rank's backward: writes `dq`, `dk` and `dv` (this rank's rows). The ring
/// recomputes the forward, so the saved `out` and `lse` are only checked.
pub fn backward(
    py: Python<'_>,
    setup: &RingSetup,
    transport: Py<PyAny>,
    cfg: &DilatedConfig,
    args: &BackwardArgs,
    masks: &MaskArgs,
) -> Result<()> {
    let result = by_dtype!(&args.q, backward_typed(py, setup, transport.clone_ref(py), cfg, args, masks));
    after_call(py, setup.rank, &transport, result)
}

fn backward_typed<T: Element>(
    py: Python<'_>,
    setup: &RingSetup,
    transport: Py<PyAny>,
    cfg: &DilatedConfig,
    args: &BackwardArgs,
    mask_args: &MaskArgs,
) -> Result<()> {
    if args.scratch.is_some() {
        return Err(AttnError::InvalidArgument("scratch is taken by the CUDA backward only".into()));
    }
    let CheckedBackward { saved: [q, k, v, _out, _lse], grad_out, grad_lse, grads: [dq, dk, dv] } =
        checked_backward::<T>(args)?;
    let owned = read_masks(mask_args, &[&dq, &dk, &dv])?;
    let (qv, kv, vv) = (q.view::<T>()?, k.view::<T>()?, v.view::<T>()?);
    let grad_out = grad_out.view::<T>()?;
    let grad_lse = grad_lse.map(|g| g.contiguous_f32(&lse_dims(&q))).transpose()?;
    let (mut dq, mut dk, mut dv) = (dq.view_mut::<T>()?, dk.view_mut::<T>()?, dv.view_mut::<T>()?);
    let mut comm = setup.comm(transport)?;
    let opts = setup.options();
    py.detach(move || {
        let problem = setup.problem(&mut comm, cfg, qv.shape(), kv.shape(), owned)?;
        let outs = BackwardOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv };
        attn_ring::ring_backward_with(&mut comm, &problem, &opts, [qv, kv, vv], grad_out, grad_lse, outs).map(|_| ())
    })
}

#[cfg(test)]
mod tests {
    use attn_ring::ThreadComm;

    use super::*;

    /// `agree_seq` on in-process ranks holding `rows[r]` rows each: every rank's result.
    fn agree(layout: Layout, rows: &[usize]) -> Vec<Result<usize>> {
        let comms = ThreadComm::world_with_timeout(rows.len(), Duration::from_secs(5)).unwrap();
        let handles: Vec<_> = comms
            .into_iter()
            .zip(rows.to_vec())
            .map(|(mut c, n)| std::thread::spawn(move || agree_seq(&mut c, layout, n)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn the_sequence_is_the_sum_of_the_layouts_shares() {
        let zig: Vec<usize> = (0..3).map(|r| Layout::Zigzag.rows(50, 3, r)).collect();
        for got in agree(Layout::Zigzag, &zig) {
            assert_eq!(got.unwrap(), 50);
        }
        for got in agree(Layout::Contiguous, &[16, 17, 17]) {
            assert_eq!(got.unwrap(), 50);
        }
    }

    #[test]
    fn rows_that_are_not_the_layouts_share_fail_every_rank() {
        // 50 rows split contiguously over 3 ranks are 16, 17, 17.
        for got in agree(Layout::Contiguous, &[17, 17, 16]) {
            let err = got.unwrap_err();
            assert!(matches!(err, AttnError::RankDisagreement(ref m) if m.contains("rank 0 holds 17 rows")), "{err}");
        }
        for got in agree(Layout::Contiguous, &[0, 1]) {
            assert!(matches!(got.unwrap_err(), AttnError::InvalidArgument(_)));
        }
    }
}
