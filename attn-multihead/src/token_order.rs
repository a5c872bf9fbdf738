//! The Hilbert option: run a layer on a 2D/3D token grid serialised along a curve (permute before, restore after).
//!
//! Projections, norms and dropout act per token and commute with a permutation, so
//! permuting the layer input once and restoring its output once is the same as
//! permuting around attention only. The caller keeps row-major tokens throughout.
//!
//! The option is reached from the layer itself with
//! [`MultiheadDilatedAttention::with_token_order`] (one device) or
//! `MultiheadDilatedAttention::with_ring_token_order` (the ring, feature `ring`; see the
//! `ordered_ring` module):
//!
//! ```
//! use std::sync::Arc;
//! use attn_hilbert::{Grid, OrderKind};
//! use attn_multihead::{Mode, MultiheadConfig, MultiheadDilatedAttention, ReferenceBackend};
//! # fn main() -> attn_core::Result<()> {
//! let cfg = MultiheadConfig::new(8, 2, &[4, 8], &[1, 2]);
//! let layer = MultiheadDilatedAttention::<f32>::new(cfg, 7, Arc::new(ReferenceBackend))?;
//! let grid = Grid::new_2d(6, 10)?; // 60 tokens, row-major
//! let hilbert = layer.with_token_order(grid, OrderKind::Hilbert)?;
//! let x = vec![0.25f32; 2 * 60 * 8]; // [batch 2, 60, embed 8], row-major
//! let y = hilbert.forward(&x, 2, 60, Mode::Eval)?; // row-major output; segments are spatial patches
//! assert_eq!(y.len(), x.len());
//! // Cross-attention: queries on `grid`, keys/values on their own grid (here 4x5).
//! let kv = vec![0.5f32; 2 * 20 * 8];
//! let (y, cache) = hilbert.forward_cross(&x, &kv, &kv, 2, Grid::new_2d(4, 5)?, Mode::Eval)?;
//! let mut grads = hilbert.layer.zero_grads();
//! let g = hilbert.backward_cross(&cache, &y, &mut grads)?; // row-major dq, dk, dv
//! assert_eq!(g.key.map(|k| k.len()), Some(kv.len()));
//! # Ok(()) }
//! ```
//!
//! # Cross-attention through an order
//!
//! Queries are tokens of the layer's grid in its order; keys and values are tokens
//! of a key grid, serialised by the same kind of curve on THEIR grid. Dilated
//! attention pairs query segment `s` with key segment `s` (SPEC.md), so when both
//! grids are equal query and key segments cover the same spatial patch; with
//! different grids segment `s` of each is still a compact patch of its own grid,
//! which is what the unordered layer does with two unrelated sequences.
//!
//! Causal cross-attention over two DIFFERENT grids through a curve (Hilbert or
//! Z-order) is refused with [`AttnError::InvalidArgument`]: causality compares a
//! query's position on one curve with a key's position on another curve, which
//! orders nothing spatial or temporal (there is no common sequence for "earlier"
//! to refer to). On the same grid both sides share one curve, so curve-causal
//! masking is well defined and allowed; with row-major order the option is the
//! plain layer, so causal cross-attention is allowed on any grids.

use attn_core::{AttnError, Result};
use attn_hilbert::{Grid, OrderKind, TokenLayout, TokenOrder};

use crate::dropout::Mode;
use crate::float::LayerFloat;
use crate::layer::{InputGrads, MultiheadCache, MultiheadDilatedAttention};
use crate::weights::MultiheadWeights;

impl<F: LayerFloat> MultiheadDilatedAttention<F> {
    /// This layer for inputs that are the row-major tokens of `grid`, with attention
    /// over the grid serialised by `kind` (the Hilbert option on one device): see
    /// [`OrderedAttention`] and the [module docs](crate::token_order).
    pub fn with_token_order(self, grid: Grid, kind: OrderKind) -> Result<OrderedAttention<F>> {
        OrderedAttention::new(self, kind, grid)
    }
}

/// What [`OrderedAttention::backward_cross`] needs: the layer's cache, the batch
/// size and the key order of the forward pass.
#[derive(Debug, Clone)]
pub struct OrderedCrossCache<F> {
    inner: MultiheadCache<F>,
    key_order: TokenOrder,
    batch: usize,
}

impl<F> OrderedCrossCache<F> {
    /// The order the keys and values were serialised by.
    pub fn key_order(&self) -> &TokenOrder {
        &self.key_order
    }
}

/// A [`MultiheadDilatedAttention`] whose attention sees the tokens of `grid` in `kind` order.
#[derive(Debug, Clone)]
pub struct OrderedAttention<F: LayerFloat> {
    pub layer: MultiheadDilatedAttention<F>,
    order: TokenOrder,
}

impl<F: LayerFloat> OrderedAttention<F> {
    /// Wrap `layer` for inputs that are `grid` (row-major) tokens, serialised by `kind`.
    pub fn new(layer: MultiheadDilatedAttention<F>, kind: OrderKind, grid: Grid) -> Result<Self> {
        Ok(OrderedAttention { layer, order: TokenOrder::new(kind, grid)? })
    }

    /// The Hilbert (gilbert) order of a `height x width` grid.
    pub fn hilbert_2d(layer: MultiheadDilatedAttention<F>, height: usize, width: usize) -> Result<Self> {
        Self::new(layer, OrderKind::Hilbert, Grid::new_2d(height, width)?)
    }

    pub fn order(&self) -> &TokenOrder {
        &self.order
    }

