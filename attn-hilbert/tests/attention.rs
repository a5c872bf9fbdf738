//! Attention through a token order and back: permuting q, k, v into curve order,
//! running dilated attention (the float64 reference) and restoring row-major
//! order computes attention in which row-major token `t` sits at sequence
//! position `position_of(t)`; and re-permuting that output gives exactly the
//! attention on the permuted inputs.

use attn_core::reference::dilated_forward;
use attn_core::{DilatedConfig, Shape4};
use attn_hilbert::{Grid, OrderKind, Permutation, TokenLayout, TokenOrder};
use attn_testkit::strategies::dilated_case_with;
use attn_testkit::tolerance::rel_l2_error;
use proptest::prelude::*;

/// A grid with exactly `n` cells: 2D `h x n/h` or, when `pick` says so and `n`
/// allows it, 3D.
fn grid_with(n: usize, pick: usize) -> Grid {
    let divisors: Vec<usize> = (1..=n).filter(|d| n.is_multiple_of(*d)).collect();
    let h = divisors[pick % divisors.len()];
    let rest = n / h;
    let d2: Vec<usize> = (1..=rest).filter(|d| rest.is_multiple_of(*d)).collect();
    if pick.is_multiple_of(3) && d2.len() > 2 {
        let d = d2[(pick / 3) % d2.len()];
        Grid::new_3d(d, h, rest / d).unwrap()
    } else {
        Grid::new_2d(h, rest).unwrap()
    }
}

/// Brute force: query token `t` of head `h` attends key token `u` (once per
/// pattern that admits the pair) iff the pattern admits their sequence positions.
fn attention_at_positions(
    cfg: &DilatedConfig,
    shape: Shape4,
    pos: &[usize],
    q: &[f64],
    k: &[f64],
    v: &[f64],
) -> Vec<f64> {
    let (n, heads, d) = (shape.seq, shape.heads, shape.head_dim);
    let scale = cfg.scale_for(d);
    let at = |b: usize, t: usize, h: usize| ((b * n + t) * heads + h) * d;
    let mut out = vec![0.0; shape.numel()];
    for b in 0..shape.batch {
        for h in 0..heads {
            let hp = cfg.head_patterns(heads, h);
            for t in 0..n {
                let mut keys = vec![];
                for (_, p) in &hp.patterns {
                    keys.extend((0..n).filter(|&u| p.attends(pos[t], pos[u], cfg.causality())));
                }
                if keys.is_empty() {
                    continue;
                }
                let dot = |u: usize| (0..d).map(|e| q[at(b, t, h) + e] * k[at(b, u, h) + e]).sum::<f64>() * scale;
                let scores: Vec<f64> = keys.iter().map(|&u| dot(u)).collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (&u, s) in keys.iter().zip(&scores) {
                    let w = hp.out_scale * (s - m).exp() / z;
                    for e in 0..d {
                        out[at(b, t, h) + e] += w * v[at(b, u, h) + e];
                    }
                }
            }
        }
    }
    out
}

fn through_order(
    perm: &Permutation,
    cfg: &DilatedConfig,
    shape: Shape4,
    qkv: [&[f64]; 3],
    in_place: bool,
) -> (Vec<f64>, Vec<f64>) {
    let layout = TokenLayout::bshd(shape);
    let permuted: Vec<Vec<f64>> = qkv
        .iter()
        .map(|x| {
            let mut y = x.to_vec();
            if in_place {
                perm.apply_in_place(&layout, &mut y).unwrap();
            } else {
                perm.apply(&layout, x, &mut y).unwrap();
            }
            y
        })
        .collect();
    let fwd =
        dilated_forward(cfg, attn_core::AttnShape::self_attn(shape), &permuted[0], &permuted[1], &permuted[2]).unwrap();
    let mut out = vec![0.0; fwd.out.len()];
    perm.unapply(&layout, &fwd.out, &mut out).unwrap();
    // LSE is [batch, seq, heads]: tokens of `heads` elements.
    let mut lse = fwd.lse.clone();
    perm.unapply_in_place(&TokenLayout::bse(shape.batch, shape.seq, shape.heads).unwrap(), &mut lse).unwrap();
    (out, lse)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(48), max_shrink_iters: 100, ..ProptestConfig::default() })]

    #[test]
    fn attention_through_an_order_is_attention_at_the_curve_positions(
        case in dilated_case_with(40, 16), pick in 0usize..1000, kind_ix in 0usize..3, in_place in any::<bool>(),
    ) {
        let shape = case.shape;
        let grid = grid_with(shape.seq, pick);
        let order = TokenOrder::new(OrderKind::ALL[kind_ix], grid).unwrap();
        let perm = order.permutation();
        let [q, k, v, _] = case.inputs().map(|x| x.iter().map(|&e| f64::from(e)).collect::<Vec<f64>>());
        let (out, lse) = through_order(perm, &case.cfg, shape, [&q, &k, &v], in_place);

        // 1. Equals brute-force attention with token t at position position_of(t).
        let want = attention_at_positions(&case.cfg, shape, perm.inverse_order(), &q, &k, &v);
        let err = rel_l2_error(&out, &want);
        prop_assert!(err <= 1e-12 || want.iter().all(|&x| x == 0.0) && out.iter().all(|&x| x == 0.0), "rel err {}", err);

        // 2. Re-permuting the output gives exactly the attention on the permuted inputs.
        let layout = TokenLayout::bshd(shape);
        let permute = |x: &[f64]| { let mut y = vec![0.0; x.len()]; perm.apply(&layout, x, &mut y).unwrap(); y };
        let direct = dilated_forward(&case.cfg, case.attn_shape(), &permute(&q), &permute(&k), &permute(&v)).unwrap();
        prop_assert_eq!(permute(&out), direct.out);
        let mut lse_perm = lse.clone();
        perm.apply_in_place(&TokenLayout::bse(shape.batch, shape.seq, shape.heads).unwrap(), &mut lse_perm).unwrap();
        prop_assert_eq!(lse_perm, direct.lse);
    }
}

#[test]
fn row_major_order_changes_nothing() {
    let cfg = DilatedConfig::new(&[4, 8], &[1, 2]).unwrap();
    let shape = Shape4::new(1, 12, 2, 4).unwrap();
    let [q, k, v] = [1u64, 2, 3]
        .map(|s| attn_testkit::rng::random_vec(s, shape.numel()).iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
    let order = TokenOrder::row_major_2d(3, 4).unwrap();
    let (out, _) = through_order(order.permutation(), &cfg, shape, [&q, &k, &v], false);
    let direct = dilated_forward(&cfg, attn_core::AttnShape::self_attn(shape), &q, &k, &v).unwrap();
    assert_eq!(out, direct.out);
    // A Hilbert order changes the result (segments are spatial patches now).
    let hil = TokenOrder::hilbert_2d(3, 4).unwrap();
    let (out_h, _) = through_order(hil.permutation(), &cfg, shape, [&q, &k, &v], false);
    assert!(rel_l2_error(&out_h, &direct.out) > 1e-3);
}
