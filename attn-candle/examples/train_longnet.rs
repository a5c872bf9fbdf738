//! Trains a small causal LongNet language model with candle on the CPU: token
//! embedding, `attn_candle::nn::LongNetEncoderLayer`s, a final norm and an output
//! head, with candle-nn's AdamW, on a synthetic long-distance task it generates.
//!
//! Each sequence names a key (one of `KEYS` tokens): the positions of its first quarter
//! hold the key, the rest of the sequence random filler. At every position of the second
//! half the model must name the key, which lies at least `SEQ / 4` tokens back and is
//! reachable only through the 4096-token segment of rate 2 (directly or through the other
//! layer). The loss counts those positions only; without the key in view the best loss
//! is `ln(KEYS)`.
//!
//! `cargo run --release -p attn-candle --example train_longnet`

use attn_candle::nn::{LayerNorm, LongNetEncoder};
use attn_core::{DilatedConfig, Mixing, SeededRng};
use attn_multihead::EncoderConfig;
use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::{AdamW, Embedding, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use indicatif::{ProgressBar, ProgressStyle};

const SEQ: usize = 4096;
const BATCH: usize = 2;
const EMBED: usize = 128;
const HEADS: usize = 4;
const LAYERS: usize = 2;
const FILLER: usize = 32;
const KEYS: usize = 16;
const VOCAB: usize = FILLER + KEYS;
/// The share of first-quarter positions that hold the key.
const KEY_SHARE: f64 = 1.0;
const STEPS: usize = 120;
/// The LongNet patterns: local segments of 1024, the whole sequence at rate 2.
const SEGMENTS: [usize; 2] = [1024, 4096];
const DILATIONS: [usize; 2] = [1, 2];
const PRINT_EVERY: usize = 10;
/// The learning rate falls linearly from `LR` to `LR / 10` over the run.
const LR: f64 = 3e-3;

/// Embedding, encoder, final norm, output head.
struct LanguageModel {
    embed: Embedding,
    encoder: LongNetEncoder,
    norm: LayerNorm,
    head: Linear,
}

impl LanguageModel {
    fn new(vb: VarBuilder<'_>) -> Result<Self> {
        // Every head a different offset of each dilated pattern: all positions reach far.
        let attention =
            DilatedConfig::builder().segments(&SEGMENTS).dilations(&DILATIONS).mixing(Mixing::LongNet).causal();
        let config = EncoderConfig::new(EMBED, HEADS, attention.build().map_err(attn_candle::to_candle)?, 2 * EMBED);
        Ok(LanguageModel {
            embed: candle_nn::embedding(VOCAB, EMBED, vb.pp("embed"))?,
            encoder: LongNetEncoder::new(&config, LAYERS, vb.pp("encoder"))?,
            norm: LayerNorm::new(EMBED, 1e-5, vb.pp("norm"))?,
            head: candle_nn::linear(EMBED, VOCAB, vb.pp("head"))?,
        })
    }

    /// Logits `[batch, seq, VOCAB]` of tokens `[batch, seq]`.
    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let h = self.encoder.forward(&self.embed.forward(tokens)?)?;
        self.head.forward(&self.norm.forward(&h)?)
    }
}

/// A batch of token sequences and, per position of their second halves, the key.
fn batch(rng: &mut SeededRng) -> Result<(Tensor, Tensor)> {
    let pick = |rng: &mut SeededRng, n: usize| ((rng.uniform() * n as f64) as usize).min(n - 1);
    let mut tokens = Vec::with_capacity(BATCH * SEQ);
    let mut targets = Vec::with_capacity(BATCH * SEQ / 2);
    for _ in 0..BATCH {
        let key = (FILLER + pick(rng, KEYS)) as u32;
        for p in 0..SEQ {
            let filler = pick(rng, FILLER) as u32;
            tokens.push(if p < SEQ / 4 && rng.uniform() < KEY_SHARE { key } else { filler });
        }
        targets.extend(std::iter::repeat_n(key, SEQ / 2));
    }
    let device = Device::Cpu;
    Ok((Tensor::from_vec(tokens, (BATCH, SEQ), &device)?, Tensor::from_vec(targets, BATCH * SEQ / 2, &device)?))
}

fn main() -> Result<()> {
    let varmap = VarMap::new();
    let model = LanguageModel::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    let params = ParamsAdamW { lr: LR, weight_decay: 0.0, ..ParamsAdamW::default() };
    let mut opt = AdamW::new(varmap.all_vars(), params)?;
    let mut rng = SeededRng::new(7);
    println!(
        "LongNet LM: seq {SEQ}, batch {BATCH}, embed {EMBED}, {HEADS} heads, {LAYERS} layers, segments \
         {SEGMENTS:?}, dilations {DILATIONS:?}, causal; {KEYS} keys, loss without the key ln({KEYS}) = {:.3}",
        (KEYS as f64).ln()
    );
    let bar = ProgressBar::new(STEPS as u64)
        .with_style(ProgressStyle::with_template("{bar:40} {pos}/{len} [{elapsed_precise}] {msg}").expect("template"));
    let start = std::time::Instant::now();
    // Loss and key accuracy summed since the last printed line.
    let (mut loss_sum, mut accuracy_sum, mut since) = (0.0, 0.0, 0);
    for step in 1..=STEPS {
        opt.set_learning_rate(LR * (1.0 - 0.9 * (step - 1) as f64 / (STEPS - 1) as f64));
        let (tokens, targets) = batch(&mut rng)?;
        let logits = model.forward(&tokens)?.narrow(1, SEQ / 2, SEQ / 2)?.reshape((BATCH * SEQ / 2, VOCAB))?;
        let loss = candle_nn::loss::cross_entropy(&logits, &targets)?;
        opt.backward_step(&loss)?;
        let accuracy: f32 = logits.argmax(D::Minus1)?.eq(&targets)?.to_dtype(DType::F32)?.mean_all()?.to_scalar()?;
        loss_sum += loss.to_scalar::<f32>()?;
        accuracy_sum += accuracy;
        since += 1;
        bar.set_message(format!("loss {:.4}", loss_sum / since as f32));
        bar.inc(1);
        if step == 1 || step % PRINT_EVERY == 0 {
            let line = format!(
                "step {step:4}  loss {:.4}  key accuracy {:.3}  (mean of {since} steps)  {:.0} s",
                loss_sum / since as f32,
                accuracy_sum / since as f32,
                start.elapsed().as_secs_f64()
            );
            bar.suspend(|| println!("{line}"));
            (loss_sum, accuracy_sum, since) = (0.0, 0.0, 0);
        }
    }
    bar.finish();
    Ok(())
}
