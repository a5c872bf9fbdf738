//! The curves' generators: `OrderKind` names a curve, `generate` writes its permutation
//! of a grid in `O(n)`, counting its work for the bound's test.

use attn_core::error::{AttnError, Result};

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
