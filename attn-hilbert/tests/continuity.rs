//! Every generalised Hilbert order is continuous: consecutive positions are face
//! neighbours in the grid, on 2D and 3D grids of many sizes (odd, prime, flat).
//!
//! Bound on diagonal steps: ZERO. The curve leads with an even axis whenever the
//! token count is even, so the parity obstruction that forces a diagonal step in
//! the original gilbert curve (odd major side, even minor side) never arises, and
//! Gilbert++ has no other diagonal steps on any size checked here.

use attn_hilbert::{Grid, OrderKind, TokenOrder};
use proptest::prelude::*;

/// `(face steps, diagonal steps, longer jumps)` between consecutive positions.
fn step_kinds(o: &TokenOrder) -> (usize, usize, usize) {
    let (mut face, mut diagonal, mut jump) = (0, 0, 0);
    let mut prev = o.coords_at(0).unwrap();
    for i in 1..o.len() {
        let c = o.coords_at(i).unwrap();
        let d: Vec<usize> = (0..3).map(|k| prev[k].abs_diff(c[k])).collect();
        match (d.iter().sum::<usize>(), d.iter().max().copied().unwrap_or(0)) {
            (1, _) => face += 1,
            (_, 1) => diagonal += 1,
            _ => jump += 1,
        }
        prev = c;
    }
    (face, diagonal, jump)
}

fn assert_continuous(grid: Grid) {
    let o = TokenOrder::generate_uncached(OrderKind::Hilbert, grid).unwrap();
    assert_eq!(o.len(), grid.len());
    let (face, diagonal, jump) = step_kinds(&o);
    assert_eq!((diagonal, jump), (0, 0), "{grid}: {face} face steps, {diagonal} diagonal, {jump} jumps");
    assert_eq!(o.token_at(0), Some(0), "{grid}: the curve starts at the origin corner");
}

#[test]
fn every_2d_grid_up_to_40_is_continuous() {
    for h in 1..=40 {
        for w in 1..=40 {
            assert_continuous(Grid::new_2d(h, w).unwrap());
        }
    }
}

#[test]
fn every_3d_box_up_to_10_is_continuous() {
    for d in 1..=10 {
        for h in 1..=10 {
            for w in 1..=10 {
                assert_continuous(Grid::new_3d(d, h, w).unwrap());
            }
        }
    }
}

#[test]
fn prime_odd_and_flat_sizes_are_continuous() {
    for (h, w) in [(17, 31), (31, 17), (97, 89), (1, 101), (101, 1), (2, 127), (127, 2), (96, 80), (3, 1000)] {
        assert_continuous(Grid::new_2d(h, w).unwrap());
    }
    for (d, h, w) in [(13, 17, 19), (31, 17, 29), (7, 6, 4), (2, 64, 3), (1, 17, 31), (33, 65, 17), (5, 5, 128)] {
        assert_continuous(Grid::new_3d(d, h, w).unwrap());
    }
}

#[test]
fn power_of_two_squares_are_the_classic_hilbert_curve() {
    // Classic d2xy (Wikipedia), x along width; it starts at (0,0) and ends at (n-1,0).
    fn d2xy(n: usize, d: usize) -> (usize, usize) {
        let (mut x, mut y, mut t) = (0usize, 0usize, d);
        let mut s = 1;
        while s < n {
            let rx = 1 & (t / 2);
            let ry = 1 & (t ^ rx);
            if ry == 0 {
                if rx == 1 {
                    x = s - 1 - x;
                    y = s - 1 - y;
                }
                std::mem::swap(&mut x, &mut y);
            }
            x += s * rx;
            y += s * ry;
            t /= 4;
            s *= 2;
        }
        (x, y)
    }
    for n in [2usize, 4, 8, 32, 64] {
        let o = TokenOrder::hilbert_2d(n, n).unwrap();
        let ours: Vec<(usize, usize)> = (0..n * n).map(|i| o.coords_at(i).map(|c| (c[2], c[1])).unwrap()).collect();
        let classic: Vec<(usize, usize)> = (0..n * n).map(|d| d2xy(n, d)).collect();
        let transposed: Vec<(usize, usize)> = classic.iter().map(|&(x, y)| (y, x)).collect();
        assert!(ours == classic || ours == transposed, "{n}x{n} differs from the classic Hilbert curve");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(64), max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_2d_grids_are_continuous(h in 1usize..300, w in 1usize..300) {
        assert_continuous(Grid::new_2d(h, w).unwrap());
    }

    #[test]
    fn random_3d_boxes_are_continuous(d in 1usize..40, h in 1usize..40, w in 1usize..40) {
        assert_continuous(Grid::new_3d(d, h, w).unwrap());
    }
}

#[test]
fn power_of_two_factors_keep_tiles_whole_and_stay_continuous() {
    for (h, w) in [(96, 80), (64, 48), (48, 80), (192, 64), (16, 400), (16, 48), (48, 16), (24, 40)] {
        assert_continuous(Grid::new_2d(h, w).unwrap());
    }
    for (d, h, w) in [(32, 48, 64), (16, 32, 48), (8, 24, 40), (12, 20, 28), (16, 16, 48), (16, 48, 16), (64, 16, 16)] {
        assert_continuous(Grid::new_3d(d, h, w).unwrap());
    }
    // 32x48x64 (every side a multiple of 16): each run of 512 positions is an aligned 8x8x8 cube.
    let o = TokenOrder::hilbert_3d(32, 48, 64).unwrap();
    for seg in 0..o.len() / 512 {
        let first = o.coords_at(seg * 512).unwrap().map(|c| c / 8);
        assert!((seg * 512..seg * 512 + 512).all(|i| o.coords_at(i).unwrap().map(|c| c / 8) == first), "segment {seg}");
    }
}

/// Whether every run of `t^rank` positions is an aligned `t`-tile.
fn tiles_whole(o: &TokenOrder, t: usize) -> bool {
    let run = if o.grid().rank() == 2 { t * t } else { t * t * t };
    (0..o.len() / run).all(|s| {
        let first = o.coords_at(s * run).unwrap().map(|c| c / t);
        (s * run..s * run + run).all(|i| o.coords_at(i).unwrap().map(|c| c / t) == first)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(64), max_shrink_iters: 100, ..ProptestConfig::default() })]

    #[test]
    fn tiles_of_the_common_power_of_two_are_visited_whole_2d(h in 1usize..16, w in 1usize..16) {
        let o = TokenOrder::hilbert_2d(8 * h, 8 * w).unwrap();
        prop_assert!(tiles_whole(&o, 8));
    }

    #[test]
    fn tiles_of_the_common_power_of_two_are_visited_whole_3d(d in 1usize..6, h in 1usize..6, w in 1usize..6) {
        let o = TokenOrder::hilbert_3d(4 * d, 4 * h, 4 * w).unwrap();
        prop_assert!(tiles_whole(&o, 4));
    }
}
