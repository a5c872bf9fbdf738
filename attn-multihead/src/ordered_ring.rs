//! The Hilbert option on the ring layer: a grid's tokens serialised along a curve, each rank attending over its curve chunk.
//!
//! The global sequence of the ring is the CURVE order of the grid (global position
//! `i` is token `order[i]`), split over the ranks by a [`Layout`]. With a Hilbert
//! order and the contiguous layout each rank's chunk is a compact spatial patch.
//! Projections, norms and dropout act per token, so permuting the layer's input and
//! restoring its output is the same as permuting around attention only (see
//! [`crate::OrderedAttention`], the single-device form): callers keep row-major tokens.
//!
//! Two ways to pass tokens, both row-major:
//! - whole: every rank passes the full `[batch, grid.len(), embed]` tensor
//!   ([`OrderedRing::forward`]); the rank gathers its chunk (`Permutation::apply_range`)
//!   and every rank gets the full row-major output (chunks all-gathered and put
//!   back with `Permutation::unapply_range`);
//! - split: each rank passes only the rows of its tokens [`OrderedRing::tokens`]
//!   (ascending row-major index), `[batch, tokens().len(), embed]`
//!   ([`OrderedRing::forward`] with [`RankRows::Split`]), and gets its output rows in the same order.
//!
//! Weight gradients are per-rank partial sums in both forms; add them up with
//! [`OrderedRing::all_reduce_grads`].
//!
//! The option is reachable from the layer: a ring layer built with
//! [`crate::ring_layer()`] on a [`RingBackend`] of `grid.len()` positions becomes an
//! `OrderedRing` with [`MultiheadDilatedAttention::with_ring_token_order`]
//! (equivalently [`OrderedRing::from_layer`], or [`OrderedRing::new`] from the
//! config, weights and communicator):
//!
//! ```
//! use std::sync::Arc;
//! use attn_hilbert::{Grid, OrderKind};
//! use attn_core::DilatedConfig;
//! use attn_multihead::{Call, MultiheadConfig, MultiheadWeights, ring_layer};
//! use attn_ring::{Layout, RingBackend, Strategy, ThreadComm};
//! # fn main() -> attn_core::Result<()> {
//! let cfg = MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2])?);
//! let grid = Grid::new_2d(6, 10)?; // 60 row-major tokens
//! let x = vec![0.5f32; 60 * 8]; // [batch 1, 60, embed 8], row-major
//! let outs = std::thread::scope(|s| {
//!     let ranks: Vec<_> = ThreadComm::world(2)?
//!         .into_iter()
//!         .map(|comm| {
//!             let (cfg, x) = (cfg.clone(), &x);
//!             s.spawn(move || -> attn_core::Result<Vec<f32>> {
//!                 let w = MultiheadWeights::magneto(&cfg, 7);
//!                 let backend = Arc::new(RingBackend::new(comm, grid.len(), Layout::Contiguous, Strategy::Auto)?);
//!                 let layer = ring_layer(cfg, w, backend.clone())?;
//!                 let ring = layer.with_ring_token_order(backend, grid, OrderKind::Hilbert)?;
//!                 assert_eq!(ring.tokens().len(), 30); // a compact 30-token patch of the grid
//!                 ring.forward(x, &Call::new(1, grid.len())) // the whole row-major output, on every rank
//!             })
//!         })
//!         .collect();
//!     ranks.into_iter().map(|h| h.join().expect("rank")).collect::<attn_core::Result<Vec<_>>>()
//! })?;
//! assert_eq!(outs[0], outs[1]);
//! # Ok(()) }
//! ```

use std::ops::Range;
use std::sync::Arc;

use attn_core::{AttnError, Result};
use attn_hilbert::{Grid, OrderKind, Permutation, TokenLayout, TokenOrder};
use attn_ring::{Communicator, Layout, Strategy};

use crate::call::{Call, RankRows};
use crate::config::MultiheadConfig;
use crate::float::LayerFloat;
use crate::layer::{MultiheadCache, MultiheadDilatedAttention};
use crate::ring_layer::{all_reduce_grads, ring_layer};
use crate::weights::MultiheadWeights;
use attn_ring::RingBackend;

