//! [`RingBackend`]: ring attention behind the shared [`Attention`] interface. Each rank
//! holds one; a call passes this rank's rows (`layout.rows(seq, world, rank)` of them,
//! ascending global order) and gets exactly the single-device rows back, so a layer
//! written against `&dyn Attention<T>` runs sequence-parallel unchanged.
//!
//! Keys and values must have the queries' rows (they may have fewer heads):
//! cross-attention with `kv_seq != q_seq` is not split over ranks and is an
//! `Unsupported` error on the ranks whose lengths differ (the others get the ring's
//! `RankDisagreement`); the in-process runners refuse such global tensors with the same
//! `Unsupported` on every rank. A key padding mask covers this rank's rows (`[batch, rows]`,
//! the ranks' masks are gathered into the global one); packed sequences
//! (`cu_seqlens`) are over the GLOBAL sequence, and so is a block mask, which every rank
//! passes whole and alike (compared by digest in the call's first collective; the ring
//! moves every key row a pattern needs, removed blocks included, and skips their tiles).

use std::sync::{Mutex, MutexGuard};

use attn_core::error::TensorName;
use attn_core::{Attention, AttnInputs, Feature, Grads, Pass, Placement, Saved};
use attn_core::{
    AttnError, AttnShape, BlockMask, BlockMaskBuf, DilatedConfig, Element, KeyPaddingMask, Masks, OwnedMasks, Result,
    TensorView, TensorViewMut,
};

use crate::comm::Communicator;
use crate::compute::backward::{BackwardOutputs, ring_backward_with};
use crate::compute::forward::ring_forward_with;
use crate::plan::layout::Layout;
use crate::plan::{Plan, RingProblem, Strategy};
use crate::protocol::call::RingOptions;

/// The ring's refusal of keys/values whose length differs from the queries'
/// (cross-attention with its own key length, which the ring does not split).
pub fn cross_attention_refused() -> AttnError {
    AttnError::Unsupported { backend: "ring", feature: Feature::CrossAttention }
}

/// Attention over a sequence of `seq` global positions split across the ranks of a
/// communicator. The communicator sits behind a mutex because the interface takes
/// `&self`; calls on one rank are sequential anyway. [`RingBackend::with_options`] sets
/// the ring's [`RingOptions`] (memory budget, finite check, compute threads).
#[derive(Debug)]
pub struct RingBackend<C> {
    comm: Mutex<C>,
    seq: usize,
    layout: Layout,
    strategy: Strategy,
    options: RingOptions,
    rank: usize,
    world: usize,
}

impl<C: Communicator> RingBackend<C> {
    /// `seq` is the GLOBAL sequence length; every rank must use the same values.
    pub fn new(comm: C, seq: usize, layout: Layout, strategy: Strategy) -> Result<Self> {
        let (rank, world) = (comm.rank(), comm.world_size());
        layout.check(seq, world)?;
        Ok(RingBackend { comm: Mutex::new(comm), seq, layout, strategy, options: RingOptions::default(), rank, world })
    }

    /// Run every call with `options` (the budget and finite check must agree on all
    /// ranks, as in `ring_forward_with`; threads are this rank's choice).
    pub fn with_options(mut self, options: RingOptions) -> Self {
        self.options = options;
        self
    }

    pub fn options(&self) -> &RingOptions {
        &self.options
    }

    /// The GLOBAL sequence length.
    pub fn seq(&self) -> usize {
        self.seq
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// This rank's global positions, ascending (the rows it passes).
    pub fn positions(&self) -> Vec<usize> {
        self.layout.positions(self.seq, self.world, self.rank)
    }

    fn lock(&self) -> Result<MutexGuard<'_, C>> {
        self.comm.lock().map_err(|_| AttnError::InvalidArgument("ring communicator mutex poisoned".into()))
    }

    /// Run `f` with the communicator (e.g. to all-reduce weight gradients).
    pub fn with_comm<R>(&self, f: impl FnOnce(&mut C) -> Result<R>) -> Result<R> {
        f(&mut *self.lock()?)
    }

    /// The global problem of a call whose q has `q` and k has `kv` (this rank's shapes).
    fn problem(&self, cfg: &DilatedConfig, q: attn_core::Shape4, kv: attn_core::Shape4) -> RingProblem {
        let global = |s: attn_core::Shape4| attn_core::Shape4 { seq: self.seq, ..s };
        RingProblem::new(cfg, AttnShape { q: global(q), kv: global(kv) }, self.layout, self.strategy, self.world)
    }

