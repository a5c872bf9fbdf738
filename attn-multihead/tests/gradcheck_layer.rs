//! Finite-difference gradient checks (float64, reference backend) of `MultiheadDilatedAttention`:
//! every input and every weight, self- and cross-attention, both mixing modes, causal, dropout,
//! grouped key/value heads, key padding and packed sequences.

use std::sync::Arc;

use attn_core::{BlockMaskBuf, DilatedConfig, KeyPadding, Masks, Mixing, PackedSequences};
use attn_multihead::{Bias, LayerNorms};
use attn_multihead::{
    Call, Cross, InputGrads, Mode, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, NamedParams,
    NormLayout, ReferenceBackend,
};
use attn_testkit::rng::SeededRng;

const H: f64 = 1e-6;

fn randn(rng: &mut SeededRng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.normal()).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Central difference of `loss` along coordinate `i` of `x`.
fn fd(x: &mut [f64], i: usize, loss: &mut dyn FnMut(&[f64]) -> f64) -> f64 {
    let orig = x[i];
    x[i] = orig + H;
    let lp = loss(x);
    x[i] = orig - H;
    let lm = loss(x);
    x[i] = orig;
    (lp - lm) / (2.0 * H)
}

fn assert_close(what: &str, analytic: &[f64], numeric: &[f64]) {
    let scale = analytic.iter().map(|a| a.abs()).fold(1e-3, f64::max);
    for (i, (a, n)) in analytic.iter().zip(numeric).enumerate() {
        assert!((a - n).abs() <= 1e-6 * scale + 1e-8, "{what}[{i}]: analytic {a} vs finite difference {n}");
    }
}

struct Case {
    cfg: MultiheadConfig,
    batch: usize,
    q_seq: usize,
    kv_seq: Option<usize>,
    mode: Mode,
    /// Key padding flags `[batch, key seq]` and packed sequences (self-attention).
    padding: Option<Vec<bool>>,
    cu_seqlens: Option<Vec<usize>>,
    block_mask: Option<BlockMaskBuf>,
    /// A deliberate error put into the analytic query gradient before it is judged (the
    /// planted-error test: the check must reject it).
    plant: Option<fn(&mut [f64])>,
    /// The layer's segment-window target (`with_window_rows`; 0: one pass).
    window_rows: usize,
}

impl Case {
    fn plain(cfg: MultiheadConfig, batch: usize, q_seq: usize, kv_seq: Option<usize>, mode: Mode) -> Self {
        let (padding, cu_seqlens, block_mask, plant) = (None, None, None, None);
        Case { cfg, batch, q_seq, kv_seq, mode, padding, cu_seqlens, block_mask, plant, window_rows: 0 }
    }
}

