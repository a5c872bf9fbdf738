//! The burn encoder stack against `attn-multihead`'s: output and every gradient (input and
//! parameters, by name) of the same MAGNETO weights in one [`Mode`], in f32.

use std::sync::Arc;

use attn_burn::nn::{LongNetEncoder, Mode};
use attn_burn::{AttnOptions, Compute};
use attn_core::DType as AttnDType;
use attn_multihead::{Call, EncoderConfig, NamedParams};
use attn_testkit::{Tolerance, random_vec};
use burn_tensor::{DType, Tensor, TensorData};

use super::{grad_device, values};
use attn_burn::nn::param_grads;

/// Named results: `out`, `dx`, then each parameter's gradient.
pub type Named = Vec<(String, Vec<f32>)>;

/// `attn-multihead`'s two-layer stack (seed 11) and the input and output gradient of one
/// `[b, n, e]` run (loss `sum(out * grad_out)`).
pub struct EncoderCase {
    pub native: attn_multihead::LongNetEncoder<f32>,
    pub config: EncoderConfig,
    pub dims: [usize; 3],
    pub x: Vec<f32>,
    pub grad_out: Vec<f32>,
}

impl EncoderCase {
    /// The stack of `config` on `[b, n, d_model]` inputs.
    pub fn new(config: &EncoderConfig, b: usize, n: usize) -> Self {
        let backend = Arc::new(attn_kernels::CpuBackend::new(1).expect("cpu backend"));
        let native = attn_multihead::LongNetEncoder::<f32>::new(config.clone(), 2, 11, backend).expect("encoder");
        let dims = [b, n, config.d_model];
        let len = b * n * config.d_model;
        EncoderCase { native, config: config.clone(), dims, x: random_vec(1, len), grad_out: random_vec(2, len) }
    }

    /// `attn-multihead`'s results in `mode`.
    pub fn native_run(&self, mode: Mode) -> Named {
        let [b, n, _] = self.dims;
        let (out, cache) = self.native.forward_train(&self.x, &Call::new(b, n).mode(mode)).expect("forward");
        let mut grads = self.native.zero_grads();
        let dx = self.native.backward(&cache, &self.grad_out, &mut grads).expect("backward");
        let mut named = vec![("out".to_string(), out), ("dx".to_string(), dx)];
        for (i, g) in grads.iter().enumerate() {
            named.extend(g.params().into_iter().map(|p| (format!("layers.{i}.{}", p.name), p.data.to_vec())));
        }
        named
    }

    /// The burn stack with the same parameters, on the autodiff flex device.
    pub fn burn_stack(&self) -> LongNetEncoder {
        LongNetEncoder::from_encoder(&self.native, &self.config, &grad_device(), DType::F32).expect("burn encoder")
    }

    /// The burn stack's results in `mode` on rows `x` `[b, rows, e]` with output gradient
    /// `grad_out`, its attention computed where `compute` says: out, dx, parameter
    /// gradients.
    pub fn burn_run(&self, mode: Mode, [x, grad_out]: [&[f32]; 2], compute: &Compute) -> Named {
        let device = grad_device();
        let stack = self.burn_stack();
        let [b, _, e] = self.dims;
        let rows = x.len() / (b * e);
        let tensor =
            |v: &[f32]| Tensor::<3>::from_data(TensorData::new(v.to_vec(), [b, rows, e]), (&device, DType::F32));
        let xt = tensor(x).require_grad();
        let opts = AttnOptions::new(self.config.attention.clone());
        let out = stack.forward_on(xt.clone(), &opts, mode, compute).expect("burn forward");
        let grads = (out.clone() * tensor(grad_out)).sum().backward();
        let dx = values(xt.grad(&grads).expect("dx"));
        let mut named = vec![("out".to_string(), values(out)), ("dx".to_string(), dx)];
        named.extend(param_grads(&stack, &grads).expect("parameter gradients"));
        named
    }
}

/// `attn-multihead`'s two-layer stack (seed 11) in `mode`: the burn stack's results and
/// its (loss `sum(out * grad_out)`), at `[2, 32, d_model]`.
pub fn encoder_runs(config: &EncoderConfig, mode: Mode) -> (Named, Named) {
    let case = EncoderCase::new(config, 2, 32);
    let got = case.burn_run(mode, [&case.x, &case.grad_out], &Compute::Kernels);
    (got, case.native_run(mode))
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
