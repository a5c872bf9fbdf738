//! The Hilbert option: run a layer on a 2D/3D token grid serialised along a curve (permute before, restore after).
//!
//! Projections, norms and dropout act per token and commute with a permutation, so
//! permuting the layer input once and restoring its output once is the same as
//! permuting around attention only. The caller keeps row-major tokens throughout.

use attn_core::{AttnError, Result};
use attn_hilbert::{Grid, OrderKind, TokenLayout, TokenOrder};

use crate::dropout::Mode;
use crate::float::LayerFloat;
use crate::layer::{MultiheadCache, MultiheadDilatedAttention};

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

    fn layout(&self, batch: usize, seq: usize, len: usize) -> Result<TokenLayout> {
        if seq != self.order.len() {
            return Err(AttnError::InvalidArgument(format!(
                "sequence of {seq} tokens but the {} grid has {}",
                self.order.kind().as_str(),
                self.order.len()
            )));
        }
        let e = self.layer.config().embed_dim;
        let layout = TokenLayout::bse(batch, seq, e)?;
        if layout.numel()? != len {
            return Err(AttnError::InvalidArgument(format!("buffer of {len} elements is not [{batch}, {seq}, {e}]")));
        }
        Ok(layout)
    }

    fn permute(&self, x: &[F], batch: usize, seq: usize, forward: bool) -> Result<Vec<F>> {
        let layout = self.layout(batch, seq, x.len())?;
        let mut out = vec![F::zero(); x.len()];
        let perm = self.order.permutation();
        if forward {
            perm.apply(&layout, x, &mut out)?
        } else {
            perm.unapply(&layout, x, &mut out)?
        }
        Ok(out)
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
        grads: &mut crate::weights::MultiheadWeights<F>,
    ) -> Result<Vec<F>> {
        let gp = self.permute(grad_out, batch, seq, true)?;
        let dxp = self.layer.backward(cache, &gp, grads)?.query;
        self.permute(&dxp, batch, seq, false)
    }
}
