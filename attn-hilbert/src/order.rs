//! `TokenOrder`: how the tokens of a grid are serialised (row-major, Z-order, Hilbert).

use std::sync::Arc;

use attn_core::error::{AttnError, Result};

use crate::cache::OrderCache;
use crate::gilbert::hilbert_indices;
use crate::grid::Grid;
use crate::permutation::{Permutation, try_vec};
use crate::zorder::z_order_indices;

/// Which curve serialises the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OrderKind {
    /// Width fastest, then height, then depth (the identity permutation).
    RowMajor,
    /// Morton order: interleaved coordinate bits.
    ZOrder,
    /// Generalised Hilbert ("gilbert"): continuous on any rectangle or box.
    Hilbert,
}

impl OrderKind {
    pub const ALL: [OrderKind; 3] = [OrderKind::RowMajor, OrderKind::ZOrder, OrderKind::Hilbert];

    /// Name used on command lines and in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            OrderKind::RowMajor => "row_major",
            OrderKind::ZOrder => "z_order",
            OrderKind::Hilbert => "hilbert",
        }
    }

    /// Parse `row_major`, `z_order` (also `morton`) or `hilbert` (also `gilbert`).
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "rowmajor" | "raster" => Ok(OrderKind::RowMajor),
            "zorder" | "morton" | "z" => Ok(OrderKind::ZOrder),
            "hilbert" | "gilbert" => Ok(OrderKind::Hilbert),
            _ => Err(AttnError::InvalidArgument(format!("unknown token order `{s}`"))),
        }
    }
}

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

/// Generate the permutation of `kind` on `grid` in `O(n)` time.
pub fn generate(kind: OrderKind, grid: Grid) -> Result<Permutation> {
    generate_counted(kind, grid).map(|(perm, _)| perm)
}

/// The work a generator did, counted (not timed) so that the `O(n)` bound can be
/// tested exactly: see [`generate_counted`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GenerationWork {
    /// Control steps: for Hilbert, every recursive call of the curve walk and every
    /// iteration of its cut-search loop; for Z-order, every octree block visited
    /// (pruned ones included); 0 for row-major. Each step is `O(1)` work.
    pub steps: u64,
    /// Indices written (`grid.len()`): the per-cell work, one write each.
    pub cells: u64,
}

impl GenerationWork {
    /// `steps + cells`: the generator's whole work, up to a constant per unit.
    pub fn total(&self) -> u64 {
        self.steps + self.cells
    }
}

/// [`generate`], also returning the work it did (the `O(n)` validation of the
/// result by [`Permutation::from_order`] is not counted).
pub fn generate_counted(kind: OrderKind, grid: Grid) -> Result<(Permutation, GenerationWork)> {
    let [d, h, w] = grid.dims3();
    let n = grid.len();
    let mut order = try_vec::<usize>(n)?;
    let steps = match kind {
        OrderKind::RowMajor => {
            order.extend(0..n);
            0
        }
        OrderKind::ZOrder => z_order_indices(d, h, w, &mut order),
        OrderKind::Hilbert => hilbert_indices(d, h, w, &mut order),
    };
    let work = GenerationWork { steps, cells: order.len() as u64 };
    // Validation is O(n) and turns any generator bug into an error, not bad data.
    let perm = Permutation::from_order(order).map_err(|e| {
        AttnError::InvalidArgument(format!("{} order on {grid} is not a permutation: {e}", kind.as_str()))
    })?;
    Ok((perm, work))
}
