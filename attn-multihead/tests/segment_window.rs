//! Inference in windows (`with_window_rows`): the same function as one pass over
//! the whole sequence, with buffers for one window.

use std::sync::Arc;

use attn_core::{DType, DilatedConfig, Mixing};
use attn_kernels::CpuBackend;
use attn_multihead::{Bias, LayerNorms};
use attn_multihead::{
    Call, DEFAULT_WINDOW_ROWS, Mode, MultiheadConfig, MultiheadDilatedAttention, MultiheadWorkspace, NamedParams,
    ReferenceBackend,
};
use attn_testkit::rng::random_vec;
use attn_testkit::tolerance::{Tolerance, rel_l2_error};

/// A float64 reference layer with random biases and LayerNorm gains (so that every
/// per-token step shows), and its f32 twin on the CPU kernels.
fn layers(cfg: &MultiheadConfig, seed: u64) -> (MultiheadDilatedAttention<f64>, MultiheadDilatedAttention<f32>) {
    let mut l64 = MultiheadDilatedAttention::<f64>::new(cfg.clone(), seed, Arc::new(ReferenceBackend)).unwrap();
    for (i, p) in l64.weights.params_mut().into_iter().enumerate() {
        let r = random_vec(40 + seed * 16 + i as u64, p.data.len());
        p.data.iter_mut().zip(r).for_each(|(d, x)| *d += 0.3 * x as f64);
    }
    let mut l32 = MultiheadDilatedAttention::<f32>::new(cfg.clone(), 0, Arc::new(CpuBackend::new(2).unwrap())).unwrap();
    for (d, s) in l32.weights.params_mut().into_iter().zip(l64.weights.params()) {
        d.data.iter_mut().zip(s.data).for_each(|(a, &b)| *a = b as f32);
    }
    (l64, l32)
}

fn configs() -> Vec<MultiheadConfig> {
    let base = MultiheadConfig::new(32, 4, DilatedConfig::new(&[4, 8, 16], &[1, 2, 4]).unwrap());
    vec![
        base.clone(),
        MultiheadConfig::new(
            32,
            4,
            DilatedConfig::builder()
                .segments(&[4, 8, 16])
                .dilations(&[1, 2, 4])
                .causal()
                .mixing(Mixing::LongNet)
                .build()
                .unwrap(),
        ),
        // lcm 12: windows are multiples of 12, not powers of two.
        MultiheadConfig::new(
            32,
            4,
            DilatedConfig::builder().segments(&[6, 4]).dilations(&[2, 1]).causal().build().unwrap(),
        ),
        MultiheadConfig::new(
            32,
            4,
            DilatedConfig::builder().segments(&[6, 4]).dilations(&[3, 2]).mixing(Mixing::LongNet).build().unwrap(),
        )
        .with_layer_norm(LayerNorms::Absent),
    ]
}

/// For every config, batch 1 and 2, sequence lengths that are and are not multiples
/// of the window, and several window sizes: the windowed forward equals one pass.
#[test]
fn windowed_inference_equals_one_pass() {
    let f64_bound = Tolerance::for_dtype(DType::F64).rel_l2;
    let f32_bound = Tolerance::for_dtype(DType::F32).rel_l2;
    for (c, cfg) in configs().into_iter().enumerate() {
        let (l64, l32) = layers(&cfg, c as u64);
        for (batch, seq) in [(1, 37), (2, 48), (2, 17), (1, 100)] {
            let x = random_vec(7 * c as u64 + seq as u64, batch * seq * 32);
            let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let whole64 = l64.clone().with_window_rows(0).forward(&x64, &Call::new(batch, seq)).unwrap();
            let (train64, _) = l64.forward_train(&x64, &Call::new(batch, seq)).unwrap();
            assert_eq!(whole64, train64, "window 0 is the one-pass forward");
            for target in [1, 10, 24, 40] {
                let what = format!("config {c}, batch {batch}, seq {seq}, window target {target}");
                let got64 = l64.clone().with_window_rows(target).forward(&x64, &Call::new(batch, seq)).unwrap();
                let err = rel_l2_error(&got64, &whole64);
                assert!(err <= f64_bound, "{what}: f64 windowed {err:.2e} from one pass");
                let got32 = l32.clone().with_window_rows(target).forward(&x, &Call::new(batch, seq)).unwrap();
                let err = rel_l2_error(&got32, &whole64);
                assert!(err <= f32_bound, "{what}: f32 windowed {err:.2e} from the f64 one pass");
            }
        }
    }
}

