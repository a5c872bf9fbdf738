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
//! use attn_core::DilatedConfig;
//! use attn_multihead::{Call, Cross, MultiheadConfig, MultiheadDilatedAttention, ReferenceBackend};
//! # fn main() -> attn_core::Result<()> {
//! let cfg = MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2])?);
//! let layer = MultiheadDilatedAttention::<f32>::new(cfg, 7, Arc::new(ReferenceBackend))?;
//! let grid = Grid::new_2d(6, 10)?; // 60 tokens, row-major
//! let hilbert = layer.with_token_order(grid, OrderKind::Hilbert)?;
//! let x = vec![0.25f32; 2 * 60 * 8]; // [batch 2, 60, embed 8], row-major
//! let y = hilbert.forward(&x, &Call::new(2, 60))?; // row-major output; segments are spatial patches
//! assert_eq!(y.len(), x.len());
//! // Cross-attention: queries on `grid`, keys/values on their own grid (here 4x5).
//! let kv = vec![0.5f32; 2 * 20 * 8];
//! let call = Call::new(2, 60).cross(Cross::on_grid(&kv, &kv, Grid::new_2d(4, 5)?));
//! let (y, cache) = hilbert.forward_train(&x, &call)?;
//! let mut grads = hilbert.layer.zero_grads();
//! let g = hilbert.backward(&cache, &y, &mut grads)?; // row-major dq, dk, dv
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

use crate::call::{Call, Cross, KeyRows};
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

/// What [`OrderedAttention::backward`] needs: the layer's cache, the batch size and,
/// for cross-attention, the key order of the forward pass.
#[derive(Debug, Clone)]
pub struct OrderedCache<F: LayerFloat> {
    inner: MultiheadCache<F>,
    key_order: Option<TokenOrder>,
    batch: usize,
}

impl<F: LayerFloat> OrderedCache<F> {
    /// The order the keys and values were serialised by (cross-attention only).
    pub fn key_order(&self) -> Option<&TokenOrder> {
        self.key_order.as_ref()
    }
}

