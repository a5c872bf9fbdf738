//! The burn encoder stack against `attn-multihead`'s: output and every gradient (input and
//! parameters, by name) of the same MAGNETO weights in one [`Mode`], in f32.

use std::sync::Arc;

use attn_burn::AttnOptions;
use attn_burn::nn::{LongNetEncoder, Mode};
use attn_core::DType as AttnDType;
use attn_multihead::{Call, EncoderConfig, NamedParams};
use attn_testkit::{Tolerance, random_vec};
use burn_tensor::{DType, Tensor, TensorData};

use super::params::param_grads;
use super::{grad_device, values};

/// Named results: `out`, `dx`, then each parameter's gradient.
pub type Named = Vec<(String, Vec<f32>)>;

/// `attn-multihead`'s two-layer stack (seed 11) in `mode`: its results and the burn stack's
/// (loss `sum(out * grad_out)`).
pub fn encoder_runs(config: &EncoderConfig, mode: Mode) -> (Named, Named) {
    let backend = Arc::new(attn_kernels::CpuBackend::new(1).expect("cpu backend"));
    let native = attn_multihead::LongNetEncoder::<f32>::new(config.clone(), 2, 11, backend).expect("encoder");
    let device = grad_device();
    let stack = LongNetEncoder::from_encoder(&native, config, &device, DType::F32).expect("burn encoder");
    let (b, n, e) = (2, 32, config.d_model);
    let (x, go) = (random_vec(1, b * n * e), random_vec(2, b * n * e));
    let (want_out, cache) = native.forward_train(&x, &Call::new(b, n).mode(mode)).expect("forward");
    let mut want_grads = native.zero_grads();
    let want_dx = native.backward(&cache, &go, &mut want_grads).expect("backward");
    let mut want = vec![("out".to_string(), want_out), ("dx".to_string(), want_dx)];
    for (i, g) in want_grads.iter().enumerate() {
        want.extend(g.params().into_iter().map(|p| (format!("layers.{i}.{}", p.name), p.data.to_vec())));
    }

    let xt = Tensor::<3>::from_data(TensorData::new(x, [b, n, e]), (&device, DType::F32)).require_grad();
    let opts = AttnOptions::new(config.attention.clone());
    let out = stack.forward_mode(xt.clone(), &opts, mode).expect("burn forward");
    let got_grads = (out.clone() * Tensor::<3>::from_data(TensorData::new(go, [b, n, e]), &device)).sum().backward();
    let mut got = vec![("out".to_string(), values(out)), ("dx".to_string(), values(xt.grad(&got_grads).expect("dx")))];
    got.extend(param_grads(&stack, &got_grads));
    (got, want)
}

/// The worst relative error of `got` against `want`, and the name it occurs at.
pub fn worst(got: &Named, want: &Named) -> (f64, String) {
    assert_eq!(got.iter().map(|g| &g.0).collect::<Vec<_>>(), want.iter().map(|g| &g.0).collect::<Vec<_>>());
    let norm = |x: &[f32]| x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
    let mut worst = (0.0, String::new());
    for ((name, g), (_, w)) in got.iter().zip(want) {
        // The key bias's gradient is zero by the definition (attention is unchanged by one
        // shift of every key): both sides hold roundoff, judged against the scale of the
        // key weight's gradient, as the golden checker judges such a bias.
        let weight = name.strip_suffix("k_proj.bias").map(|m| format!("{m}k_proj.weight"));
        let scale = match weight.and_then(|wn| want.iter().find(|(n, _)| *n == wn)) {
            Some((_, ww)) => norm(ww),
            None => norm(w),
        };
        let diff: Vec<f32> = g.iter().zip(w).map(|(a, b)| a - b).collect();
        let err = if g.len() == w.len() { norm(&diff) / scale } else { f64::INFINITY };
        if err > worst.0 {
            worst = (err, name.clone());
        }
    }
    worst
}

/// The burn stack equals `attn-multihead`'s in `mode` within the f32 bound.
pub fn encoder_against_attn_multihead(config: &EncoderConfig, mode: Mode) {
    let (got, want) = encoder_runs(config, mode);
    let bound = Tolerance::for_dtype(AttnDType::F32).rel_l2;
    let (err, name) = worst(&got, &want);
    assert!(err <= bound, "{mode:?} {name}: relative error {err:.2e} over {bound:.0e}");
}