fn check(case: Case, seed: u64) {
    let mut rng = SeededRng::new(seed);
    let mut layer = MultiheadDilatedAttention::<f64>::new(case.cfg.clone(), seed, Arc::new(ReferenceBackend))
        .unwrap()
        .with_window_rows(case.window_rows);
    // Non-trivial biases and norm parameters (`norm`, `q_ln`, `k_ln`) so their gradients
    // are exercised.
    for p in layer.weights.params_mut() {
        if !p.name.ends_with("weight") || p.name.starts_with("norm") || p.name.ends_with("_ln.weight") {
            p.data.iter_mut().for_each(|x| *x += 0.2 * rng.normal());
        }
    }
    let e = case.cfg.embed_dim;
    let (b, n) = (case.batch, case.q_seq);
    let mut query = randn(&mut rng, b * n * e);
    let kv_seq = case.kv_seq.unwrap_or(n);
    let mut key = randn(&mut rng, b * kv_seq * e);
    let mut value = randn(&mut rng, b * kv_seq * e);
    let g = randn(&mut rng, b * n * e);
    let mode = case.mode;
    let masks = Masks {
        key_padding: case.padding.as_deref().map(|f| KeyPadding::new(f, b, case.kv_seq.unwrap_or(n)).unwrap()),
        packing: case.cu_seqlens.as_deref().map(|c| PackedSequences::new(c).unwrap()),
        block: case.block_mask.as_ref().map(BlockMaskBuf::view),
    };
    let run = |layer: &MultiheadDilatedAttention<f64>, q: &[f64], k: &[f64], v: &[f64]| match case.kv_seq {
        None => layer.forward_train(q, &Call::new(b, n).masks(masks).mode(mode)).unwrap(),
        Some(m) => layer.forward_train(q, &Call::new(b, n).cross(Cross::new(k, v, m)).masks(masks).mode(mode)).unwrap(),
    };
    let (_, cache) = run(&layer, &query, &key, &value);
    let mut grads = layer.weights.zeros_like();
    let InputGrads { query: mut dq, key: dk, value: dv } = layer.backward(&cache, &g, &mut grads).unwrap();
    if let Some(plant) = case.plant {
        plant(&mut dq);
    }

    // Inputs.
    let numeric: Vec<f64> = (0..query.len())
        .map(|i| {
            let (k, v) = (key.clone(), value.clone());
            fd(&mut query, i, &mut |q| dot(&run(&layer, q, &k, &v).0, &g))
        })
        .collect();
    assert_close("d query", &dq, &numeric);
    if case.kv_seq.is_some() {
        let numeric: Vec<f64> = (0..key.len())
            .map(|i| {
                let (q, v) = (query.clone(), value.clone());
                fd(&mut key, i, &mut |k| dot(&run(&layer, &q, k, &v).0, &g))
            })
            .collect();
        assert_close("d key", &dk.unwrap(), &numeric);
        let numeric: Vec<f64> = (0..value.len())
            .map(|i| {
                let (q, k) = (query.clone(), key.clone());
                fd(&mut value, i, &mut |v| dot(&run(&layer, &q, &k, v).0, &g))
            })
            .collect();
        assert_close("d value", &dv.unwrap(), &numeric);
    } else {
        assert!(dk.is_none() && dv.is_none());
    }

    // Every weight.
    let names: Vec<(String, usize)> = layer.weights.params().iter().map(|p| (p.name.clone(), p.data.len())).collect();
    let analytic: Vec<Vec<f64>> = grads.params().iter().map(|p| p.data.to_vec()).collect();
    for (pi, (name, len)) in names.iter().enumerate() {
        let mut numeric = Vec::with_capacity(*len);
        for i in 0..*len {
            let perturbed = |delta: f64| {
                let mut w: MultiheadWeights<f64> = layer.weights.clone();
                w.params_mut()[pi].data[i] += delta;
                let l =
                    MultiheadDilatedAttention::from_weights(case.cfg.clone(), w, Arc::new(ReferenceBackend)).unwrap();
                dot(&run(&l, &query, &key, &value).0, &g)
            };
            numeric.push((perturbed(H) - perturbed(-H)) / (2.0 * H));
        }
        assert_close(name, &analytic[pi], &numeric);
    }
    layer.weights.params().iter().for_each(|p| assert!(p.data.iter().all(|x| x.is_finite())));
}

#[test]
fn self_attention_head_groups_with_sub_ln() {
    let cfg = MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap());
    check(Case::plain(cfg, 2, 10, None, Mode::Eval), 1);
}

#[test]
fn self_attention_longnet_causal() {
    let cfg = MultiheadConfig::new(
        8,
        2,
        DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).mixing(Mixing::LongNet).causal().build().unwrap(),
    );
    check(Case::plain(cfg, 1, 9, None, Mode::Eval), 2);
}

#[test]
fn cross_attention_causal_without_norm() {
    let cfg = MultiheadConfig::new(
        6,
        3,
        DilatedConfig::builder().segments(&[3, 6]).dilations(&[1, 2]).causal().build().unwrap(),
    )
    .with_layer_norm(LayerNorms::Absent);
    check(Case::plain(cfg, 1, 7, Some(7), Mode::Eval), 3);
}

#[test]
fn cross_attention_other_kv_length_longnet_no_bias() {
    let cfg = MultiheadConfig::new(
        8,
        2,
        DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).mixing(Mixing::LongNet).build().unwrap(),
    )
    .with_bias(Bias::Absent);
    check(Case::plain(cfg, 1, 5, Some(11), Mode::Eval), 4);
}

#[test]
fn training_dropout_is_seeded_and_differentiated() {
    let cfg = MultiheadConfig::new(8, 2, DilatedConfig::new(&[4], &[1]).unwrap()).with_dropout(0.3);
    check(Case::plain(cfg.clone(), 1, 8, None, Mode::Train { seed: 9 }), 5);
    let layer = MultiheadDilatedAttention::<f64>::new(cfg, 0, Arc::new(ReferenceBackend)).unwrap();
    let x: Vec<f64> = (0..64).map(|i| (i as f64 * 0.3).sin()).collect();
    let eval = layer.forward(&x, &Call::new(1, 8)).unwrap();
    assert_eq!(eval, layer.forward(&x, &Call::new(1, 8)).unwrap(), "eval is deterministic");
    let t1 = layer.forward(&x, &Call::new(1, 8).mode(Mode::Train { seed: 1 })).unwrap();
    assert_eq!(t1, layer.forward(&x, &Call::new(1, 8).mode(Mode::Train { seed: 1 })).unwrap(), "train is seeded");
    assert_ne!(t1, layer.forward(&x, &Call::new(1, 8).mode(Mode::Train { seed: 2 })).unwrap());
    assert_ne!(t1, eval);
}

