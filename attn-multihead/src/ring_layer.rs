//! The ring-parallel layer (feature `ring`): the same `MultiheadDilatedAttention` with its attention run by `attn-ring` over a split sequence.
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
//! q_seq` is not supported on the ring and is an `Unsupported` error on the
//! ranks whose lengths differ (the others get the ring's `RankDisagreement`).

use std::sync::Arc;

use attn_core::{AttnError, Result};
use attn_ring::{Communicator, RingBackend};

use crate::config::MultiheadConfig;
use crate::float::LayerFloat;
use crate::layer::MultiheadDilatedAttention;
use crate::weights::{MultiheadWeights, NamedParams};

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
