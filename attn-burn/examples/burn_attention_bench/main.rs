//! Times `attn_burn::dilated_attention` against the same dilated pattern composed from
//! burn's own `attention` op (see [`sdpa`]), on burn-flex in f32: forward, and forward
//! plus backward under `Autodiff<Flex>` (loss `sum(out * g)` for a fixed random `g`).
//! Before timing it checks that both compute the same output and gradients (relative
//! L2 at most `AGREE`). Prints the medians and their ratios.
//!
//! `cargo run --release -p attn-burn --example burn_attention_bench`

mod sdpa;

use std::time::Instant;

use attn_burn::AttnOptions;
use attn_core::{DilatedConfig, Result, SeededRng};
use burn_tensor::{DType, Device, Tensor, TensorData};

const BATCH: usize = 1;
const SEQ: usize = 8192;
const HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const SEGMENTS: [usize; 3] = [2048, 4096, 8192];
const DILATIONS: [usize; 3] = [1, 2, 4];
/// Untimed runs before the timed ones, and timed runs.
const WARMUP: usize = 1;
const RUNS: usize = 5;
/// The largest relative L2 difference the op and the composition may have.
const AGREE: f64 = 1e-4;

/// A function of q, k, v on burn tensors.
type Attend<'a> = dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Result<Tensor<4>> + 'a;

/// Row-major f32 values of `t`.
fn values<const N: usize>(t: Tensor<N>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().expect("f32 values")
}

/// `||got - want|| / ||want||`.
fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        diff += (f64::from(g) - f64::from(w)).powi(2);
        norm += f64::from(w).powi(2);
    }
    (diff / norm).sqrt()
}

/// The inputs: q, k, v and the output's gradient, `[batch, seq, heads, head_dim]` each.
struct Inputs([Vec<f32>; 4]);

impl Inputs {
    fn new(seed: u64) -> Self {
        let mut rng = SeededRng::new(seed);
        Inputs(std::array::from_fn(|_| rng.normal_vec(BATCH * SEQ * HEADS * HEAD_DIM)))
    }

    fn tensor(&self, i: usize, device: &Device) -> Tensor<4> {
        let data = TensorData::new(self.0[i].clone(), [BATCH, SEQ, HEADS, HEAD_DIM]);
        Tensor::<4>::from_data(data, (device, DType::F32))
    }
}

/// The output of `f` on flex.
fn forward(f: &Attend<'_>, inputs: &Inputs) -> Result<Vec<f32>> {
    let device = Device::flex();
    let [q, k, v] = std::array::from_fn(|i| inputs.tensor(i, &device));
    Ok(values(f(q, k, v)?))
}

/// The gradients into q, k and v of `sum(f(q, k, v) * g)` under autodiff.
fn gradients(f: &Attend<'_>, inputs: &Inputs) -> Result<[Vec<f32>; 3]> {
    let device = Device::flex().autodiff();
    let [q, k, v] = std::array::from_fn(|i| inputs.tensor(i, &device).require_grad());
    let g = inputs.tensor(3, &device);
    let grads = (f(q.clone(), k.clone(), v.clone())? * g).sum().backward();
    Ok([q, k, v].map(|t| values(t.grad(&grads).expect("a gradient"))))
}

/// The median over `RUNS` timed runs of `run` (after `WARMUP` untimed ones), in ms.
fn median_ms(mut run: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..WARMUP {
        run()?;
    }
    let mut ms = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let start = Instant::now();
        run()?;
        ms.push(start.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[RUNS / 2])
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let cfg = DilatedConfig::new(&SEGMENTS, &DILATIONS)?;
    let options = AttnOptions::new(cfg.clone());
    let op = |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>| attn_burn::dilated_attention(q, k, v, &options);
    let composed = |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>| sdpa::composed_attention(q, k, v, &cfg);
    let inputs = Inputs::new(7);
    println!(
        "burn-flex f32, batch {BATCH}, seq {SEQ}, heads {HEADS}, head_dim {HEAD_DIM}, segments {SEGMENTS:?}, \
         dilations {DILATIONS:?}, head groups, full attention; median of {RUNS} runs after {WARMUP} warm-up"
    );

    let (out_op, out_composed) = (forward(&op, &inputs)?, forward(&composed, &inputs)?);
    let fwd_diff = rel_l2(&out_op, &out_composed);
    let (grads_op, grads_composed) = (gradients(&op, &inputs)?, gradients(&composed, &inputs)?);
    let grad_diff = (0..3).map(|i| rel_l2(&grads_op[i], &grads_composed[i])).fold(0.0, f64::max);
    println!("agreement (relative L2): output {fwd_diff:.2e}, gradients (largest of q, k, v) {grad_diff:.2e}");
    if fwd_diff > AGREE || grad_diff > AGREE {
        return Err(format!("the op and the composition differ by more than {AGREE:e}: nothing to compare").into());
    }

    let fwd_op = median_ms(|| forward(&op, &inputs).map(drop))?;
    let fwd_composed = median_ms(|| forward(&composed, &inputs).map(drop))?;
    let bwd_op = median_ms(|| gradients(&op, &inputs).map(drop))?;
    let bwd_composed = median_ms(|| gradients(&composed, &inputs).map(drop))?;
    println!("| pass | attn_burn::dilated_attention (ms) | burn `attention` composition (ms) | composition / op |");
    println!("|---|---:|---:|---:|");
    println!("| forward | {fwd_op:.1} | {fwd_composed:.1} | {:.2}x |", fwd_composed / fwd_op);
    println!("| forward+backward | {bwd_op:.1} | {bwd_composed:.1} | {:.2}x |", bwd_composed / bwd_op);
    Ok(())
}
