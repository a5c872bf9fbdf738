//! The bench's composition of dilated attention from burn's `attention` op
//! (`examples/burn_attention_bench/sdpa.rs`) equals the op, output and gradients, on small
//! head-group configs of both causalities, so the bench compares two computations of the
//! same function; what it leaves out gets a typed error.

#[path = "../examples/burn_attention_bench/sdpa.rs"]
mod sdpa;

use crate::common::{Attended, Inputs, Layout, Run, grad_device, run_inputs, values};
use attn_burn::AttnOptions;
use attn_core::{AttnError, Causality, DilatedConfig, Feature, Mixing, SeededRng};
use burn_tensor::{DType, Tensor};

/// Relative L2 bound of f32 runs of the same function.
const AGREE: f64 = 1e-5;

/// `||got - want|| / ||want||`.
fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let diff: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - f64::from(w)).powi(2)).sum();
    let norm: f64 = want.iter().map(|&w| f64::from(w).powi(2)).sum();
    (diff / norm).sqrt()
}

/// The run of `f` on random `[2, seq, heads, 8]` inputs (seeded), f32.
fn run(f: &crate::common::Attend<'_>, seq: usize, heads: usize) -> Run {
    let dims = [2, seq, heads, 8];
    let mut rng = SeededRng::new(11);
    let [q, k, v, go]: [Vec<f32>; 4] = std::array::from_fn(|_| rng.normal_vec(dims.iter().product()));
    let inputs = Inputs { qkv: [&q, &k, &v], grad_out: &go, grad_lse: None, dims: [dims, dims] };
    run_inputs(inputs, f, DType::F32, Layout::Bshd).expect("runs")
}

/// The composition as a function of q, k, v (its LSE is not compared: a placeholder).
fn composed(cfg: &DilatedConfig) -> impl Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Result<Attended, AttnError> + '_ {
    move |q, k, v| {
        let [b, n, h, _] = q.dims();
        let out = sdpa::composed_attention(q, k, v, cfg)?;
        let lse = Tensor::<3>::zeros([b, n, h], &grad_device());
        Ok(Attended { out, lse, lse_values: Vec::new() })
    }
}

/// The largest relative L2 difference of output and gradients between op and composition.
fn difference(cfg: &DilatedConfig, seq: usize, heads: usize) -> f64 {
    let opts = AttnOptions::new(cfg.clone());
    let op = |q, k, v| crate::common::attend_op(&opts, q, k, v);
    let (got, want) = (run(&op, seq, heads), run(&composed(cfg), seq, heads));
    let grads = (0..3).map(|i| rel_l2(&got.grads[i], &want.grads[i]));
    grads.fold(rel_l2(&got.out, &want.out), f64::max)
}

/// Head-group configs: several groups with offsets `i % r` other than 0, uneven groups.
#[test]
fn the_bench_composition_equals_the_op() {
    let configs: [(&[usize], &[usize], usize, usize); 3] =
        [(&[4, 8, 16], &[1, 2, 4], 16, 5), (&[8, 16], &[2, 4], 32, 4), (&[16], &[1], 16, 2)];
    for causality in [Causality::Full, Causality::Causal] {
        for (w, r, seq, heads) in configs {
            let cfg = DilatedConfig::builder().segments(w).dilations(r).causality(causality).build().expect("config");
            let diff = difference(&cfg, seq, heads);
            assert!(diff <= AGREE, "{w:?} {r:?} {causality:?}: relative L2 {diff:e}");
        }
    }
}

/// What the composition does not compute is a typed error naming it.
#[test]
fn the_bench_composition_refuses_what_it_leaves_out() {
    let device = grad_device();
    let t = |n| Tensor::<4>::zeros([1, n, 4, 8], &device);
    let longnet = DilatedConfig::builder().segments(&[8]).dilations(&[2]).mixing(Mixing::LongNet).build().expect("cfg");
    let unsupported = |e| matches!(e, Err(AttnError::Unsupported { feature: Feature::Other(_), .. }));
    assert!(unsupported(sdpa::composed_attention(t(8), t(8), t(8), &longnet)));
    let ragged = DilatedConfig::new(&[8], &[1]).expect("cfg");
    assert!(unsupported(sdpa::composed_attention(t(12), t(12), t(12), &ragged)));
    let uneven_rate = DilatedConfig::new(&[6], &[4]).expect("cfg");
    assert!(unsupported(sdpa::composed_attention(t(12), t(12), t(12), &uneven_rate)));
    let window = DilatedConfig::sliding_window(2, 0).expect("cfg");
    let e = sdpa::composed_attention(t(8), t(8), t(8), &window);
    assert!(matches!(e, Err(AttnError::Unsupported { feature: Feature::Window, .. })), "{e:?}");
    let e = sdpa::composed_attention(t(8), t(4), t(8), &ragged);
    assert!(matches!(e, Err(AttnError::ShapeMismatch { .. })), "{e:?}");
    // The honest call on the same tensors runs.
    let out = sdpa::composed_attention(t(8), t(8), t(8), &ragged).expect("runs");
    assert_eq!(values(out), vec![0.0; 8 * 4 * 8]);
}