/// Which way a permutation runs: row-major tokens to the curve order, or back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    ToOrder,
    ToRowMajor,
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

    /// `x: [batch, order.len(), embed]` from row-major to `order` or back.
    fn permute_by(&self, order: &TokenOrder, what: &str, x: &[F], batch: usize, way: Way) -> Result<Vec<F>> {
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
        match way {
            Way::ToOrder => perm.apply(&layout, x, &mut out)?,
            Way::ToRowMajor => perm.unapply(&layout, x, &mut out)?,
        }
        Ok(out)
    }

    /// The queries' sequence must be the grid's tokens.
    fn check_seq(&self, seq: usize) -> Result<()> {
        if seq != self.order.len() {
            return Err(AttnError::InvalidArgument(format!(
                "sequence of {seq} tokens but the {} grid has {}",
                self.order.kind().as_str(),
                self.order.len()
            )));
        }
        Ok(())
    }

    /// The order of keys on `key_grid`: the layer's order on its own grid, the same
    /// kind of curve on another grid, or an error where that is ill-defined
    /// (causal attention across two different curves; see the module docs).
    pub fn key_order(&self, key_grid: Grid) -> Result<TokenOrder> {
        if key_grid == self.order.grid() {
            return Ok(self.order.clone());
        }
        let kind = self.order.kind();
        if self.layer.config().attention.causal() && kind != OrderKind::RowMajor {
            return Err(AttnError::InvalidArgument(format!(
                "causal cross-attention through a {} order needs keys on the query grid {} (got {key_grid}): \
                 positions on two different curves have no common order",
                kind.as_str(),
                self.order.grid()
            )));
        }
        TokenOrder::new(kind, key_grid)
    }

    /// The key order of a cross call: on `Cross::on_grid`'s grid, or on the query grid
    /// when the keys are as many as its tokens.
    fn cross_key_order(&self, rows: KeyRows) -> Result<TokenOrder> {
        match rows {
            KeyRows::Grid(g) => self.key_order(g),
            KeyRows::Seq(n) if n == self.order.len() => Ok(self.order.clone()),
            KeyRows::Seq(n) => Err(AttnError::InvalidArgument(format!(
                "{n} keys through a {} order need their grid (Cross::on_grid)",
                self.order.kind().as_str()
            ))),
        }
    }

    /// Run `f` (the layer's forward or training forward) on the call with every input
    /// in curve order; returns its output back in row-major order, its cache, and the
    /// key order of a cross call. Masks are refused (they would need the same order).
    fn ordered<R>(
        &self,
        x: &[F],
        call: &Call<'_, F>,
        f: impl FnOnce(&[F], &Call<'_, F>) -> Result<(Vec<F>, R)>,
    ) -> Result<(Vec<F>, R, Option<TokenOrder>)> {
        call.no_masks("OrderedAttention")?;
        self.check_seq(call.seq)?;
        let (batch, order) = (call.batch, &self.order);
        let xp = self.permute_by(order, "query", x, batch, Way::ToOrder)?;
        let (yp, kept, key_order) = match call.cross {
            None => {
                let (yp, kept) = f(&xp, call)?;
                (yp, kept, None)
            }
            Some(c) => {
                let ko = self.cross_key_order(c.rows)?;
                let kp = self.permute_by(&ko, "key", c.key, batch, Way::ToOrder)?;
                let vp = self.permute_by(&ko, "value", c.value, batch, Way::ToOrder)?;
                let (yp, kept) = f(&xp, &Call { cross: Some(Cross::new(&kp, &vp, ko.len())), ..*call })?;
                (yp, kept, Some(ko))
            }
        };
        Ok((self.permute_by(order, "output", &yp, batch, Way::ToRowMajor)?, kept, key_order))
    }

    /// The layer over row-major tokens `x: [batch, grid.len(), embed]` (`call.seq` is
    /// `grid.len()`); cross-attention keys are row-major on their grid
    /// ([`Cross::on_grid`]) and follow [`Self::key_order`]. The output is row-major.
    pub fn forward(&self, x: &[F], call: &Call<'_, F>) -> Result<Vec<F>> {
        Ok(self.ordered(x, call, |xp, c| Ok((self.layer.forward(xp, c)?, ())))?.0)
    }

    /// [`Self::forward`] keeping the cache for [`Self::backward`].
    pub fn forward_train(&self, x: &[F], call: &Call<'_, F>) -> Result<(Vec<F>, OrderedCache<F>)> {
        let (y, inner, key_order) = self.ordered(x, call, |xp, c| self.layer.forward_train(xp, c))?;
        Ok((y, OrderedCache { inner, key_order, batch: call.batch }))
    }

    /// Row-major input gradients (query; key and value for cross-attention) from the
    /// row-major `grad_out`; weight gradients accumulate into `grads`.
    pub fn backward(
        &self,
        cache: &OrderedCache<F>,
        grad_out: &[F],
        grads: &mut MultiheadWeights<F>,
    ) -> Result<InputGrads<F>> {
        let (batch, order) = (cache.batch, &self.order);
        let gp = self.permute_by(order, "grad_out", grad_out, batch, Way::ToOrder)?;
        let g = self.layer.backward(&cache.inner, &gp, grads)?;
        let query = self.permute_by(order, "grad query", &g.query, batch, Way::ToRowMajor)?;
        let Some(ko) = &cache.key_order else {
            return Ok(InputGrads { query, key: None, value: None });
        };
        let restore = |what, t: Option<Vec<F>>| -> Result<Vec<F>> {
            let t = t.ok_or_else(|| AttnError::InvalidArgument(format!("cross-attention backward gave no {what}")))?;
            self.permute_by(ko, what, &t, batch, Way::ToRowMajor)
        };
        Ok(InputGrads { query, key: Some(restore("grad key", g.key)?), value: Some(restore("grad value", g.value)?) })
    }
}
