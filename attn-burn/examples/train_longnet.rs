//! Trains a small LongNet encoder with burn on the CPU (`Autodiff<Flex>`): a one-hot
//! input projection, `attn_burn::nn::LongNetEncoder` and a classification head, with
//! burn's Adam, on a synthetic key-retrieval task it generates.
//!
//! Each sequence names a key (one of `KEYS` tokens): each of its first `SEQ - LOCAL`
//! positions holds the key with probability `KEY_SHARE` (the first one always), else a
//! filler token; the last `LOCAL` positions hold filler and, last, a query token. The head reads
//! the last position and must name the key, which lies outside the query's local segment
//! of `LOCAL` tokens: the LongNet patterns (local segments, and the whole sequence at rate
//! 4, every head another offset) reach it; the same model limited to the local segments
//! cannot, and stays at chance (`1 / KEYS`). Both are trained and their held-out
//! accuracies printed.
//!
//! `cargo run --release -p attn-burn --example train_longnet`

use attn_burn::AttnOptions;
use attn_burn::nn::{Linear, LongNetEncoder, Mode};
use attn_core::{DilatedConfig, Mixing, Result, SeededRng};
use attn_multihead::EncoderConfig;
use burn::module::{Module, Param};
use burn_optim::{AdamConfig, GradientsParams};
use burn_tensor::activation::log_softmax;
use burn_tensor::{DType, Device, Tensor, TensorData};
use indicatif::{ProgressBar, ProgressStyle};

const SEQ: usize = 128;
const LOCAL: usize = 16;
const BATCH: usize = 16;
const EMBED: usize = 32;
const HEADS: usize = 4;
const LAYERS: usize = 2;
const KEYS: usize = 4;
const FILLER: usize = 4;
/// Keys, filler, the query token.
const VOCAB: usize = KEYS + FILLER + 1;
const LR: f64 = 1e-2;
/// The share of the first `SEQ - LOCAL` positions that hold the key.
const KEY_SHARE: f64 = 0.25;
/// Sequences of the held-out set.
const HELD_OUT: usize = 256;

/// Which attention the encoder has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Local segments and the whole sequence at rate 4.
    LongNet,
    /// The local segments alone.
    Local,
}

impl Reach {
    fn attention(self) -> Result<DilatedConfig> {
        let builder = match self {
            Reach::LongNet => DilatedConfig::builder().segments(&[LOCAL, SEQ]).dilations(&[1, 4]),
            Reach::Local => DilatedConfig::builder().segments(&[LOCAL]).dilations(&[1]),
        };
        builder.mixing(Mixing::LongNet).build()
    }
}

/// Input projection, encoder, head.
#[derive(Module, Debug)]
pub struct KeyModel {
    embed: Linear,
    encoder: LongNetEncoder,
    head: Linear,
}

/// A linear map `inputs -> outputs` with weights drawn from `N(0, gain^2 / inputs)`.
fn linear(inputs: usize, outputs: usize, gain: f64, rng: &mut SeededRng, device: &Device) -> Linear {
    let scale = (gain * gain / inputs as f64).sqrt() as f32;
    let w: Vec<f32> = rng.normal_vec(inputs * outputs).into_iter().map(|x| x * scale).collect();
    let weight = Tensor::<2>::from_data(TensorData::new(w, [outputs, inputs]), (device, DType::F32));
    Linear { weight: Param::from_tensor(weight), bias: None }
}

impl KeyModel {
    pub fn new(reach: Reach, seed: u64, device: &Device) -> Result<(Self, AttnOptions)> {
        let attention = reach.attention()?;
        let config = EncoderConfig::new(EMBED, HEADS, attention.clone(), 2 * EMBED);
        let mut rng = SeededRng::new(seed);
        let model = KeyModel {
            embed: linear(VOCAB, EMBED, 1.0, &mut rng, device),
            encoder: LongNetEncoder::magneto(&config, LAYERS, seed, device, DType::F32)?,
            // A small head: the first loss is about the chance loss `ln(KEYS)`.
            head: linear(EMBED, KEYS, 0.1, &mut rng, device),
        };
        Ok((model, AttnOptions::new(attention)))
    }

    /// The key logits `[batch, KEYS]` of one-hot sequences `[batch, SEQ, VOCAB]`.
    fn logits(&self, x: Tensor<3>, opts: &AttnOptions) -> Result<Tensor<2>> {
        let h = self.encoder.forward_mode(self.embed.forward(x), opts, Mode::Eval)?;
        let last = h.narrow(1, SEQ - 1, 1);
        Ok(self.head.forward(last).reshape([0, KEYS as i32]))
    }
}

