//! Every order is a permutation; inverses compose to the identity; applying and
//! restoring tokens (in place and out of place) agree and round-trip exactly.

use attn_core::error::AttnError;
use attn_core::shape::Shape4;
use attn_hilbert::{Grid, OrderCache, OrderKind, Permutation, TokenLayout, TokenOrder};
use proptest::prelude::*;

fn grid_strategy() -> impl Strategy<Value = Grid> {
    prop_oneof![
        (1usize..70, 1usize..70).prop_map(|(h, w)| Grid::new_2d(h, w).unwrap()),
        (1usize..14, 1usize..14, 1usize..14).prop_map(|(d, h, w)| Grid::new_3d(d, h, w).unwrap()),
    ]
}

fn kind_strategy() -> impl Strategy<Value = OrderKind> {
    prop_oneof![Just(OrderKind::RowMajor), Just(OrderKind::ZOrder), Just(OrderKind::Hilbert)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(128), max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn every_order_is_a_permutation(kind in kind_strategy(), grid in grid_strategy()) {
        let o = TokenOrder::generate_uncached(kind, grid).unwrap();
        let mut seen = vec![false; grid.len()];
        for &t in o.permutation().order() {
            prop_assert!(!seen[t], "token {} twice", t);
            seen[t] = true;
        }
        prop_assert!(seen.iter().all(|&s| s));
        // The cached constructor returns the same order.
        prop_assert_eq!(TokenOrder::new(kind, grid).unwrap(), o);
    }

    #[test]
    fn inverse_composes_to_identity(kind in kind_strategy(), grid in grid_strategy()) {
        let p = TokenOrder::new(kind, grid).unwrap().permutation().clone();
        prop_assert!(p.after(&p.inverse()).unwrap().is_identity());
        prop_assert!(p.inverse().after(&p).unwrap().is_identity());
        for (i, &t) in p.order().iter().enumerate() {
            prop_assert_eq!(p.inverse_order()[t], i);
        }
        prop_assert_eq!(p.inverse().inverse(), (*p).clone());
    }

    #[test]
    fn apply_and_unapply_agree_in_and_out_of_place(
        kind in kind_strategy(), grid in grid_strategy(), batch in 1usize..4, token_len in 1usize..9,
    ) {
        let p = TokenOrder::new(kind, grid).unwrap().permutation().clone();
        let layout = TokenLayout::bse(batch, p.len(), token_len).unwrap();
        let n = layout.numel().unwrap();
        let src: Vec<u32> = (0..n as u32).collect();
        let mut fwd = vec![0u32; n];
        p.apply(&layout, &src, &mut fwd).unwrap();
        // Definition: dst[b, i, :] = src[b, order[i], :].
        for b in 0..batch {
            for (i, &t) in p.order().iter().enumerate() {
                let got = &fwd[(b * p.len() + i) * token_len..][..token_len];
                let want = &src[(b * p.len() + t) * token_len..][..token_len];
                prop_assert_eq!(got, want);
            }
        }
        let mut inplace = src.clone();
        p.apply_in_place(&layout, &mut inplace).unwrap();
        prop_assert_eq!(&inplace, &fwd);
        let mut back = vec![0u32; n];
        p.unapply(&layout, &fwd, &mut back).unwrap();
        prop_assert_eq!(&back, &src);
        p.unapply_in_place(&layout, &mut inplace).unwrap();
        prop_assert_eq!(&inplace, &src);
        // Applying the inverse is unapplying.
        p.inverse().apply(&layout, &fwd, &mut back).unwrap();
        prop_assert_eq!(&back, &src);
    }
}

#[test]
fn z_order_on_power_of_two_squares_interleaves_bits() {
    for n in [1usize, 2, 4, 16, 64] {
        let o = TokenOrder::z_order_2d(n, n).unwrap();
        for i in 0..n * n {
            let (mut x, mut y) = (0, 0);
            for bit in 0..16 {
                x |= ((i >> (2 * bit)) & 1) << bit;
                y |= ((i >> (2 * bit + 1)) & 1) << bit;
            }
            assert_eq!(o.coords_at(i), Some([0, y, x]));
        }
    }
    // On other sizes it is the power-of-two order with outside cells skipped.
    let o = TokenOrder::z_order_2d(3, 5).unwrap();
    let big = TokenOrder::z_order_2d(8, 8).unwrap();
    let kept: Vec<[usize; 3]> = (0..64).filter_map(|i| big.coords_at(i)).filter(|c| c[1] < 3 && c[2] < 5).collect();
    assert_eq!((0..15).map(|i| o.coords_at(i).unwrap()).collect::<Vec<_>>(), kept);
}

#[test]
fn row_major_is_the_identity_and_lookups_are_consistent() {
    assert!(TokenOrder::row_major_3d(3, 4, 5).unwrap().permutation().is_identity());
    let o = TokenOrder::hilbert_3d(3, 4, 5).unwrap();
    for pos in 0..o.len() {
        let t = o.token_at(pos).unwrap();
        assert_eq!(o.position_of(t), Some(pos));
        assert_eq!(o.grid().index_of(o.coords_at(pos).unwrap()), t);
    }
    assert_eq!(o.token_at(o.len()), None);
    assert_eq!(o.position_of(o.len()), None);
}

#[test]
fn bshd_layout_moves_whole_tokens() {
    let shape = Shape4::new(2, 6, 3, 4).unwrap();
    let p = TokenOrder::hilbert_2d(2, 3).unwrap().permutation().clone();
    let layout = TokenLayout::bshd(shape);
    assert_eq!(layout.token_len, 12);
    let src: Vec<f64> = (0..shape.numel()).map(|i| i as f64).collect();
    let mut dst = vec![0.0; src.len()];
    p.apply(&layout, &src, &mut dst).unwrap();
    let mut via_tokens = vec![0.0; src.len()];
    p.apply_tokens(&src, &mut via_tokens, 12).unwrap();
    assert_eq!(dst, via_tokens);
    let wrong = TokenLayout::bshd(Shape4::new(2, 5, 3, 4).unwrap());
    assert!(matches!(p.apply(&wrong, &src[..120], &mut dst[..120]), Err(AttnError::ShapeMismatch { .. })));
}

#[test]
fn bad_inputs_are_typed_errors() {
    assert!(matches!(TokenOrder::hilbert_2d(0, 5), Err(AttnError::ZeroDim { dim: "height", .. })));
    assert!(matches!(TokenOrder::z_order_3d(4, 0, 5), Err(AttnError::ZeroDim { dim: "height", .. })));
    assert!(matches!(TokenOrder::hilbert_2d(usize::MAX, 3), Err(AttnError::ShapeOverflow { .. })));
    assert!(matches!(TokenOrder::hilbert_3d(1 << 17, 1 << 17, 1 << 17), Err(AttnError::ShapeOverflow { .. })));
    assert!(matches!(OrderKind::parse("spiral"), Err(AttnError::InvalidArgument(_))));
    for k in OrderKind::ALL {
        assert_eq!(OrderKind::parse(k.as_str()).unwrap(), k);
    }
    assert!(matches!(Permutation::from_order(vec![1, 1, 0]), Err(AttnError::InvalidArgument(_))));
    let cache = OrderCache::new(4);
    assert!(cache.get_or_generate(OrderKind::Hilbert, Grid::new_2d(3, 3).unwrap()).is_ok());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(64), max_shrink_iters: 100, ..ProptestConfig::default() })]

    /// Splitting the permuted sequence into `world` contiguous chunks (ring ranks)
    /// and scattering each back rebuilds the input; each chunk equals the same
    /// slice of the fully permuted tensor.
    #[test]
    fn rank_chunks_partition_the_permuted_sequence(grid in grid_strategy(), world in 1usize..6, batch in 1usize..3) {
        let p = TokenOrder::hilbert_3d(grid.depth(), grid.height(), grid.width()).unwrap().permutation().clone();
        let (n, l) = (p.len(), 3);
        let full: Vec<u32> = (0..(batch * n * l) as u32).collect();
        let mut permuted = vec![0u32; full.len()];
        p.apply_tokens(&full, &mut permuted, l).unwrap();
        let mut rebuilt = vec![u32::MAX; full.len()];
        for r in 0..world {
            let range = r * n / world..(r + 1) * n / world;
            let mut part = vec![0u32; batch * range.len() * l];
            p.apply_range(range.clone(), batch, l, &full, &mut part).unwrap();
            for b in 0..batch {
                let want = &permuted[(b * n + range.start) * l..(b * n + range.end) * l];
                prop_assert_eq!(&part[b * range.len() * l..(b + 1) * range.len() * l], want);
            }
            p.unapply_range(range, batch, l, &part, &mut rebuilt).unwrap();
        }
        prop_assert_eq!(rebuilt, full);
    }
}
