//! `TokenOrder`: how the tokens of a grid are serialised (row-major, Z-order, Hilbert).

use std::sync::Arc;

use attn_core::error::Result;

use crate::cache::OrderCache;
pub use crate::generate::{GenerationWork, OrderKind, generate, generate_counted};
use crate::grid::Grid;
use crate::permutation::Permutation;

/// A grid, a curve, and the permutation that serialises the grid along the curve.
///
/// Position `i` of the sequence holds row-major token `order[i]`
/// ([`Permutation::order`]). Constructors use the process-wide [`OrderCache`],
/// so building the same order twice costs a hash lookup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenOrder {
    kind: OrderKind,
    grid: Grid,
    perm: Arc<Permutation>,
}

impl TokenOrder {
    /// The order of `kind` on `grid`, from the global cache (generated on a miss).
    pub fn new(kind: OrderKind, grid: Grid) -> Result<Self> {
        let perm = OrderCache::global().get_or_generate(kind, grid)?;
        Ok(TokenOrder { kind, grid, perm })
    }

    /// The order of `kind` on `grid`, generated now without touching any cache.
    pub fn generate_uncached(kind: OrderKind, grid: Grid) -> Result<Self> {
        Ok(TokenOrder { kind, grid, perm: Arc::new(generate(kind, grid)?) })
    }

    /// Generalised Hilbert order of a `height x width` grid.
    pub fn hilbert_2d(height: usize, width: usize) -> Result<Self> {
        Self::new(OrderKind::Hilbert, Grid::new_2d(height, width)?)
    }
    /// Generalised Hilbert order of a `depth x height x width` box.
    pub fn hilbert_3d(depth: usize, height: usize, width: usize) -> Result<Self> {
        Self::new(OrderKind::Hilbert, Grid::new_3d(depth, height, width)?)
    }
    /// Z-order of a `height x width` grid.
    pub fn z_order_2d(height: usize, width: usize) -> Result<Self> {
        Self::new(OrderKind::ZOrder, Grid::new_2d(height, width)?)
    }
    /// Z-order of a `depth x height x width` box.
    pub fn z_order_3d(depth: usize, height: usize, width: usize) -> Result<Self> {
        Self::new(OrderKind::ZOrder, Grid::new_3d(depth, height, width)?)
    }
    /// Row-major order (the identity) of a `height x width` grid.
    pub fn row_major_2d(height: usize, width: usize) -> Result<Self> {
        Self::new(OrderKind::RowMajor, Grid::new_2d(height, width)?)
    }
    /// Row-major order (the identity) of a `depth x height x width` box.
    pub fn row_major_3d(depth: usize, height: usize, width: usize) -> Result<Self> {
        Self::new(OrderKind::RowMajor, Grid::new_3d(depth, height, width)?)
    }

    pub fn kind(&self) -> OrderKind {
        self.kind
    }
    pub fn grid(&self) -> Grid {
        self.grid
    }
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.perm.len()
    }
    /// Always false: a grid has at least one token.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// The permutation (shared with the cache).
    pub fn permutation(&self) -> &Arc<Permutation> {
        &self.perm
    }
    /// Row-major index of the token at sequence position `pos` (`None` past the end).
    pub fn token_at(&self, pos: usize) -> Option<usize> {
        self.perm.order().get(pos).copied()
    }
    /// Sequence position of row-major token `token` (`None` past the end).
    pub fn position_of(&self, token: usize) -> Option<usize> {
        self.perm.inverse_order().get(token).copied()
    }
    /// `[z, y, x]` of the token at sequence position `pos` (`z = 0` in 2D).
    pub fn coords_at(&self, pos: usize) -> Option<[usize; 3]> {
        self.token_at(pos).map(|t| self.grid.coords_of(t))
    }
}