/// A workspace reused by windowed passes holds one window's buffers, not the
/// sequence's, and repeated calls (a shorter last window in between) give the same
/// output as a fresh forward.
#[test]
fn a_windowed_workspace_holds_one_window() {
    let cfg = MultiheadConfig::new(32, 4, DilatedConfig::new(&[4, 8, 16], &[1, 2, 4]).unwrap());
    let (_, l32) = layers(&cfg, 5);
    let (batch, seq, e, heads) = (2, 100, 32, 4);
    let l32 = l32.with_window_rows(20); // rounds up to 32 rows (lcm 16)
    let x = random_vec(11, batch * seq * e);
    let fresh = l32.forward(&x, &Call::new(batch, seq)).unwrap();
    let mut ws = MultiheadWorkspace::new();
    let mut out = vec![f32::NAN; fresh.len()];
    for call in 0..3 {
        out.fill(f32::NAN);
        l32.forward_into(&x, &Call::new(batch, seq), &mut ws, &mut out).unwrap();
        assert_eq!(out, fresh, "call {call}");
    }
    // q/k/v, attention output and sub-LN output of 32 rows (f32), and the LSE.
    let window_bytes = 32 * (5 * e * 4 + heads * 4);
    assert!(ws.bytes() <= window_bytes, "workspace holds {} bytes, one window is {window_bytes}", ws.bytes());
    let mut whole_ws = MultiheadWorkspace::new();
    let one_pass = l32.clone().with_window_rows(0);
    one_pass.forward_into(&x, &Call::new(batch, seq), &mut whole_ws, &mut out).unwrap();
    assert!(whole_ws.bytes() >= 5 * batch * seq * e * 4, "one pass holds {} bytes", whole_ws.bytes());
    let err = rel_l2_error(&out, &fresh.iter().map(|&v| v as f64).collect::<Vec<_>>());
    assert!(err <= Tolerance::for_dtype(DType::F32).rel_l2, "one pass {err:.2e} from windowed");
}

/// Training passes are not windowed (the backward needs every row), and short
/// sequences make one pass under the default window.
#[test]
fn training_and_short_sequences_make_one_pass() {
    let cfg = MultiheadConfig::new(32, 4, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap()).with_dropout(0.25);
    let (_, l32) = layers(&cfg, 2);
    let l32 = l32.with_window_rows(8);
    let x = random_vec(3, 64 * 32);
    let mode = Mode::Train { seed: 4 };
    let (want, _) = l32.forward_train(&x, &Call::new(1, 64).mode(mode)).unwrap();
    let mut ws = MultiheadWorkspace::new();
    let mut out = vec![0f32; want.len()];
    l32.forward_into(&x, &Call::new(1, 64).mode(mode), &mut ws, &mut out).unwrap();
    assert_eq!(out, want, "a training pass walks the whole sequence");
    assert!(ws.bytes() >= 5 * 64 * 32 * 4);
    let default = l32.with_window_rows(DEFAULT_WINDOW_ROWS);
    let mut ws = MultiheadWorkspace::new();
    default.forward_into(&x, &Call::new(1, 64), &mut ws, &mut out).unwrap();
    assert!(ws.bytes() >= 5 * 64 * 32 * 4, "64 rows fit in one default window");
}

/// A wrong output length under windowing is the same typed error, not a panic.
#[test]
fn a_wrong_output_buffer_is_an_error_when_windowed() {
    let cfg = MultiheadConfig::new(32, 4, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap());
    let (_, l32) = layers(&cfg, 1);
    let l32 = l32.with_window_rows(8);
    let x = random_vec(5, 64 * 32);
    let mut ws = MultiheadWorkspace::new();
    for len in [0, 64 * 32 - 1, 64 * 32 + 32] {
        let mut out = vec![0f32; len];
        let err = l32.forward_into(&x, &Call::new(1, 64), &mut ws, &mut out).unwrap_err();
        assert!(err.to_string().contains("output"), "{err}");
    }
}

/// Every parameter gradient and the input gradient of `layer` for `x`, `g`.
fn gradients<F: attn_multihead::LayerFloat>(
    layer: &MultiheadDilatedAttention<F>,
    x: &[F],
    g: &[F],
    (batch, seq): (usize, usize),
    mode: Mode,
) -> (Vec<(String, Vec<F>)>, Vec<F>) {
    let (_, cache) = layer.forward_train(x, &Call::new(batch, seq).mode(mode)).unwrap();
    let mut grads = layer.zero_grads();
    let dx = layer.backward(&cache, g, &mut grads).unwrap().query;
    (grads.params().into_iter().map(|p| (p.name.clone(), p.data.to_vec())).collect(), dx)
}

