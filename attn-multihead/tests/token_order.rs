//! The Hilbert option: row-major order is the plain layer, curve order is "permute, attend, restore", gradients exact.

use attn_core::DilatedConfig;
use std::sync::Arc;

use attn_hilbert::{Grid, OrderKind, TokenLayout, TokenOrder};
use attn_multihead::{Call, MultiheadConfig, MultiheadDilatedAttention, OrderedAttention, ReferenceBackend};
use attn_testkit::rng::SeededRng;

fn layer() -> MultiheadDilatedAttention<f64> {
    MultiheadDilatedAttention::new(
        MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap()),
        3,
        Arc::new(ReferenceBackend),
    )
    .unwrap()
}

#[test]
fn row_major_order_is_the_plain_layer_and_hilbert_is_permute_attend_restore() {
    let (b, h, w, e) = (2, 3, 5, 8);
    let n = h * w;
    let mut rng = SeededRng::new(1);
    let x: Vec<f64> = (0..b * n * e).map(|_| rng.normal()).collect();
    let plain = layer().forward(&x, &Call::new(b, n)).unwrap();
    let rm = OrderedAttention::new(layer(), OrderKind::RowMajor, Grid::new_2d(h, w).unwrap()).unwrap();
    assert_eq!(rm.forward(&x, &Call::new(b, n)).unwrap(), plain);

    let hil = OrderedAttention::hilbert_2d(layer(), h, w).unwrap();
    let got = hil.forward(&x, &Call::new(b, n)).unwrap();
    assert_ne!(got, plain, "the curve changes which tokens share segments");
    // By hand: gather tokens in curve order, run the layer, scatter back.
    let order = TokenOrder::hilbert_2d(h, w).unwrap();
    let perm = order.permutation();
    let mut xp = vec![0.0; x.len()];
    for bi in 0..b {
        for (i, &tok) in perm.order().iter().enumerate() {
            xp[(bi * n + i) * e..][..e].copy_from_slice(&x[(bi * n + tok) * e..][..e]);
        }
    }
    let yp = layer().forward(&xp, &Call::new(b, n)).unwrap();
    let mut want = vec![0.0; x.len()];
    perm.unapply(&TokenLayout::bse(b, n, e).unwrap(), &yp, &mut want).unwrap();
    assert_eq!(got, want);
    assert!(hil.forward(&x[..e * 10], &Call::new(1, 10)).is_err(), "sequence must match the grid");
}

#[test]
fn gradients_through_the_ordering_match_finite_differences() {
    let (b, n, e) = (1, 12, 8);
    let hil = OrderedAttention::new(layer(), OrderKind::Hilbert, Grid::new_2d(3, 4).unwrap()).unwrap();
    let mut rng = SeededRng::new(2);
    let x: Vec<f64> = (0..b * n * e).map(|_| rng.normal()).collect();
    let g: Vec<f64> = (0..b * n * e).map(|_| rng.normal()).collect();
    let (_, cache) = hil.forward_train(&x, &Call::new(b, n)).unwrap();
    let mut grads = hil.layer.weights.zeros_like();
    let dx = hil.backward(&cache, &g, &mut grads).unwrap().query;
    let loss =
        |x: &[f64]| -> f64 { hil.forward(x, &Call::new(b, n)).unwrap().iter().zip(&g).map(|(a, b)| a * b).sum() };
    let hstep = 1e-6;
    for i in 0..x.len() {
        let (mut xp, mut xm) = (x.clone(), x.clone());
        xp[i] += hstep;
        xm[i] -= hstep;
        let fd = (loss(&xp) - loss(&xm)) / (2.0 * hstep);
        assert!((fd - dx[i]).abs() < 1e-6 * dx.iter().fold(1.0f64, |m, v| m.max(v.abs())), "dx[{i}] {} vs {fd}", dx[i]);
    }
}