    /// `x: [batch, order.len(), embed]` from row-major to `order` (`forward`) or back.
    fn permute_by(&self, order: &TokenOrder, what: &str, x: &[F], batch: usize, forward: bool) -> Result<Vec<F>> {
        let (e, n) = (self.layer.config().embed_dim, order.len());
        let layout = TokenLayout::bse(batch, n, e)?;
        if layout.numel()? != x.len() {
            return Err(AttnError::InvalidArgument(format!(
                "{what} of {} elements is not [{batch}, {n}, {e}] (the {} grid {} has {n} tokens)",
                x.len(),
                order.kind().as_str(),
                order.grid()
            )));
        }
        let mut out = attn_kernels::zeroed_buffer(x.len())?;
        let perm = order.permutation();
        if forward {
            perm.apply(&layout, x, &mut out)?
        } else {
            perm.unapply(&layout, x, &mut out)?
        }
        Ok(out)
    }

    fn permute(&self, x: &[F], batch: usize, seq: usize, forward: bool) -> Result<Vec<F>> {
        if seq != self.order.len() {
            return Err(AttnError::InvalidArgument(format!(
                "sequence of {seq} tokens but the {} grid has {}",
                self.order.kind().as_str(),
                self.order.len()
            )));
        }
        self.permute_by(&self.order, "buffer", x, batch, forward)
    }

    /// The order of keys on `key_grid`: the layer's order on its own grid, the same
    /// kind of curve on another grid, or an error where that is ill-defined
    /// (causal attention across two different curves; see the module docs).
    pub fn key_order(&self, key_grid: Grid) -> Result<TokenOrder> {
        if key_grid == self.order.grid() {
            return Ok(self.order.clone());
        }
        let kind = self.order.kind();
        if self.layer.config().causal && kind != OrderKind::RowMajor {
            return Err(AttnError::InvalidArgument(format!(
                "causal cross-attention through a {} order needs keys on the query grid {} (got {key_grid}): \
                 positions on two different curves have no common order",
                kind.as_str(),
                self.order.grid()
            )));
        }
        TokenOrder::new(kind, key_grid)
    }

    /// Cross-attention: row-major `query: [batch, grid.len(), embed]` and
    /// `key`/`value: [batch, key_grid.len(), embed]` (row-major on `key_grid`).
    /// Queries follow the layer's order and keys/values `key_order(key_grid)`;
    /// the output is row-major on the query grid.
    pub fn forward_cross(
        &self,
        query: &[F],
        key: &[F],
        value: &[F],
        batch: usize,
        key_grid: Grid,
        mode: Mode,
    ) -> Result<(Vec<F>, OrderedCrossCache<F>)> {
        let key_order = self.key_order(key_grid)?;
        let qp = self.permute_by(&self.order, "query", query, batch, true)?;
        let kp = self.permute_by(&key_order, "key", key, batch, true)?;
        let vp = self.permute_by(&key_order, "value", value, batch, true)?;
        let (n, m) = (self.order.len(), key_order.len());
        let (yp, inner) = self.layer.forward_cross(&qp, &kp, &vp, batch, n, m, mode)?;
        let y = self.permute_by(&self.order, "output", &yp, batch, false)?;
        Ok((y, OrderedCrossCache { inner, key_order, batch }))
    }

    /// Row-major gradients of query, key and value from the row-major `grad_out`
    /// of [`OrderedAttention::forward_cross`]; weight gradients accumulate into `grads`.
    pub fn backward_cross(
        &self,
        cache: &OrderedCrossCache<F>,
        grad_out: &[F],
        grads: &mut MultiheadWeights<F>,
    ) -> Result<InputGrads<F>> {
        let (batch, ko) = (cache.batch, &cache.key_order);
        let gp = self.permute_by(&self.order, "grad_out", grad_out, batch, true)?;
        let g = self.layer.backward(&cache.inner, &gp, grads)?;
        let restore = |what, t: Option<Vec<F>>| -> Result<Vec<F>> {
            let t = t.ok_or_else(|| AttnError::InvalidArgument(format!("cross-attention backward gave no {what}")))?;
            self.permute_by(ko, what, &t, batch, false)
        };
        Ok(InputGrads {
            query: self.permute_by(&self.order, "grad query", &g.query, batch, false)?,
            key: Some(restore("grad key", g.key)?),
            value: Some(restore("grad value", g.value)?),
        })
    }

    /// Self-attention over row-major tokens `x: [batch, grid.len(), embed]`.
    pub fn forward(&self, x: &[F], batch: usize, seq: usize, mode: Mode) -> Result<Vec<F>> {
        let xp = self.permute(x, batch, seq, true)?;
        let yp = self.layer.forward(&xp, batch, seq, mode)?;
        self.permute(&yp, batch, seq, false)
    }

    /// Like [`OrderedAttention::forward`], keeping the cache for backward.
    pub fn forward_train(&self, x: &[F], batch: usize, seq: usize, mode: Mode) -> Result<(Vec<F>, MultiheadCache<F>)> {
        let xp = self.permute(x, batch, seq, true)?;
        let (yp, cache) = self.layer.forward_train(&xp, batch, seq, mode)?;
        Ok((self.permute(&yp, batch, seq, false)?, cache))
    }

    /// Gradient of the row-major input; weight gradients accumulate into `grads`.
    pub fn backward(
        &self,
        cache: &MultiheadCache<F>,
        grad_out: &[F],
        batch: usize,
        seq: usize,
        grads: &mut MultiheadWeights<F>,
    ) -> Result<Vec<F>> {
        let gp = self.permute(grad_out, batch, seq, true)?;
        let dxp = self.layer.backward(cache, &gp, grads)?.query;
        self.permute(&dxp, batch, seq, false)
    }
}
