//! [`RingBackend`]: ring attention behind the shared [`Attention`] interface. Each rank
//! holds one; a call passes this rank's rows (`layout.rows(seq, world, rank)` of them,
//! ascending global order) and gets exactly the single-device rows back, so a layer
//! written against `&dyn Attention<T>` runs sequence-parallel unchanged.
//!
//! Keys and values must have the queries' rows: cross-attention with `kv_seq != q_seq`
//! is not split over ranks and is an `InvalidArgument` error on the ranks whose lengths
//! differ (the others get the ring's `RankDisagreement`).

use std::sync::{Mutex, MutexGuard};

use attn_core::error::TensorName;
use attn_core::{Attention, AttnInputs, Grads, Pass, Placement, Saved, Supported};
use attn_core::{AttnError, AttnShape, DilatedConfig, Element, Result, TensorView, TensorViewMut};

use crate::comm::Communicator;
use crate::compute::backward::{BackwardOutputs, ring_backward_with};
use crate::compute::forward::ring_forward_with;
use crate::plan::layout::Layout;
use crate::plan::{Plan, RingProblem, Strategy};
use crate::protocol::call::RingOptions;

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

    /// The error for keys/values whose length differs from the queries' (cross-attention
    /// with its own sequence length, which the ring does not split).
    /// The features the ring does not compute yet, refused on every rank alike (each
    /// rank sees the same config and masks) before any message is sent.
    fn refuse_features<T: Element>(inputs: &AttnInputs<'_, T>) -> Result<()> {
        inputs.shape_for("ring", Supported::NONE).map(|_| ())
    }

    fn cross_error(q: usize, kv: usize) -> AttnError {
        AttnError::InvalidArgument(format!(
            "the ring backend needs keys/values with the queries' rows: cross-attention with kv_seq != \
             q_seq is not supported on the ring (this rank has {q} query rows and {kv} key/value rows)"
        ))
    }

    fn problem(&self, cfg: &DilatedConfig, shape: attn_core::Shape4) -> RingProblem {
        RingProblem {
            cfg: cfg.clone(),
            seq: self.seq,
            batch: shape.batch,
            heads: shape.heads,
            head_dim: shape.head_dim,
            layout: self.layout,
            strategy: self.strategy,
            world: self.world,
        }
    }
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
        Self::refuse_features(inputs)?;
        let mut comm = self.lock()?;
        let problem = self.problem(inputs.cfg, inputs.q.shape());
        let (qn, kn) = (inputs.q.shape().seq, inputs.k.shape().seq);
        // The ring refuses mismatched inputs collectively (every rank returns); name the cause here.
        ring_forward_with(&mut *comm, &problem, &self.options, [inputs.q, inputs.k, inputs.v], &mut out, lse)
            .map(|_| ())
            .map_err(|e| if kn != qn { Self::cross_error(qn, kn) } else { e })
    }

    fn backward(
        &self,
        inputs: &AttnInputs<'_, T>,
        _saved: Saved<'_, T>,
        grad_out: TensorView<'_, T>,
        grads: Grads<'_, T>,
    ) -> Result<()> {
        Self::refuse_features(inputs)?;
        let mut comm = self.lock()?;
        let problem = self.problem(inputs.cfg, inputs.q.shape());
        let Grads { mut dq, mut dk, mut dv } = grads;
        let outs = BackwardOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv };
        let (qn, kn) = (inputs.q.shape().seq, inputs.k.shape().seq);
        ring_backward_with(&mut *comm, &problem, &self.options, [inputs.q, inputs.k, inputs.v], grad_out, outs)
            .map(|_| ())
            .map_err(|e| if kn != qn { Self::cross_error(qn, kn) } else { e })
    }

    /// This rank's bound from the plan (`Plan::workspace_bytes`), for the GLOBAL shape's
    /// batch, heads and head dim; `usize::MAX` where no plan exists for the problem.
    fn workspace_bytes(&self, cfg: &DilatedConfig, shape: AttnShape, pass: Pass) -> usize {
        let Ok(plan) = Plan::new(self.problem(cfg, shape.q)) else { return usize::MAX };
        usize::try_from(plan.workspace_bytes(T::DTYPE, self.rank, pass)).unwrap_or(usize::MAX)
    }
}