/// What [`OrderedRing::backward`] needs: this rank's layer cache, the batch and the
/// rows the forward call passed.
#[derive(Debug, Clone)]
pub struct OrderedRingCache<F: LayerFloat> {
    inner: MultiheadCache<F>,
    batch: usize,
    rows: RankRows,
}

/// A ring-parallel [`MultiheadDilatedAttention`] over the tokens of a 2D/3D grid in curve order.
#[derive(Debug)]
pub struct OrderedRing<F: LayerFloat, C> {
    /// The layer on a [`RingBackend`]; it sees this rank's curve chunk.
    pub layer: MultiheadDilatedAttention<F>,
    backend: Arc<RingBackend<C>>,
    order: TokenOrder,
    /// Every rank's curve positions (`all_ranges[rank]`), ascending.
    all_ranges: Vec<Vec<Range<usize>>>,
    rank: usize,
    /// This rank's row-major tokens, ascending.
    tokens: Vec<usize>,
    /// Local curve row `j` holds split row `local.order()[j]`.
    local: Permutation,
}

impl<F: LayerFloat, C: Communicator + Send + std::fmt::Debug + 'static> OrderedRing<F, C> {
    /// The layer `config`/`weights` with attention over `grid` serialised by `kind`,
    /// split over the ranks of `comm` by `layout`, attention by `strategy`. Every rank
    /// must pass the same arguments (except `comm`).
    pub fn new(
        config: MultiheadConfig,
        weights: MultiheadWeights<F>,
        kind: OrderKind,
        grid: Grid,
        comm: C,
        layout: Layout,
        strategy: Strategy,
    ) -> Result<Self> {
        let backend = Arc::new(RingBackend::new(comm, grid.len(), layout, strategy)?);
        let layer = ring_layer(config, weights, backend.clone())?;
        Self::from_layer(layer, backend, kind, grid)
    }

    /// `layer` (its config and weights) with attention over `grid` serialised by
    /// `kind`, run on `backend`, whose global sequence must be the grid
    /// (`backend.seq() == grid.len()`); the layer's attention is rebound to
    /// `backend`. Every rank must pass the same arguments (except the communicator).
    pub fn from_layer(
        layer: MultiheadDilatedAttention<F>,
        backend: Arc<RingBackend<C>>,
        kind: OrderKind,
        grid: Grid,
    ) -> Result<Self> {
        let order = TokenOrder::new(kind, grid)?;
        let n = order.len();
        if backend.seq() != n {
            return Err(AttnError::InvalidArgument(format!(
                "the ring backend spans {} positions but the {grid} grid has {n} tokens",
                backend.seq()
            )));
        }
        let layout = backend.layout();
        let (rank, world) = backend.with_comm(|c| Ok((c.rank(), c.world_size())))?;
        let all_ranges: Vec<Vec<Range<usize>>> = (0..world).map(|r| layout.ranges(n, world, r)).collect();
        let curve = order.permutation().order();
        let curve_tokens: Vec<usize> = all_ranges[rank].iter().flat_map(|r| curve[r.clone()].iter().copied()).collect();
        let mut tokens = curve_tokens.clone();
        tokens.sort_unstable();
        let local = Permutation::from_order(curve_tokens.iter().map(|t| tokens.partition_point(|u| u < t)).collect())?;
        let layer = layer.with_backend(backend.clone());
        Ok(OrderedRing { layer, backend, order, all_ranges, rank, tokens, local })
    }

    pub fn order(&self) -> &TokenOrder {
        &self.order
    }

    /// This rank's global (curve) positions: its chunk of the curve-ordered sequence.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.all_ranges[self.rank]
    }

    /// This rank's tokens as row-major grid indices, ascending: the rows of a split input.
    pub fn tokens(&self) -> &[usize] {
        &self.tokens
    }

    pub fn backend(&self) -> &Arc<RingBackend<C>> {
        &self.backend
    }

    fn embed(&self) -> usize {
        self.layer.config().embed_dim
    }

    fn check_len(&self, what: &str, len: usize, batch: usize, rows: usize) -> Result<()> {
        let e = self.embed();
        let want = batch.checked_mul(rows).and_then(|v| v.checked_mul(e));
        if batch == 0 || want != Some(len) {
            return Err(AttnError::InvalidArgument(format!(
                "{what} of {len} elements is not [{batch}, {rows}, {e}] (batch >= 1)"
            )));
        }
        Ok(())
    }

    /// The rows of this rank's tokens (ascending) from a whole row-major `[batch, grid.len(), embed]` tensor.
    pub fn split(&self, whole: &[F], batch: usize) -> Result<Vec<F>> {
        let (e, n) = (self.embed(), self.order.len());
        self.check_len("whole tensor", whole.len(), batch, n)?;
        let mut out = Vec::with_capacity(batch * self.tokens.len() * e);
        for b in 0..batch {
            for &t in &self.tokens {
                out.extend_from_slice(&whole[(b * n + t) * e..][..e]);
            }
        }
        Ok(out)
    }

    /// Curve chunk `[batch, rows, e]` of this rank from a whole row-major tensor (`apply_range` per range).
    fn chunk_of_whole(&self, whole: &[F], batch: usize) -> Result<Vec<F>> {
        let (e, n, m) = (self.embed(), self.order.len(), self.tokens.len());
        self.check_len("whole tensor", whole.len(), batch, n)?;
        let perm = self.order.permutation();
        let mut chunk = vec![F::zero(); batch * m * e];
        let mut offset = 0;
        for r in self.ranges() {
            let mut part = vec![F::zero(); batch * r.len() * e];
            perm.apply_range(r.clone(), batch, e, whole, &mut part)?;
            for (b, rows) in part.chunks_exact(r.len() * e).enumerate() {
                chunk[(b * m + offset) * e..][..rows.len()].copy_from_slice(rows);
            }
            offset += r.len();
        }
        Ok(chunk)
    }

    /// Every rank's curve chunk, all-gathered and restored to a whole row-major tensor (`unapply_range`).
    fn whole_of_chunks(&self, chunk: &[F], batch: usize) -> Result<Vec<F>> {
        let (e, n) = (self.embed(), self.order.len());
        let mut payload = Vec::with_capacity(std::mem::size_of_val(chunk));
        chunk.iter().for_each(|x| x.push_le(&mut payload));
        let all = self.backend.with_comm(|c| c.all_gather(payload))?;
        if all.len() != self.all_ranges.len() {
            return Err(AttnError::RankDisagreement(format!(
                "all_gather returned {} chunks for {} ranks",
                all.len(),
                self.all_ranges.len()
            )));
        }
        let size = std::mem::size_of::<F>();
        let perm = self.order.permutation();
        let mut whole = vec![F::zero(); batch * n * e];
        for (bytes, ranges) in all.iter().zip(&self.all_ranges) {
            let m: usize = ranges.iter().map(|r| r.len()).sum();
            if bytes.len() != batch * m * e * size {
                return Err(AttnError::RankDisagreement("output chunks differ in size from the layout".into()));
            }
            let chunk: Vec<F> = bytes.chunks_exact(size).map(F::from_le).collect();
            let mut offset = 0;
            for r in ranges {
                let mut part = Vec::with_capacity(batch * r.len() * e);
                for b in 0..batch {
                    part.extend_from_slice(&chunk[(b * m + offset) * e..][..r.len() * e]);
                }
                perm.unapply_range(r.clone(), batch, e, &part, &mut whole)?;
                offset += r.len();
            }
        }
        Ok(whole)
    }

    /// Split rows (ascending tokens) to this rank's curve chunk.
    fn chunk_of_split(&self, split: &[F], batch: usize) -> Result<Vec<F>> {
        let m = self.tokens.len();
        self.check_len("split tensor", split.len(), batch, m)?;
        let mut chunk = vec![F::zero(); split.len()];
        self.local.apply(&TokenLayout::bse(batch, m, self.embed())?, split, &mut chunk)?;
        Ok(chunk)
    }

    /// This rank's curve chunk back to split rows (ascending tokens).
    fn split_of_chunk(&self, chunk: &[F], batch: usize) -> Result<Vec<F>> {
        let mut split = vec![F::zero(); chunk.len()];
        self.local.unapply(&TokenLayout::bse(batch, self.tokens.len(), self.embed())?, chunk, &mut split)?;
        Ok(split)
    }

    /// The rows a call passes (`call.rows`): `grid.len()` for [`RankRows::Whole`],
    /// `tokens().len()` for [`RankRows::Split`]; self-attention without masks.
    fn check_call(&self, call: &Call<'_, F>) -> Result<()> {
        call.self_attention_only("OrderedRing")?;
        call.no_masks("OrderedRing")?;
        let want = match call.rows {
            RankRows::Whole => self.order.len(),
            RankRows::Split => self.tokens.len(),
        };
        if call.seq != want {
            return Err(AttnError::InvalidArgument(format!(
                "a {:?} call passes {want} rows on this rank, got seq {}",
                call.rows, call.seq
            )));
        }
        Ok(())
    }

    /// This rank's curve chunk of `x`, whole or split rows.
    fn chunk_of(&self, x: &[F], batch: usize, rows: RankRows) -> Result<Vec<F>> {
        match rows {
            RankRows::Whole => self.chunk_of_whole(x, batch),
            RankRows::Split => self.chunk_of_split(x, batch),
        }
    }

    /// A curve chunk back to the call's rows: the whole row-major tensor (all ranks'
    /// chunks gathered) or this rank's split rows.
    fn rows_of(&self, chunk: &[F], batch: usize, rows: RankRows) -> Result<Vec<F>> {
        match rows {
            RankRows::Whole => self.whole_of_chunks(chunk, batch),
            RankRows::Split => self.split_of_chunk(chunk, batch),
        }
    }

    /// Self-attention over row-major tokens: with [`RankRows::Whole`] `x` is the whole
    /// `[batch, grid.len(), embed]` and every rank returns the whole output; with
    /// [`RankRows::Split`] `x` is this rank's rows `[batch, tokens().len(), embed]`
    /// (ascending tokens), and so is the output.
    pub fn forward(&self, x: &[F], call: &Call<'_, F>) -> Result<Vec<F>> {
        self.check_call(call)?;
        let (batch, m) = (call.batch, self.tokens.len());
        let y = self.layer.forward(&self.chunk_of(x, batch, call.rows)?, &Call { seq: m, ..*call })?;
        self.rows_of(&y, batch, call.rows)
    }

    /// [`OrderedRing::forward`], keeping this rank's cache for [`OrderedRing::backward`].
    pub fn forward_train(&self, x: &[F], call: &Call<'_, F>) -> Result<(Vec<F>, OrderedRingCache<F>)> {
        self.check_call(call)?;
        let (batch, m) = (call.batch, self.tokens.len());
        let (y, inner) = self.layer.forward_train(&self.chunk_of(x, batch, call.rows)?, &Call { seq: m, ..*call })?;
        Ok((self.rows_of(&y, batch, call.rows)?, OrderedRingCache { inner, batch, rows: call.rows }))
    }

    /// Gradient of the input from `grad_out`, both in the rows of the forward call
    /// (whole: every rank returns all of it; split: this rank's rows); this rank's
    /// partial weight gradients accumulate into `grads`.
    pub fn backward(
        &self,
        cache: &OrderedRingCache<F>,
        grad_out: &[F],
        grads: &mut MultiheadWeights<F>,
    ) -> Result<Vec<F>> {
        let (batch, rows) = (cache.batch, cache.rows);
        let dx = self.layer.backward(&cache.inner, &self.chunk_of(grad_out, batch, rows)?, grads)?.query;
        self.rows_of(&dx, batch, rows)
    }

    /// Sum the per-rank weight gradients over all ranks (every rank gets identical totals).
    pub fn all_reduce_grads(&self, grads: &mut MultiheadWeights<F>) -> Result<()> {
        self.backend.with_comm(|c| all_reduce_grads(c, grads))
    }
}

impl<F: LayerFloat> MultiheadDilatedAttention<F> {
    /// The Hilbert option on the ring: this layer (its config and weights) with
    /// attention over the row-major tokens of `grid` serialised by `kind`, split
    /// over the ranks of `backend` (whose global sequence must be `grid.len()`);
    /// with a Hilbert order and the contiguous layout each rank gets a compact
    /// spatial patch. See [`OrderedRing::from_layer`] and the
    /// [module docs](crate::ordered_ring) for an example.
    pub fn with_ring_token_order<C: Communicator + Send + std::fmt::Debug + 'static>(
        self,
        backend: Arc<RingBackend<C>>,
        grid: Grid,
        kind: OrderKind,
    ) -> Result<OrderedRing<F, C>> {
        OrderedRing::from_layer(self, backend, kind, grid)
    }
}
