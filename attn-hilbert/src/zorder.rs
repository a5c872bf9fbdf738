//! Z-order (Morton) curves on rectangles and boxes of any size, for comparison.
//!
//! Cells are visited in increasing order of their interleaved coordinate bits
//! (x lowest, then y, then z). Grids that are not power-of-two cubes are handled
//! by walking the octree of the enclosing power-of-two cube and pruning every
//! block that lies outside the grid, so the cost is `O(n)` plus the pruned
//! border, never the size of the enclosing cube.

/// Appends to `out` the row-major indices of a `depth x height x width` box in
/// Z-order. Same preconditions as the Hilbert generator. Returns the number of
/// octree blocks visited (pruned ones included): the walk's work besides output.
pub(crate) fn z_order_indices(depth: usize, height: usize, width: usize, out: &mut Vec<usize>) -> u64 {
    let side = depth.max(height).max(width).next_power_of_two();
    let mut walk = ZWalk { dims: [depth, height, width], stride: [height * width, width], steps: 0 };
    walk.block([0, 0, 0], side, out);
    walk.steps
}

struct ZWalk {
    dims: [usize; 3],
    stride: [usize; 2],
    /// Blocks visited.
    steps: u64,
}

impl ZWalk {
    /// Visit the block of side `side` (a power of two) at `origin = [z, y, x]`.
    fn block(&mut self, origin: [usize; 3], side: usize, out: &mut Vec<usize>) {
        self.steps += 1;
        let [z, y, x] = origin;
        if z >= self.dims[0] || y >= self.dims[1] || x >= self.dims[2] {
            return;
        }
        if side == 1 {
            out.push(z * self.stride[0] + y * self.stride[1] + x);
            return;
        }
        if side == 2 {
            // Leaf block: at most 8 cells, emitted directly.
            for c in 0..8 {
                let (cz, cy, cx) = (z + (c >> 2), y + ((c >> 1) & 1), x + (c & 1));
                if cz < self.dims[0] && cy < self.dims[1] && cx < self.dims[2] {
                    out.push(cz * self.stride[0] + cy * self.stride[1] + cx);
                }
            }
            return;
        }
        let h = side / 2;
        for c in 0..8 {
            self.block([z + h * (c >> 2), y + h * ((c >> 1) & 1), x + h * (c & 1)], h, out);
        }
    }
}