/// A batch of sequences: one-hot `[batch, SEQ, VOCAB]` and the keys.
fn batch(rng: &mut SeededRng, size: usize, device: &Device) -> (Tensor<3>, Vec<usize>) {
    let mut x = vec![0f32; size * SEQ * VOCAB];
    let mut keys = Vec::with_capacity(size);
    for b in 0..size {
        let key = rng.range(0, KEYS);
        for t in 0..SEQ {
            let token = match t {
                _ if t == SEQ - 1 => VOCAB - 1,
                0 => key,
                _ if t < SEQ - LOCAL && rng.uniform() < KEY_SHARE => key,
                _ => KEYS + rng.range(0, FILLER),
            };
            x[(b * SEQ + t) * VOCAB + token] = 1.0;
        }
        keys.push(key);
    }
    (Tensor::from_data(TensorData::new(x, [size, SEQ, VOCAB]), (device, DType::F32)), keys)
}

/// The mean cross-entropy of `logits` against `keys`.
fn loss(logits: Tensor<2>, keys: &[usize]) -> Tensor<1> {
    let mut targets = vec![0f32; keys.len() * KEYS];
    keys.iter().enumerate().for_each(|(b, &k)| targets[b * KEYS + k] = 1.0);
    let targets = Tensor::<2>::from_data(TensorData::new(targets, [keys.len(), KEYS]), &logits.device());
    (log_softmax(logits, 1) * targets).sum().neg() / keys.len() as f64
}

/// The share of `keys` the logits name.
fn accuracy(logits: Tensor<2>, keys: &[usize]) -> f64 {
    let values = logits.into_data().convert::<f32>().try_to_vec::<f32>().unwrap_or_default();
    let hits = values.chunks(KEYS).zip(keys).filter(|(row, k)| {
        let best = (0..KEYS).max_by(|&a, &b| row[a].total_cmp(&row[b]));
        best == Some(**k)
    });
    hits.count() as f64 / keys.len() as f64
}

/// What a run reports: every step's loss, and the held-out accuracy after it.
#[derive(Debug, Clone)]
pub struct Report {
    pub losses: Vec<f32>,
    pub accuracy: f64,
}

/// Trains the model of `reach` for `steps` steps from `seed`.
pub fn train(reach: Reach, steps: usize, seed: u64, bar: &ProgressBar) -> Result<Report> {
    let device = Device::flex().autodiff();
    let (mut model, opts) = KeyModel::new(reach, seed, &device)?;
    let mut optim = AdamConfig::new().init();
    let mut rng = SeededRng::new(seed ^ 0x5EED);
    let mut losses = Vec::with_capacity(steps);
    for _ in 0..steps {
        let (x, keys) = batch(&mut rng, BATCH, &device);
        let loss = loss(model.logits(x, &opts)?, &keys);
        let value = loss.clone().into_scalar::<f32>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
        losses.push(value);
        bar.set_message(format!("{reach:?} loss {value:.3}"));
        bar.inc(1);
    }
    let mut held_out = SeededRng::new(seed ^ 0x0DD5);
    let valid = model.valid();
    let plain = Device::flex();
    let (x, keys) = batch(&mut held_out, HELD_OUT, &plain);
    Ok(Report { losses, accuracy: accuracy(valid.logits(x, &opts)?, &keys) })
}

fn main() -> Result<()> {
    let steps = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(300);
    let bar = ProgressBar::new(2 * steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} {elapsed} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let long = train(Reach::LongNet, steps, 1, &bar)?;
    let local = train(Reach::Local, steps, 1, &bar)?;
    bar.finish();
    let mean = |l: &[f32]| l.iter().sum::<f32>() / l.len().max(1) as f32;
    for (name, r) in [("LongNet (segments 16, 128; rates 1, 4)", &long), ("local segments of 16 only", &local)] {
        let tail = &r.losses[r.losses.len().saturating_sub(20)..];
        println!(
            "{name}: held-out key accuracy {:.1}% (chance {:.1}%), last-20-step loss {:.3}",
            100.0 * r.accuracy,
            100.0 / KEYS as f64,
            mean(tail)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Short runs (60 steps): the LongNet model's loss falls from about the chance loss
    /// `ln(KEYS)` to under half of it and it names at least 95% of the held-out keys; the
    /// local model, which cannot see the key, stays near the chance loss and accuracy.
    #[test]
    fn the_longnet_model_learns_the_key_and_the_local_one_cannot() {
        let bar = ProgressBar::hidden();
        let mean = |l: &[f32]| f64::from(l.iter().sum::<f32>()) / l.len() as f64;
        let chance = (KEYS as f64).ln();
        let long = train(Reach::LongNet, 60, 1, &bar).expect("training");
        let (first, last) = (mean(&long.losses[..10]), mean(&long.losses[50..]));
        println!("LongNet: loss {first:.3} -> {last:.3} (chance {chance:.3}), accuracy {:.3}", long.accuracy);
        assert!(last < 0.5 * first && last < 0.5 * chance, "loss {first:.3} -> {last:.3}");
        assert!(long.accuracy >= 0.95, "held-out accuracy {}", long.accuracy);
        let local = train(Reach::Local, 60, 1, &bar).expect("training");
        let last = mean(&local.losses[50..]);
        println!("local: last loss {last:.3}, accuracy {:.3}", local.accuracy);
        assert!(last > 0.8 * chance && local.accuracy < 0.4, "the local model learnt the key: {local:?}");
    }
}
