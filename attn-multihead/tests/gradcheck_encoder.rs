//! Finite-difference gradient checks (float64, reference backend) of the LongNet encoder layer and a 2-layer stack.

use std::sync::Arc;

use attn_core::{DilatedConfig, Mixing};
use attn_multihead::{Call, EncoderConfig, LongNetEncoder, Mode, NamedParams, ReferenceBackend};
use attn_testkit::rng::SeededRng;

const H: f64 = 1e-6;

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn assert_close(what: &str, analytic: &[f64], numeric: &[f64]) {
    let scale = analytic.iter().map(|a| a.abs()).fold(1e-3, f64::max);
    for (i, (a, n)) in analytic.iter().zip(numeric).enumerate() {
        assert!((a - n).abs() <= 1e-6 * scale + 1e-8, "{what}[{i}]: analytic {a} vs finite difference {n}");
    }
}

fn check_stack(cfg: EncoderConfig, layers: usize, batch: usize, seq: usize, mode: Mode, seed: u64) {
    let mut rng = SeededRng::new(seed);
    let mut enc = LongNetEncoder::<f64>::new(cfg, layers, seed, Arc::new(ReferenceBackend)).unwrap();
    for p in enc.params_mut() {
        if p.name.ends_with("bias") || p.name.contains("norm") {
            p.data.iter_mut().for_each(|x| *x += 0.2 * rng.normal());
        }
    }
    let e = enc.layers[0].config().d_model;
    let x: Vec<f64> = (0..batch * seq * e).map(|_| rng.normal()).collect();
    let g: Vec<f64> = (0..batch * seq * e).map(|_| rng.normal()).collect();
    let (y, cache) = enc.forward_train(&x, &Call::new(batch, seq).mode(mode)).unwrap();
    assert_eq!(y, enc.forward(&x, &Call::new(batch, seq).mode(mode)).unwrap(), "forward and forward_train agree");
    let mut grads = enc.zero_grads();
    let dx = enc.backward(&cache, &g, &mut grads).unwrap();
    let loss =
        |enc: &LongNetEncoder<f64>, x: &[f64]| dot(&enc.forward(x, &Call::new(batch, seq).mode(mode)).unwrap(), &g);

    let numeric: Vec<f64> = (0..x.len())
        .map(|i| {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[i] += H;
            xm[i] -= H;
            (loss(&enc, &xp) - loss(&enc, &xm)) / (2.0 * H)
        })
        .collect();
    assert_close("dx", &dx, &numeric);

    let mut checked = 0;
    for (li, lg) in grads.iter().enumerate() {
        let names: Vec<(String, usize)> =
            enc.layers[li].params().iter().map(|p| (p.name.clone(), p.data.len())).collect();
        let analytic: Vec<Vec<f64>> = lg.params().iter().map(|p| p.data.to_vec()).collect();
        assert_eq!(names.len(), analytic.len());
        for (pi, (name, len)) in names.iter().enumerate() {
            let numeric: Vec<f64> = (0..*len)
                .map(|i| {
                    let at = |delta: f64| {
                        let mut e2 = enc.clone();
                        e2.layers[li].params_mut()[pi].data[i] += delta;
                        loss(&e2, &x)
                    };
                    (at(H) - at(-H)) / (2.0 * H)
                })
                .collect();
            assert_close(&format!("layers.{li}.{name}"), &analytic[pi], &numeric);
            checked += len;
        }
    }
    assert_eq!(checked, enc.num_params());
}

#[test]
fn encoder_layer_gradients() {
    let cfg = EncoderConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap(), 12);
    check_stack(cfg, 1, 2, 8, Mode::Eval, 1);
}

#[test]
fn encoder_layer_longnet_causal_with_training_dropout() {
    let longnet = DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).mixing(Mixing::LongNet).causal();
    let mut cfg = EncoderConfig::new(8, 2, longnet.build().unwrap(), 12);
    cfg.dropout = 0.2;
    check_stack(cfg, 1, 1, 9, Mode::Train { seed: 42 }, 2);
}

#[test]
fn two_layer_stack_gradients_and_names() {
    let cfg = EncoderConfig::new(4, 2, DilatedConfig::new(&[4], &[2]).unwrap(), 6);
    check_stack(cfg.clone(), 2, 1, 6, Mode::Eval, 3);
    let enc = LongNetEncoder::<f64>::new(cfg, 2, 3, Arc::new(ReferenceBackend)).unwrap();
    let names: Vec<String> = enc.params().into_iter().map(|p| p.name).collect();
    for want in ["layers.0.norm1.weight", "layers.0.self_attn.q_proj.weight", "layers.1.self_attn.norm.bias"] {
        assert!(names.iter().any(|n| n == want), "{want} missing from {names:?}");
    }
    for want in ["layers.1.linear2.bias", "layers.1.norm3.weight"] {
        assert!(names.iter().any(|n| n == want), "{want} missing");
    }
}

#[test]
fn windowed_forward_equals_the_full_forward() {
    let causal = DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).causal();
    let cfg = EncoderConfig::new(8, 2, causal.build().unwrap(), 12);
    let enc = LongNetEncoder::<f64>::new(cfg, 2, 7, Arc::new(ReferenceBackend)).unwrap();
    let mut rng = SeededRng::new(3);
    let (b, n) = (2, 21);
    let x: Vec<f64> = (0..b * n * 8).map(|_| rng.normal()).collect();
    let full = enc.forward(&x, &Call::new(b, n)).unwrap();
    let mut calls = vec![];
    let windowed = enc.forward_windows(&x, b, n, 8, |done| calls.push(done)).unwrap();
    assert_eq!(calls, vec![8, 16, 21, 29, 37, 42]);
    let err = full.iter().zip(&windowed).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(err < 1e-12, "{err}");
    let msg = enc.forward_windows(&x, b, n, 12, |_| {}).unwrap_err().to_string();
    assert!(msg.contains("segment length 8"), "{msg}");
    assert!(enc.forward_windows(&x, b, n, 64, |_| {}).is_ok(), "one window covering the sequence is always exact");
}