/// The backward of self-attention in windows equals the one-pass backward: in f64 on
/// the reference, and in f32 on the CPU kernels against the f64 one pass; with
/// training dropout (masks sliced per window), sub-LN and biases on and off, head
/// groups (row-sparse input projections) and LongNet (dense ones).
#[test]
fn windowed_backward_equals_one_pass() {
    let f64_bound = Tolerance::for_dtype(DType::F64).rel_l2;
    let f32_bound = Tolerance::for_dtype(DType::F32).rel_l2;
    let mut cfgs = configs();
    cfgs.push(
        MultiheadConfig::new(32, 4, DilatedConfig::new(&[4, 8, 16], &[1, 2, 4]).unwrap())
            .with_dropout(0.2)
            .with_bias(Bias::Absent),
    );
    for (c, cfg) in cfgs.into_iter().enumerate() {
        let (l64, l32) = layers(&cfg, 10 + c as u64);
        let mode = if cfg.dropout > 0.0 { Mode::Train { seed: 3 } } else { Mode::Eval };
        for (batch, seq) in [(1, 37), (2, 48)] {
            let x = random_vec(50 + c as u64, batch * seq * 32);
            let g = random_vec(60 + c as u64, batch * seq * 32);
            let to64 = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<_>>();
            let (x64, g64) = (to64(&x), to64(&g));
            let whole = l64.clone().with_window_rows(0);
            let (want, want_dx) = gradients(&whole, &x64, &g64, (batch, seq), mode);
            for target in [1, 24] {
                let what = format!("config {c}, batch {batch}, seq {seq}, window target {target}");
                let (got, got_dx) = gradients(&l64.clone().with_window_rows(target), &x64, &g64, (batch, seq), mode);
                let (got32, got32_dx) = gradients(&l32.clone().with_window_rows(target), &x, &g, (batch, seq), mode);
                assert!(rel_l2_error(&got_dx, &want_dx) <= f64_bound, "{what}: f64 dx");
                let err = rel_l2_error(&got32_dx, &want_dx);
                assert!(err <= f32_bound, "{what}: f32 dx {err:.2e}");
                for (((name, w), (_, a)), (_, a32)) in want.iter().zip(&got).zip(&got32) {
                    if name.ends_with("k_proj.bias") {
                        // Zero in exact arithmetic (softmax ignores a per-row constant): only
                        // round-off, measured against its sibling v_proj.bias gradient, which
                        // sums rows of the same size.
                        let v_bias = &want.iter().find(|p| p.0.ends_with("v_proj.bias")).unwrap().1;
                        let scale = v_bias.iter().map(|v| v * v).sum::<f64>().sqrt();
                        let max = |v: &mut dyn Iterator<Item = f64>| v.fold(0.0f64, |m, x| m.max(x.abs()));
                        assert!(max(&mut a.iter().copied()) < 1e-12 * scale, "{what}: f64 d {name} not zero");
                        let err = max(&mut a32.iter().map(|&v| v as f64));
                        assert!(err < 1e-5 * scale, "{what}: f32 d {name} {err:.2e} against {scale:.2e}");
                        continue;
                    }
                    assert!(rel_l2_error(a, w) <= f64_bound, "{what}: f64 d {name} {:.2e}", rel_l2_error(a, w));
                    let err = rel_l2_error(a32, w);
                    assert!(err <= f32_bound, "{what}: f32 d {name} {err:.2e}");
                }
            }
        }
    }
}

/// `LongNetEncoder::forward` in eval walks segment windows (feed-forward included):
/// the same function as one pass; training passes and `with_window_rows(0)` make one pass.
#[test]
fn encoder_eval_forward_walks_segment_windows() {
    use attn_multihead::{EncoderConfig, LongNetEncoder};
    let causal = DilatedConfig::builder().segments(&[4, 6]).dilations(&[1, 2]).causal();
    let cfg = EncoderConfig::new(8, 2, causal.build().unwrap(), 12);
    let enc = LongNetEncoder::<f64>::new(cfg, 2, 7, Arc::new(ReferenceBackend)).unwrap();
    let (b, n) = (2, 53);
    let x: Vec<f64> = random_vec(9, b * n * 8).into_iter().map(|v| v as f64).collect();
    // `forward_into` is one pass over the whole sequence.
    let one_pass_of = |enc: &LongNetEncoder<f64>, mode: Mode| {
        let mut y = vec![0.0; x.len()];
        enc.forward_into(&x, &Call::new(b, n).mode(mode), &mut MultiheadWorkspace::new(), &mut y).unwrap();
        y
    };
    let one_pass = one_pass_of(&enc, Mode::Eval);
    let whole = enc.clone().with_window_rows(0).forward(&x, &Call::new(b, n)).unwrap();
    assert_eq!(whole, one_pass, "window 0 is one pass");
    let windowed = enc.clone().with_window_rows(10).forward(&x, &Call::new(b, n)).unwrap();
    // Windows of 12 rows (lcm of 4 and 6): the same as forward_windows with 12.
    assert_eq!(windowed, enc.forward_windows(&x, b, n, 12, |_| {}).unwrap());
    let err = rel_l2_error(&windowed, &one_pass);
    assert!(err <= Tolerance::for_dtype(DType::F64).rel_l2, "windowed {err:.2e} from one pass");
    let mut dropout = EncoderConfig::new(8, 2, DilatedConfig::new(&[4, 6], &[1, 2]).unwrap(), 12);
    dropout.dropout = 0.3;
    let enc = LongNetEncoder::<f64>::new(dropout, 2, 7, Arc::new(ReferenceBackend)).unwrap().with_window_rows(10);
    let mode = Mode::Train { seed: 5 };
    let want = one_pass_of(&enc, mode);
    assert_eq!(enc.forward(&x, &Call::new(b, n).mode(mode)).unwrap(), want, "a training pass is one pass");
}
