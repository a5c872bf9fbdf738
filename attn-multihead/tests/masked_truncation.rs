//! Key padding at the end of a row is the same as the shorter row: the encoder stack and
//! the cross-attention layer with trailing padded keys equal the same calls on the rows
//! cut to their real length (outputs of real rows, input and weight gradients; float64,
//! reference backend), since a padded key is never attended and everything else is per
//! token.

use std::sync::Arc;

use attn_core::{DilatedConfig, KeyPadding, Masks, Mixing};
use attn_multihead::{
    Call, Cross, EncoderConfig, LongNetEncoder, MultiheadConfig, MultiheadDilatedAttention, NamedParams,
    ReferenceBackend,
};
use attn_testkit::rng::SeededRng;

fn randn(rng: &mut SeededRng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.normal()).collect()
}

fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().map(|x| x.abs()).fold(1.0, f64::max);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-12 * scale, "{what}[{i}]: {g} vs {w}");
    }
}

/// Padding flags `[batch, seq]` with row `b` real for `lens[b]` positions.
fn trailing_padding(lens: &[usize], seq: usize) -> Vec<bool> {
    lens.iter().flat_map(|&l| (0..seq).map(move |p| p >= l)).collect()
}

#[test]
fn encoder_with_trailing_padding_equals_the_cut_rows() {
    for (mixing, causal) in [(Mixing::HeadGroups, false), (Mixing::LongNet, true)] {
        let attention =
            DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).mixing(mixing).causality(causal.into());
        let cfg = EncoderConfig::new(8, 2, attention.build().unwrap(), 12);
        let enc = LongNetEncoder::<f64>::new(cfg, 2, 11, Arc::new(ReferenceBackend)).unwrap();
        let (seq, e, lens) = (12, 8, [12usize, 7]);
        let mut rng = SeededRng::new(5);
        let x = randn(&mut rng, lens.len() * seq * e);
        let flags = trailing_padding(&lens, seq);
        let masks = Masks { key_padding: Some(KeyPadding::new(&flags, lens.len(), seq).unwrap()), ..Masks::NONE };
        // Gradient of the real rows only.
        let mut g = randn(&mut rng, x.len());
        for (b, &l) in lens.iter().enumerate() {
            g[(b * seq + l) * e..(b + 1) * seq * e].fill(0.0);
        }
        let y = enc.forward(&x, &Call::new(lens.len(), seq).masks(masks)).unwrap();
        let (y_train, cache) = enc.forward_train(&x, &Call::new(lens.len(), seq).masks(masks)).unwrap();
        assert_eq!(y, y_train, "{mixing:?}: forward and forward_train agree");
        let mut grads = enc.zero_grads();
        let dx = enc.backward(&cache, &g, &mut grads).unwrap();
        let mut cut_grads = enc.zero_grads();
        for (b, &l) in lens.iter().enumerate() {
            let rows = b * seq * e..(b * seq + l) * e;
            let cut = enc.forward(&x[rows.clone()], &Call::new(1, l)).unwrap();
            assert_close(&format!("{mixing:?} row {b} output"), &y[rows.clone()], &cut);
            let (_, c) = enc.forward_train(&x[rows.clone()], &Call::new(1, l)).unwrap();
            let dx_cut = enc.backward(&c, &g[rows.clone()], &mut cut_grads).unwrap();
            assert_close(&format!("{mixing:?} row {b} dx"), &dx[rows], &dx_cut);
            let pad = (b * seq + l) * e..(b + 1) * seq * e;
            assert!(dx[pad].iter().all(|&d| d == 0.0), "{mixing:?}: padded rows reach no output with a gradient");
        }
        for (l, (got, want)) in grads.iter().zip(&cut_grads).enumerate() {
            for (p, q) in got.params().iter().zip(want.params()) {
                assert_close(&format!("{mixing:?} layer {l} {}", p.name), p.data, q.data);
            }
        }
        // The mask matters (causal queries never see later keys): without it the padded
        // keys change the real rows.
        let unmasked = enc.forward(&x, &Call::new(lens.len(), seq)).unwrap();
        let row1 = seq * e..(seq + lens[1]) * e;
        let changed = unmasked[row1.clone()].iter().zip(&y[row1]).any(|(a, b)| (a - b).abs() > 1e-6);
        assert_eq!(changed, !causal, "{mixing:?}");
    }
}

#[test]
fn cross_attention_with_trailing_key_padding_equals_the_cut_keys() {
    let cfg = MultiheadConfig::new(
        8,
        4,
        DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).mixing(Mixing::LongNet).build().unwrap(),
    )
    .with_num_kv_heads(2);
    let layer = MultiheadDilatedAttention::<f64>::new(cfg, 3, Arc::new(ReferenceBackend)).unwrap();
    let (e, q_seq, kv_seq, real) = (8, 6, 11, 7);
    let mut rng = SeededRng::new(8);
    let (q, k, v) = (randn(&mut rng, q_seq * e), randn(&mut rng, kv_seq * e), randn(&mut rng, kv_seq * e));
    let g = randn(&mut rng, q_seq * e);
    let flags = trailing_padding(&[real], kv_seq);
    let masks = Masks { key_padding: Some(KeyPadding::new(&flags, 1, kv_seq).unwrap()), ..Masks::NONE };
    let cross = Call::new(1, q_seq).cross(Cross::new(&k, &v, kv_seq));
    let (y, cache) = layer.forward_train(&q, &cross.masks(masks)).unwrap();
    let mut grads = layer.weights.zeros_like();
    let d = layer.backward(&cache, &g, &mut grads).unwrap();
    let (y_cut, cut_cache) =
        layer.forward_train(&q, &Call::new(1, q_seq).cross(Cross::new(&k[..real * e], &v[..real * e], real))).unwrap();
    let mut cut_grads = layer.weights.zeros_like();
    let d_cut = layer.backward(&cut_cache, &g, &mut cut_grads).unwrap();
    assert_close("output", &y, &y_cut);
    assert_close("d query", &d.query, &d_cut.query);
    let (dk, dv) = (d.key.unwrap(), d.value.unwrap());
    assert_close("d key", &dk[..real * e], &d_cut.key.unwrap());
    assert_close("d value", &dv[..real * e], &d_cut.value.unwrap());
    assert!(dk[real * e..].iter().chain(&dv[real * e..]).all(|&x| x == 0.0), "padded keys get no gradient");
    for (p, w) in grads.params().iter().zip(cut_grads.params()) {
        assert_close(&p.name, p.data, w.data);
    }
    // A mask of the query's length is a typed error, not a silent misread.
    let wrong = trailing_padding(&[real], q_seq);
    let masks = Masks { key_padding: Some(KeyPadding::new(&wrong, 1, q_seq).unwrap()), ..Masks::NONE };
    let err = layer.forward_train(&q, &cross.masks(masks));
    assert!(err.is_err());
}
