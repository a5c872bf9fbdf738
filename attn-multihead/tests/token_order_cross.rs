//! The Hilbert option reached from the layer (`with_token_order`) and cross-attention through an order, forward and backward.

use std::sync::Arc;

use attn_core::{AttnError, Causality, DilatedConfig};
use attn_hilbert::{Grid, OrderKind, TokenLayout, TokenOrder};
use attn_multihead::{
    Call, Cross, InputGrads, MultiheadConfig, MultiheadDilatedAttention, OrderedAttention, ReferenceBackend,
};
use attn_testkit::rng::SeededRng;

fn config() -> MultiheadConfig {
    MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap())
}

fn layer(cfg: MultiheadConfig) -> MultiheadDilatedAttention<f64> {
    MultiheadDilatedAttention::new(cfg, 3, Arc::new(ReferenceBackend)).unwrap()
}

fn normal(seed: u64, len: usize) -> Vec<f64> {
    let mut rng = SeededRng::new(seed);
    (0..len).map(|_| rng.normal()).collect()
}

/// `x: [batch, order.len(), e]` from row-major to curve order (`forward`) or back.
fn permute(order: &TokenOrder, x: &[f64], batch: usize, e: usize, forward: bool) -> Vec<f64> {
    let layout = TokenLayout::bse(batch, order.len(), e).unwrap();
    let mut out = vec![0.0; x.len()];
    if forward {
        order.permutation().apply(&layout, x, &mut out).unwrap();
    } else {
        order.permutation().unapply(&layout, x, &mut out).unwrap();
    }
    out
}

#[test]
fn with_token_order_is_the_ordered_layer() {
    let (b, e, grid) = (2, 8, Grid::new_2d(3, 5).unwrap());
    let x = normal(1, b * grid.len() * e);
    let via_layer = layer(config()).with_token_order(grid, OrderKind::Hilbert).unwrap();
    let wrapper = OrderedAttention::new(layer(config()), OrderKind::Hilbert, grid).unwrap();
    assert_eq!(via_layer.order(), wrapper.order());
    let y = via_layer.forward(&x, &Call::new(b, grid.len())).unwrap();
    assert_eq!(y, wrapper.forward(&x, &Call::new(b, grid.len())).unwrap());
    let rm = layer(config()).with_token_order(grid, OrderKind::RowMajor).unwrap();
    assert_eq!(
        rm.forward(&x, &Call::new(b, grid.len())).unwrap(),
        layer(config()).forward(&x, &Call::new(b, 15)).unwrap()
    );
}

/// The ordered cross layer equals the plain cross layer on inputs permuted by the
/// query and key orders (output and every gradient restored to row-major), and its
/// input gradients match finite differences.
fn check_cross(cfg: MultiheadConfig, kind: OrderKind, q_grid: Grid, k_grid: Grid, seed: u64) {
    let (b, e) = (2, cfg.embed_dim);
    let (n, m) = (q_grid.len(), k_grid.len());
    let ordered = layer(cfg.clone()).with_token_order(q_grid, kind).unwrap();
    let plain = layer(cfg);
    let (q, k, v) = (normal(seed, b * n * e), normal(seed + 1, b * m * e), normal(seed + 2, b * m * e));
    let g = normal(seed + 3, b * n * e);

    let (y, cache) =
        ordered.forward_train(&q, &Call::new(b, ordered.order().len()).cross(Cross::on_grid(&k, &v, k_grid))).unwrap();
    let (qo, ko) = (ordered.order().clone(), cache.key_order().cloned().expect("cross cache"));
    assert_eq!((ko.grid(), ko.kind()), (k_grid, kind));
    let identity = |o: &TokenOrder| o.permutation().order().iter().enumerate().all(|(i, &t)| i == t);
    assert_eq!(identity(&qo) && identity(&ko), kind == OrderKind::RowMajor, "the orders must really permute");
    let mut grads = ordered.layer.zero_grads();
    let got = ordered.backward(&cache, &g, &mut grads).unwrap();

    // By hand: permute, run the plain layer, restore.
    let (qp, kp, vp) = (permute(&qo, &q, b, e, true), permute(&ko, &k, b, e, true), permute(&ko, &v, b, e, true));
    let (yp, pcache) = plain.forward_train(&qp, &Call::new(b, n).cross(Cross::new(&kp, &vp, m))).unwrap();
    assert_eq!(y, permute(&qo, &yp, b, e, false));
    let mut pgrads = plain.zero_grads();
    let pg = plain.backward(&pcache, &permute(&qo, &g, b, e, true), &mut pgrads).unwrap();
    let want = InputGrads {
        query: permute(&qo, &pg.query, b, e, false),
        key: Some(permute(&ko, pg.key.as_ref().unwrap(), b, e, false)),
        value: Some(permute(&ko, pg.value.as_ref().unwrap(), b, e, false)),
    };
    assert_eq!(got, want);
    assert_eq!(grads.in_proj.weight, pgrads.in_proj.weight);
    assert_eq!(grads.out_proj.weight, pgrads.out_proj.weight);

    // Finite differences of sum(out * g) for every input element.
    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        let y = ordered
            .forward_train(q, &Call::new(b, ordered.order().len()).cross(Cross::on_grid(k, v, k_grid)))
            .unwrap()
            .0;
        y.iter().zip(&g).map(|(a, c)| a * c).sum()
    };
    let h = 1e-6;
    let inputs = [(&q, &got.query), (&k, got.key.as_ref().unwrap()), (&v, got.value.as_ref().unwrap())];
    for (which, (x, dx)) in inputs.into_iter().enumerate() {
        let tol = 1e-6 * dx.iter().fold(1.0f64, |a, d| a.max(d.abs()));
        for i in 0..x.len() {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[i] += h;
            xm[i] -= h;
            let args = |t: &Vec<f64>| match which {
                0 => loss(t, &k, &v),
                1 => loss(&q, t, &v),
                _ => loss(&q, &k, t),
            };
            let fd = (args(&xp) - args(&xm)) / (2.0 * h);
            assert!((fd - dx[i]).abs() < tol, "input {which}[{i}]: {} vs {fd}", dx[i]);
        }
    }
}