    /// The call's global problem with its masks: every rank's key padding rows gathered
    /// into the global mask (a collective step: a rank whose mask does not fit its rows
    /// makes every rank fail alike), the packed sequences as given.
    fn problem_with_masks<T: Element>(&self, comm: &mut C, inputs: &AttnInputs<'_, T>) -> Result<RingProblem> {
        let (q, kv) = (inputs.q.shape(), inputs.k.shape());
        let mut masks = OwnedMasks::from(Masks { packing: inputs.masks.packing, ..Masks::NONE });
        // Status byte: 0 no mask, 1 a mask of this rank's rows follows, 2 a mask of the wrong shape.
        let mine = match inputs.masks.key_padding {
            None => vec![0u8],
            Some(m) if (m.batch(), m.seq()) == (q.batch, q.seq) => {
                std::iter::once(1u8).chain(m.flags().iter().map(|&f| u8::from(f))).collect()
            }
            Some(_) => vec![2u8],
        };
        // Nine trailing bytes: whether this rank passed a block mask and a digest of it;
        // every rank must pass the same whole-sequence mask.
        const BLOCK_TAIL: usize = 9;
        let block: Vec<u8> = match inputs.masks.block {
            None => vec![0u8; BLOCK_TAIL],
            Some(m) => std::iter::once(1u8).chain(block_mask_digest(&m).to_le_bytes()).collect(),
        };
        let mut all = comm.all_gather(mine.into_iter().chain(block.iter().copied()).collect())?;
        let tails: Vec<Vec<u8>> = all.iter_mut().map(|m| m.split_off(m.len().saturating_sub(BLOCK_TAIL))).collect();
        if tails.iter().any(|t| *t != block) {
            return Err(AttnError::RankDisagreement(
                "ranks pass different block masks (or some pass one and others not)".into(),
            ));
        }
        if let Some(m) = inputs.masks.block {
            masks = masks.with_block_mask(BlockMaskBuf::from(m));
        }
        let status: Vec<u8> = all.iter().map(|m| m.first().copied().unwrap_or(2)).collect();
        if let Some(r) = status.iter().position(|&st| st == 2) {
            return Err(AttnError::RankDisagreement(format!(
                "rank {r}'s key padding mask is not [batch, its rows] ({} x its rows on this rank)",
                q.batch
            )));
        }
        if status.iter().any(|&st| st != status[0]) {
            return Err(AttnError::RankDisagreement("some ranks pass a key padding mask and others do not".into()));
        }
        if status[0] == 1 {
            let mut global = vec![false; q.batch * self.seq];
            for (r, flags) in all.iter().enumerate() {
                let pos = self.layout.positions(self.seq, self.world, r);
                if flags.len() != 1 + q.batch * pos.len() {
                    return Err(AttnError::RankDisagreement(format!("rank {r}'s key padding mask has another batch")));
                }
                for b in 0..q.batch {
                    for (i, &p) in pos.iter().enumerate() {
                        global[b * self.seq + p] = flags[1 + b * pos.len() + i] == 1;
                    }
                }
            }
            masks = masks.with_key_padding(KeyPaddingMask::new(global, q.batch, self.seq)?);
        }
        Ok(self.problem(inputs.cfg, q, kv).with_masks(masks))
    }
}

/// FNV-1a over a block mask's sizes, block size and entries: ranks compare masks by it.
fn block_mask_digest(m: &BlockMask<'_>) -> u64 {
    let d = m.dims();
    let sizes = [d.batch, d.heads, d.q_blocks, d.k_blocks, m.block_size()];
    let bytes = sizes.iter().flat_map(|x| (*x as u64).to_le_bytes()).chain(m.keep().iter().copied());
    bytes.fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

impl<C: Communicator + Send + std::fmt::Debug, T: Element> Attention<T> for RingBackend<C> {
    fn name(&self) -> &str {
        "ring"
    }

    fn placement(&self) -> Placement {
        Placement::Shard { rank: self.rank, world: self.world }
    }

    fn query_positions(&self, local_seq: usize) -> Result<Vec<usize>> {
        let pos = self.positions();
        if pos.len() != local_seq {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Query,
                expected: vec![pos.len()],
                got: vec![local_seq],
            });
        }
        Ok(pos)
    }

    fn forward(&self, inputs: &AttnInputs<'_, T>, mut out: TensorViewMut<'_, T>, lse: &mut [f32]) -> Result<()> {
        let mut comm = self.lock()?;
        let problem = self.problem_with_masks(&mut *comm, inputs)?;
        let (qn, kn) = (inputs.q.shape().seq, inputs.k.shape().seq);
        // The ring refuses mismatched inputs collectively (every rank returns); name the cause here.
        ring_forward_with(&mut *comm, &problem, &self.options, [inputs.q, inputs.k, inputs.v], &mut out, lse)
            .map(|_| ())
            .map_err(|e| if kn != qn { cross_attention_refused() } else { e })
    }

    fn backward_with_lse_grad(
        &self,
        inputs: &AttnInputs<'_, T>,
        _saved: Saved<'_, T>,
        grad_out: TensorView<'_, T>,
        grad_lse: Option<&[f32]>,
        grads: Grads<'_, T>,
    ) -> Result<()> {
        let mut comm = self.lock()?;
        let problem = self.problem_with_masks(&mut *comm, inputs)?;
        let Grads { mut dq, mut dk, mut dv } = grads;
        let outs = BackwardOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv };
        let (qn, kn) = (inputs.q.shape().seq, inputs.k.shape().seq);
        let qkv = [inputs.q, inputs.k, inputs.v];
        ring_backward_with(&mut *comm, &problem, &self.options, qkv, grad_out, grad_lse, outs)
            .map(|_| ())
            .map_err(|e| if kn != qn { cross_attention_refused() } else { e })
    }

    /// This rank's bound from the plan (`Plan::workspace_bytes`), for the GLOBAL shape's
    /// batch, heads and head dim; `usize::MAX` where no plan exists for the problem.
    fn workspace_bytes(&self, cfg: &DilatedConfig, shape: AttnShape, pass: Pass) -> usize {
        let Ok(plan) = Plan::new(self.problem(cfg, shape.q, shape.kv)) else { return usize::MAX };
        usize::try_from(plan.workspace_bytes(T::DTYPE, self.rank, pass)).unwrap_or(usize::MAX)
    }
}
