//! `Grid`: a checked 2D rectangle or 3D box of tokens, and row-major coordinates.

use attn_core::error::{AttnError, Result, TensorName};

/// The largest token count a grid may hold: keeps every index, every coordinate
/// product inside the curve generators (at most `5 * side`) and every index
/// buffer's byte size far from overflow.
pub const MAX_TOKENS: usize = 1 << 48;

/// A grid of tokens, stored row-major: in 3D `[depth, height, width]` with width
/// fastest; a 2D grid is a box of depth 1 (and is reported as rank 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Grid {
    depth: usize,
    height: usize,
    width: usize,
    rank: u8,
}

fn grid_name() -> TensorName {
    TensorName::Other("grid")
}

impl Grid {
    /// A `height x width` grid (row-major: `index = y * width + x`).
    pub fn new_2d(height: usize, width: usize) -> Result<Self> {
        Self::checked([1, height, width], 2)
    }

    /// A `depth x height x width` box (row-major: `index = (z * height + y) * width + x`).
    pub fn new_3d(depth: usize, height: usize, width: usize) -> Result<Self> {
        Self::checked([depth, height, width], 3)
    }

    fn checked(dims: [usize; 3], rank: u8) -> Result<Self> {
        let names = ["depth", "height", "width"];
        for (d, name) in dims.iter().zip(names) {
            if *d == 0 {
                return Err(AttnError::ZeroDim { tensor: grid_name(), dim: name });
            }
        }
        let shown = if rank == 2 { dims[1..].to_vec() } else { dims.to_vec() };
        let overflow = || AttnError::ShapeOverflow { tensor: grid_name(), dims: shown.clone() };
        let n = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(overflow)?;
        if n > MAX_TOKENS {
            return Err(overflow());
        }
        Ok(Grid { depth: dims[0], height: dims[1], width: dims[2], rank })
    }

    /// 2 or 3.
    pub fn rank(&self) -> usize {
        self.rank as usize
    }
    pub fn depth(&self) -> usize {
        self.depth
    }
    pub fn height(&self) -> usize {
        self.height
    }
    pub fn width(&self) -> usize {
        self.width
    }
    /// `[depth, height, width]` (depth is 1 for a 2D grid).
    pub fn dims3(&self) -> [usize; 3] {
        [self.depth, self.height, self.width]
    }
    /// `[height, width]` for 2D, `[depth, height, width]` for 3D.
    pub fn dims(&self) -> Vec<usize> {
        if self.rank == 2 { vec![self.height, self.width] } else { self.dims3().to_vec() }
    }
    /// Number of tokens (cannot overflow: checked at construction).
    pub fn len(&self) -> usize {
        self.depth * self.height * self.width
    }
    /// Always false: a grid has at least one token.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Row-major index of `[z, y, x]` (no bounds check beyond debug builds).
    #[inline(always)]
    pub fn index_of(&self, [z, y, x]: [usize; 3]) -> usize {
        debug_assert!(z < self.depth && y < self.height && x < self.width);
        (z * self.height + y) * self.width + x
    }

    /// `[z, y, x]` of a row-major index (`z = 0` in 2D).
    #[inline(always)]
    pub fn coords_of(&self, index: usize) -> [usize; 3] {
        let x = index % self.width;
        let r = index / self.width;
        [r / self.height, r % self.height, x]
    }

    /// Calls `f` with the row-major index of every face neighbour of `index`
    /// (4 in 2D, 6 in 3D, fewer at the border).
    #[inline]
    pub fn for_each_neighbour(&self, index: usize, mut f: impl FnMut(usize)) {
        let [z, y, x] = self.coords_of(index);
        let (w, hw) = (self.width, self.width * self.height);
        if x > 0 {
            f(index - 1);
        }
        if x + 1 < self.width {
            f(index + 1);
        }
        if y > 0 {
            f(index - w);
        }
        if y + 1 < self.height {
            f(index + w);
        }
        if z > 0 {
            f(index - hw);
        }
        if z + 1 < self.depth {
            f(index + hw);
        }
    }
}

impl std::fmt::Display for Grid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.rank == 2 {
            write!(f, "{}x{}", self.height, self.width)
        } else {
            write!(f, "{}x{}x{}", self.depth, self.height, self.width)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_and_overflow_are_typed_errors() {
        assert!(matches!(Grid::new_2d(0, 4), Err(AttnError::ZeroDim { dim: "height", .. })));
        assert!(matches!(Grid::new_3d(2, 3, 0), Err(AttnError::ZeroDim { dim: "width", .. })));
        assert!(matches!(Grid::new_2d(usize::MAX, 2), Err(AttnError::ShapeOverflow { .. })));
        assert!(matches!(Grid::new_3d(1 << 20, 1 << 20, 1 << 20), Err(AttnError::ShapeOverflow { .. })));
    }

    #[test]
    fn coords_round_trip_and_neighbours() {
        let g = Grid::new_3d(3, 4, 5).unwrap();
        for i in 0..g.len() {
            assert_eq!(g.index_of(g.coords_of(i)), i);
        }
        let mut n = vec![];
        g.for_each_neighbour(g.index_of([1, 1, 1]), |j| n.push(j));
        assert_eq!(n.len(), 6);
        n.clear();
        g.for_each_neighbour(0, |j| n.push(j));
        n.sort();
        assert_eq!(n, vec![1, 5, 20]);
        assert_eq!(Grid::new_2d(3, 4).unwrap().to_string(), "3x4");
    }
}