#[test]
fn grouped_heads_with_key_padding() {
    let cfg = MultiheadConfig::new(
        8,
        4,
        DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).mixing(Mixing::LongNet).causal().build().unwrap(),
    )
    .with_num_kv_heads(2);
    let padding = (0..18).map(|i| i % 4 == 1).collect();
    check(Case { padding: Some(padding), ..Case::plain(cfg, 2, 9, None, Mode::Eval) }, 6);
}

#[test]
fn one_key_value_head_with_cross_attention() {
    let cfg = MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap()).with_num_kv_heads(1);
    check(Case::plain(cfg, 1, 5, Some(9), Mode::Eval), 7);
}

#[test]
fn packed_sequences_with_one_key_value_head() {
    let cfg = MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap()).with_num_kv_heads(1);
    check(Case { cu_seqlens: Some(vec![0, 3, 10]), ..Case::plain(cfg, 1, 10, None, Mode::Eval) }, 8);
}

#[test]
fn cross_attention_with_key_padding_and_grouped_heads() {
    let cfg = MultiheadConfig::new(
        8,
        4,
        DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).mixing(Mixing::LongNet).build().unwrap(),
    )
    .with_num_kv_heads(2);
    let padding = (0..18).map(|i| i % 3 == 2 || i >= 15).collect();
    check(Case { padding: Some(padding), ..Case::plain(cfg, 2, 7, Some(9), Mode::Eval) }, 9);
}

/// A per-head block mask (blocks of 3, causal LongNet, grouped heads): the backward
/// under the mask is the derivative of the forward under it.
#[test]
fn block_mask_per_head_with_grouped_heads() {
    let cfg = MultiheadConfig::new(
        8,
        4,
        DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).mixing(Mixing::LongNet).causal().build().unwrap(),
    )
    .with_num_kv_heads(2);
    let dims = attn_core::BlockDims { batch: 1, heads: 4, q_blocks: 4, k_blocks: 4 };
    let mask = BlockMaskBuf::from_fn(dims, 3, |_, h, i, j| i == j || (i + j + h) % 3 == 0).unwrap();
    check(Case { block_mask: Some(mask), ..Case::plain(cfg, 2, 10, None, Mode::Eval) }, 10);
}

/// qk-LN (`q_ln` over q and over the merged heads, `k_ln` over k): every input and
/// weight, the backward walking 2 segment windows of 8 rows.
#[test]
fn qk_ln_self_attention_in_segment_windows() {
    let cfg =
        MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap()).with_norm_layout(NormLayout::QkLn);
    check(Case { window_rows: 8, ..Case::plain(cfg, 2, 16, None, Mode::Eval) }, 11);
}

/// qk-LN with grouped heads (`k_ln` over `kv_dim` = 4 features), causal LongNet, key
/// padding and training dropout.
#[test]
fn qk_ln_grouped_heads_causal_with_padding_and_dropout() {
    let cfg = MultiheadConfig::new(
        8,
        4,
        DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).mixing(Mixing::LongNet).causal().build().unwrap(),
    )
    .with_num_kv_heads(2)
    .with_dropout(0.2)
    .with_norm_layout(NormLayout::QkLn);
    let padding = (0..18).map(|i| i % 4 == 1).collect();
    check(Case { padding: Some(padding), ..Case::plain(cfg, 2, 9, None, Mode::Train { seed: 4 }) }, 12);
}

/// qk-LN in cross-attention with keys of their own length (the split q and k/v buffers).
#[test]
fn qk_ln_cross_attention_other_kv_length() {
    let cfg =
        MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap()).with_norm_layout(NormLayout::QkLn);
    check(Case::plain(cfg, 2, 5, Some(9), Mode::Eval), 13);
}

/// The finite-difference check rejects a query gradient with one value off by 1e-5 (ten
/// times its bound at a gradient scale of about 1).
#[test]
fn a_planted_gradient_error_is_rejected() {
    let cfg = MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap());
    let plant: fn(&mut [f64]) = |dq| dq[17] += 1e-5;
    let caught =
        std::panic::catch_unwind(|| check(Case { plant: Some(plant), ..Case::plain(cfg, 1, 6, None, Mode::Eval) }, 1));
    let msg = caught.expect_err("a wrong d query passed the finite-difference check");
    let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("d query[17]"), "{msg}");
}
