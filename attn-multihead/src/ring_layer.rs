//! The ring-parallel layer: the same `MultiheadDilatedAttention` with its attention run by `attn-ring` over a split sequence.
//!
//! Projections, LayerNorm and dropout act row by row, so each rank runs them on its
//! own rows; only attention crosses ranks, through [`RingBackend`]. Each rank passes
//! its rows (`[batch, layout.rows(seq, world, rank), embed]`, ascending global order)
//! and gets exactly the single-rank output rows and input gradients; weight gradients
//! are per-rank partial sums, added up with [`all_reduce_grads`]. Dropout masks are
//! drawn at global positions ([`RingBackend`] reports its rows'), so training mode
//! also equals one rank.
//!
//! Keys and values must have the queries' rows: cross-attention with `kv_seq !=
//! q_seq` is not supported on the ring and is an `InvalidArgument` error on the
//! ranks whose lengths differ (the others get the ring's `RankDisagreement`).

use std::sync::{Arc, Mutex};

use attn_core::error::TensorName;
use attn_core::{AttnError, DilatedConfig, Result, TensorView, TensorViewMut};
use attn_ring::{
    BackwardOutputs, Communicator, Layout, RingOptions, RingProblem, Strategy, ring_backward_with, ring_forward_with,
};

use crate::backend::{AttentionBackend, reborrow};
use crate::config::MultiheadConfig;
use crate::float::LayerFloat;
use crate::layer::MultiheadDilatedAttention;
use crate::weights::{MultiheadWeights, NamedParams};

/// Attention over a sequence of `seq` global positions split across the ranks of a
/// communicator. The communicator sits behind a mutex because the backend interface
/// takes `&self`; calls on one rank are sequential anyway. [`RingBackend::with_options`]
/// sets the ring's [`RingOptions`] (memory budget, finite check, compute threads).
#[derive(Debug)]
pub struct RingBackend<C> {
    comm: Mutex<C>,
    seq: usize,
    layout: Layout,
    strategy: Strategy,
    options: RingOptions,
}

