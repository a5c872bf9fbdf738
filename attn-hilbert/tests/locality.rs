//! Hilbert segments are compact: on the grids the Hilbert order keeps
//! more of each token's grid neighbours inside its segment than row-major and
//! Z-order.
//!
//! Where the grid's sides are multiples of the segment's square root (64x64 and
//! 96x80 with segments 64 = 8x8 and 256 = 16x16), Z-order's segments are exactly
//! the aligned squares, and so are Hilbert's: the two orders then have the SAME
//! segment sets, so every segment-set metric is equal, and a strict win over
//! Z-order is impossible there. The test asserts equality in those cases (and a
//! strict win over row-major), and a strict win over both elsewhere.
//!
//! The tie is a property of the metric, not of the curve: on 64x64 with segments
//! of 64, aligned 8x8 squares are the tiling with the fewest cut edges, so no
//! order of any kind beats them. What does separate the curves is where the
//! segment boundaries fall: averaged over every segment offset (ring chunks,
//! dilation offsets and prefixes shift them), Hilbert keeps strictly more
//! neighbours together than Z-order on every one of the grids, aligned
//! or not (`hilbert_beats_z_order_at_every_segment_offset_on_average`).

use attn_hilbert::{Grid, OrderKind, TokenOrder, locality, shifted_neighbour_in_segment_fraction};

fn metrics(kind: OrderKind, h: usize, w: usize, seg: usize) -> attn_hilbert::Locality {
    locality(&TokenOrder::new(kind, Grid::new_2d(h, w).unwrap()).unwrap(), seg).unwrap()
}

#[test]
fn hilbert_beats_row_major_and_z_order() {
    for (h, w) in [(64, 64), (96, 80), (80, 96), (17, 31), (31, 17)] {
        for seg in [64, 256] {
            let row = metrics(OrderKind::RowMajor, h, w, seg);
            let z = metrics(OrderKind::ZOrder, h, w, seg);
            let hil = metrics(OrderKind::Hilbert, h, w, seg);
            let side = (seg as f64).sqrt() as usize;
            let aligned = h % side == 0 && w % side == 0;
            let ctx = format!("{h}x{w} seg {seg}: row {row:?} z {z:?} hilbert {hil:?}");
            assert!(hil.neighbour_in_segment > row.neighbour_in_segment, "{ctx}");
            assert!(hil.mean_segment_diameter < row.mean_segment_diameter, "{ctx}");
            if aligned {
                assert_eq!(hil.neighbour_in_segment, z.neighbour_in_segment, "{ctx}");
                assert_eq!(hil.mean_segment_diameter, (side - 1) as f64, "{ctx}: segments are squares");
            } else {
                assert!(hil.neighbour_in_segment > z.neighbour_in_segment, "{ctx}");
                assert!(hil.mean_segment_diameter < z.mean_segment_diameter, "{ctx}");
            }
        }
    }
}

#[test]
fn aligned_grids_have_square_hilbert_segments() {
    // Every segment of 64 tokens on a 96x80 grid is an aligned 8x8 square.
    let o = TokenOrder::hilbert_2d(96, 80).unwrap();
    for seg in 0..o.len() / 64 {
        let cells: Vec<[usize; 3]> = (seg * 64..seg * 64 + 64).map(|i| o.coords_at(i).unwrap()).collect();
        let (y0, x0) = (cells[0][1] / 8 * 8, cells[0][2] / 8 * 8);
        assert!(cells.iter().all(|c| c[1] / 8 * 8 == y0 && c[2] / 8 * 8 == x0), "segment {seg}");
    }
}

#[test]
fn hilbert_is_local_in_3d() {
    for (d, h, w) in [(16, 16, 16), (12, 20, 28), (9, 17, 31)] {
        for seg in [64, 512] {
            let g = Grid::new_3d(d, h, w).unwrap();
            let row = locality(&TokenOrder::new(OrderKind::RowMajor, g).unwrap(), seg).unwrap();
            let hil = locality(&TokenOrder::new(OrderKind::Hilbert, g).unwrap(), seg).unwrap();
            assert!(hil.neighbour_in_segment > row.neighbour_in_segment, "{g} seg {seg}: {hil:?} vs {row:?}");
            assert!(hil.mean_segment_diameter < row.mean_segment_diameter, "{g} seg {seg}: {hil:?} vs {row:?}");
        }
    }
}

#[test]
fn hilbert_beats_z_order_at_every_segment_offset_on_average() {
    let shifted = |kind, h, w, seg| {
        shifted_neighbour_in_segment_fraction(&TokenOrder::new(kind, Grid::new_2d(h, w).unwrap()).unwrap(), seg)
            .unwrap()
    };
    for (h, w) in [(64, 64), (96, 80), (80, 96), (17, 31), (31, 17)] {
        for seg in [64, 256] {
            let row = shifted(OrderKind::RowMajor, h, w, seg);
            let z = shifted(OrderKind::ZOrder, h, w, seg);
            let hil = shifted(OrderKind::Hilbert, h, w, seg);
            let ctx = format!("{h}x{w} seg {seg}: row {row:.4} z {z:.4} hilbert {hil:.4}");
            println!("{ctx}");
            assert!(hil > z, "{ctx}");
            // On 31x17 a 256-token row-major window is a near-square 15x17 block, which
            // beats any curve's windows once boundaries shift (0.964 vs 0.954): the
            // row-major claim is made for the grids, where rows are wide.
            if (h, w, seg) != (31, 17, 256) {
                assert!(hil > row, "{ctx}");
            }
        }
    }
}

/// The shifted average straight from its definition (every offset in `0..w`, the
/// segment index `(p + w - offset) / w` in u128 so nothing overflows).
fn shifted_by_definition(order: &TokenOrder, w: usize) -> f64 {
    let (grid, pos) = (order.grid(), order.permutation().inverse_order());
    let seg = |p: usize, offset: usize| (p as u128 + w as u128 - offset as u128) / w as u128;
    let mut total = 0.0;
    for offset in 0..w {
        let (mut sum, mut counted) = (0.0f64, 0usize);
        for (t, &p) in pos.iter().enumerate() {
            let (mut inside, mut all) = (0u32, 0u32);
            grid.for_each_neighbour(t, |u| {
                all += 1;
                inside += u32::from(seg(pos[u], offset) == seg(p, offset));
            });
            if all > 0 {
                sum += f64::from(inside) / f64::from(all);
                counted += 1;
            }
        }
        total += if counted == 0 { 1.0 } else { sum / counted as f64 };
    }
    total / w as f64
}

/// A segment length far beyond the sequence must not walk every one of its offsets
/// (`usize::MAX` of them: a hang) nor overflow `p + w`: only the offsets inside the
/// sequence are walked, at once, equal to the definition.
#[test]
fn shifted_fraction_with_a_huge_segment_length_is_exact_and_fast() {
    let order = TokenOrder::hilbert_2d(5, 7).unwrap();
    let n = order.len();
    for w in [1, 7, n - 1, n, n + 1, n + 9, 3 * n] {
        let (got, want) = (shifted_neighbour_in_segment_fraction(&order, w).unwrap(), shifted_by_definition(&order, w));
        assert!((got - want).abs() < 1e-12, "segment {w}: {got} vs {want}");
    }
    let t = std::time::Instant::now();
    let huge = shifted_neighbour_in_segment_fraction(&order, usize::MAX).unwrap();
    assert!(t.elapsed().as_secs() < 5, "took {:?}", t.elapsed());
    assert!((huge - 1.0).abs() < 1e-12 && huge <= 1.0, "{huge}");
}