#[test]
fn cross_attention_on_the_query_grid_is_permute_attend_restore_with_exact_gradients() {
    let grid = Grid::new_2d(3, 4).unwrap();
    check_cross(config(), OrderKind::Hilbert, grid, grid, 10);
    check_cross(config().with_causality(Causality::Causal), OrderKind::Hilbert, grid, grid, 20);
}

#[test]
fn cross_attention_with_keys_on_their_own_grid_uses_their_own_order() {
    check_cross(config(), OrderKind::Hilbert, Grid::new_2d(3, 4).unwrap(), Grid::new_2d(2, 5).unwrap(), 30);
    check_cross(config(), OrderKind::ZOrder, Grid::new_2d(4, 4).unwrap(), Grid::new_3d(2, 2, 3).unwrap(), 40);
    // Row-major is the plain layer, so causal cross-attention is fine on any grids.
    check_cross(
        config().with_causality(Causality::Causal),
        OrderKind::RowMajor,
        Grid::new_2d(3, 4).unwrap(),
        Grid::new_2d(2, 5).unwrap(),
        50,
    );
}

#[test]
fn causal_cross_attention_across_two_curves_is_a_typed_error() {
    let (b, e) = (1, 8);
    let (q_grid, k_grid) = (Grid::new_2d(3, 4).unwrap(), Grid::new_2d(2, 5).unwrap());
    let (q, kv) = (normal(1, b * 12 * e), normal(2, b * 10 * e));
    for kind in [OrderKind::Hilbert, OrderKind::ZOrder] {
        let ordered = layer(config().with_causality(Causality::Causal)).with_token_order(q_grid, kind).unwrap();
        let err = ordered
            .forward_train(&q, &Call::new(b, ordered.order().len()).cross(Cross::on_grid(&kv, &kv, k_grid)))
            .unwrap_err();
        assert!(matches!(&err, AttnError::InvalidArgument(msg) if msg.contains("causal")), "{err}");
        assert!(ordered.key_order(k_grid).is_err());
        assert!(ordered.key_order(q_grid).is_ok(), "one curve for both sides is fine");
    }
}

#[test]
fn cross_attention_shape_errors_name_the_tensor() {
    let (b, e) = (1, 8);
    let (q_grid, k_grid) = (Grid::new_2d(3, 4).unwrap(), Grid::new_2d(2, 5).unwrap());
    let ordered = layer(config()).with_token_order(q_grid, OrderKind::Hilbert).unwrap();
    let (q, kv) = (normal(1, b * 12 * e), normal(2, b * 10 * e));
    let msg = |r: attn_core::Result<_>| r.map(|_: (Vec<f64>, _)| ()).unwrap_err().to_string();
    assert!(
        msg(ordered
            .forward_train(&q, &Call::new(b, ordered.order().len()).cross(Cross::on_grid(&kv[..72], &kv, k_grid))))
        .contains("key")
    );
    assert!(
        msg(ordered
            .forward_train(&q, &Call::new(b, ordered.order().len()).cross(Cross::on_grid(&kv, &kv[..8], k_grid))))
        .contains("value")
    );
    assert!(
        msg(ordered
            .forward_train(&q[..8], &Call::new(b, ordered.order().len()).cross(Cross::on_grid(&kv, &kv, k_grid))))
        .contains("query")
    );
    assert!(
        ordered
            .forward_train(&q, &Call::new(0, ordered.order().len()).cross(Cross::on_grid(&kv, &kv, k_grid)))
            .is_err(),
        "batch 0"
    );
    let (_, cache) = ordered
        .forward_train(&q, &Call::new(b, ordered.order().len()).cross(Cross::on_grid(&kv, &kv, k_grid)))
        .unwrap();
    let mut grads = ordered.layer.zero_grads();
    assert!(ordered.backward(&cache, &q[..8], &mut grads).is_err(), "grad_out of the wrong length");
}