impl<C: Communicator> RingBackend<C> {
    /// `seq` is the GLOBAL sequence length; every rank must use the same values.
    pub fn new(comm: C, seq: usize, layout: Layout, strategy: Strategy) -> Result<Self> {
        layout.check(seq, comm.world_size())?;
        Ok(RingBackend { comm: Mutex::new(comm), seq, layout, strategy, options: RingOptions::default() })
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

    /// This rank's global positions, ascending (the rows it passes to the layer).
    pub fn positions(&self) -> Result<Vec<usize>> {
        let c = self.lock()?;
        Ok(self.layout.positions(self.seq, c.world_size(), c.rank()))
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, C>> {
        self.comm.lock().map_err(|_| AttnError::InvalidArgument("ring communicator mutex poisoned".into()))
    }

    /// The error for keys/values whose length differs from the queries' (cross-attention
    /// with its own sequence length, which the ring does not split).
    fn cross_error(q: usize, kv: usize) -> AttnError {
        AttnError::InvalidArgument(format!(
            "the ring backend needs keys/values with the queries' rows: cross-attention with kv_seq != \
             q_seq is not supported on the ring (this rank has {q} query rows and {kv} key/value rows)"
        ))
    }

    fn problem(&self, cfg: &DilatedConfig, q: &TensorView<'_, impl LayerFloat>, world: usize) -> RingProblem {
        let s = q.shape();
        RingProblem {
            cfg: cfg.clone(),
            seq: self.seq,
            batch: s.batch,
            heads: s.heads,
            head_dim: s.head_dim,
            layout: self.layout,
            strategy: self.strategy,
            world,
        }
    }

    /// Run `f` with the communicator (e.g. for [`all_reduce_grads`]).
    pub fn with_comm<R>(&self, f: impl FnOnce(&mut C) -> Result<R>) -> Result<R> {
        f(&mut *self.lock()?)
    }
}

impl<C: Communicator + Send + std::fmt::Debug, F: LayerFloat> AttentionBackend<F> for RingBackend<C> {
    fn name(&self) -> &'static str {
        "ring"
    }

    fn query_positions(&self, local_seq: usize) -> Result<Option<Vec<usize>>> {
        let pos = self.positions()?;
        if pos.len() != local_seq {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Query,
                expected: vec![pos.len()],
                got: vec![local_seq],
            });
        }
        Ok(Some(pos))
    }

    fn forward(
        &self,
        cfg: &DilatedConfig,
        q: TensorView<'_, F>,
        k: TensorView<'_, F>,
        v: TensorView<'_, F>,
        out: &mut TensorViewMut<'_, F>,
        lse: &mut [f32],
    ) -> Result<()> {
        let mut comm = self.lock()?;
        let problem = self.problem(cfg, &q, comm.world_size());
        let (qn, kn) = (q.shape().seq, k.shape().seq);
        // The ring refuses mismatched inputs collectively (every rank returns); name the cause here.
        ring_forward_with(&mut *comm, &problem, &self.options, q, k, v, out, lse)
            .map(|_| ())
            .map_err(|e| if kn != qn { Self::cross_error(qn, kn) } else { e })
    }

    fn backward(
        &self,
        cfg: &DilatedConfig,
        q: TensorView<'_, F>,
        k: TensorView<'_, F>,
        v: TensorView<'_, F>,
        _out: TensorView<'_, F>,
        _lse: &[f32],
        grad_out: TensorView<'_, F>,
        dq: &mut TensorViewMut<'_, F>,
        dk: &mut TensorViewMut<'_, F>,
        dv: &mut TensorViewMut<'_, F>,
    ) -> Result<()> {
        let mut comm = self.lock()?;
        let problem = self.problem(cfg, &q, comm.world_size());
        // Views of one lifetime, as `BackwardOutputs` wants.
        let mut dq = reborrow(TensorName::GradQuery, dq)?;
        let mut dk = reborrow(TensorName::GradKey, dk)?;
        let mut dv = reborrow(TensorName::GradValue, dv)?;
        let outs = BackwardOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv };
        let (qn, kn) = (q.shape().seq, k.shape().seq);
        ring_backward_with(&mut *comm, &problem, &self.options, [q, k, v], grad_out, outs)
            .map(|_| ())
            .map_err(|e| if kn != qn { Self::cross_error(qn, kn) } else { e })
    }
}

/// A ring-parallel `MultiheadDilatedAttention`: the layer on a [`RingBackend`].
/// Use `forward`/`forward_train`/`backward` of the returned layer with this rank's rows.
pub fn ring_layer<F: LayerFloat, C: Communicator + Send + std::fmt::Debug + 'static>(
    config: MultiheadConfig,
    weights: MultiheadWeights<F>,
    backend: Arc<RingBackend<C>>,
) -> Result<MultiheadDilatedAttention<F>> {
    MultiheadDilatedAttention::from_weights(config, weights, backend)
}

/// Sum every parameter gradient over all ranks (in rank order, so every rank gets
/// bit-identical totals).
pub fn all_reduce_grads<F: LayerFloat, C: Communicator + ?Sized>(
    comm: &mut C,
    grads: &mut impl NamedParams<F>,
) -> Result<()> {
    let mut payload = Vec::new();
    for p in grads.params() {
        p.data.iter().for_each(|x| x.push_le(&mut payload));
    }
    let all = comm.all_gather(payload.clone())?;
    let size = std::mem::size_of::<F>();
    if all.iter().any(|b| b.len() != payload.len()) {
        return Err(AttnError::RankDisagreement("gradient buffers differ in size across ranks".into()));
    }
    let mut offset = 0;
    for p in grads.params_mut() {
        for (i, x) in p.data.iter_mut().enumerate() {
            let at = offset + i * size;
            *x = all.iter().fold(F::zero(), |acc, b| acc + F::from_le(&b[at..at + size]));
        }
        offset += std::mem::size_of_val(&*p.data);
    }
    Ok(())
}
