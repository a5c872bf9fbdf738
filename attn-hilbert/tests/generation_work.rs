//! Order generation is O(n), checked by counting the generators' work, not by timing.
//!
//! `generate_counted` reports the control steps of a generator (Hilbert: every
//! recursive call of the curve walk and every iteration of its cut search;
//! Z-order: every octree block visited, pruned ones included), each `O(1)`, and
//! the cells written (one write each). The tests pin the count exactly on
//! power-of-two squares and bound it linearly on every other shape.

use attn_hilbert::{GenerationWork, Grid, OrderKind, generate_counted};

fn work(kind: OrderKind, grid: Grid) -> GenerationWork {
    let (perm, work) = generate_counted(kind, grid).unwrap();
    assert_eq!(perm.len(), grid.len());
    assert_eq!(work.cells, grid.len() as u64, "{} on {grid}: one write per cell", kind.as_str());
    work
}

#[test]
fn steps_are_an_exact_linear_function_of_n_on_power_of_two_squares() {
    for k in 1..=10u32 {
        let side = 1usize << k;
        let grid = Grid::new_2d(side, side).unwrap();
        let n = grid.len() as u64;
        // Z-order: the root, then 8 children (4 inside the plane) of every
        // non-leaf block inside it: 1 + 8 (n/4 - 1) / 3 = (2n - 5) / 3.
        assert_eq!(work(OrderKind::ZOrder, grid).steps, (2 * n - 5) / 3, "z-order {grid}");
        assert_eq!((2 * n - 5) % 3, 0);
        // Hilbert (from 8x8, the largest square served from a table): the top
        // aligned call, n/64 table leaves, and (n/64 - 1)/3 inner squares of 11
        // steps each (its call, its half-width rectangle's call, three cut
        // searches of 3 iterations): 1 + n/64 + 11 (n/64 - 1)/3 = (7n - 256)/96.
        if side >= 8 {
            assert_eq!(work(OrderKind::Hilbert, grid).steps, (7 * n - 256) / 96, "hilbert {grid}");
            assert_eq!((7 * n - 256) % 96, 0);
        }
        assert_eq!(work(OrderKind::RowMajor, grid).steps, 0);
    }
}

#[test]
fn work_per_token_is_the_same_on_256_squared_and_1024_squared() {
    let per_token = |kind, side| {
        let grid = Grid::new_2d(side, side).unwrap();
        work(kind, grid).total() as f64 / grid.len() as f64
    };
    for kind in OrderKind::ALL {
        let (small, big) = (per_token(kind, 256), per_token(kind, 1024));
        // 16x the tokens, at most 0.1% more work per token (the affine constant).
        assert!(big <= small * 1.001, "{}: {small} vs {big} steps per token", kind.as_str());
        assert!(big >= 1.0 && small <= 2.0, "{}: {small} vs {big}", kind.as_str());
    }
}

#[test]
fn steps_are_linearly_bounded_on_every_shape() {
    let mut grids = vec![];
    for h in 1..=40 {
        for w in 1..=40 {
            grids.push(Grid::new_2d(h, w).unwrap());
        }
    }
    for d in 1..=10 {
        for h in 1..=10 {
            for w in 1..=10 {
                grids.push(Grid::new_3d(d, h, w).unwrap());
            }
        }
    }
    // Odd, prime, flat and line-like sizes, where pruning and cut parity work hardest.
    for (h, w) in [(2, 5000), (1, 9999), (3, 3001), (1000, 3), (997, 991), (512, 384), (300, 7), (17, 31)] {
        grids.push(Grid::new_2d(h, w).unwrap());
    }
    for (d, h, w) in [(3, 3, 3001), (2, 2, 4001), (31, 37, 41), (1, 2, 999), (64, 2, 64), (40, 1, 40), (128, 64, 2)] {
        grids.push(Grid::new_3d(d, h, w).unwrap());
    }
    for grid in grids {
        let n = grid.len() as u64;
        let hilbert = work(OrderKind::Hilbert, grid).steps;
        assert!(hilbert <= n, "hilbert on {grid}: {hilbert} steps for {n} tokens");
        let z = work(OrderKind::ZOrder, grid).steps;
        assert!(z <= 6 * n + 8, "z-order on {grid}: {z} steps for {n} tokens");
    }
}
