//! Forward time of the CPU kernels under random block masks against the same call with
//! every block kept: one pattern over the whole sequence at rate 1, block size 128, f32,
//! 8 heads of 64, 2 threads, `round(f * nb)` kept key blocks per query block (the
//! diagonal among them) at f = 5, 10, 25, 50 and 100%.
//!
//! `cargo run --release -p attn-kernels --example block_sparse_speed [SEQ] [REPEATS]`
//! (SEQ 16384 and 3 repeats unless given; the best time of the repeats is reported).

use std::time::Instant;

use attn_core::{
    Attention, AttnInputs, AttnShape, BlockDims, BlockMaskBuf, DilatedConfig, Masks, Shape4, TensorName, TensorViewMut,
};
use attn_kernels::CpuBackend;

const BLOCK: usize = 128;
const HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const THREADS: usize = 2;

/// A SplitMix64 stream.
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `kept` key blocks for every query block: the diagonal and `kept - 1` others drawn
/// without replacement.
fn random_mask(nb: usize, kept: usize, seed: u64) -> Result<BlockMaskBuf, attn_core::AttnError> {
    let mut rng = Mix(seed);
    let mut keep = vec![0u8; nb * nb];
    for i in 0..nb {
        let row = &mut keep[i * nb..(i + 1) * nb];
        row[i] = 1;
        let mut others: Vec<usize> = (0..nb).filter(|&j| j != i).collect();
        for c in 0..kept.saturating_sub(1).min(others.len()) {
            let pick = c + rng.below(others.len() - c);
            others.swap(c, pick);
            row[others[c]] = 1;
        }
    }
    BlockMaskBuf::new(keep, BlockDims { batch: 1, heads: 1, q_blocks: nb, k_blocks: nb }, BLOCK)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let seq: usize = args.next().map_or(Ok(16384), |s| s.parse())?;
    let repeats: usize = args.next().map_or(Ok(3), |s| s.parse())?;
    let shape = Shape4::new(1, seq, HEADS, HEAD_DIM)?;
    let cfg = DilatedConfig::new(&[seq], &[1])?;
    let x = |s: u64| -> Vec<f32> {
        let mut r = Mix(s);
        (0..shape.numel()).map(|_| (r.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5).collect()
    };
    let (q, k, v) = (x(1), x(2), x(3));
    let be = CpuBackend::new(THREADS)?;
    let nb = seq.div_ceil(BLOCK);
    let (mut out, mut lse) = (vec![0f32; shape.numel()], vec![0f32; shape.lse_len()]);
    println!(
        "seq {seq}, {HEADS} heads of {HEAD_DIM}, block {BLOCK}, {THREADS} threads, f32 forward, best of {repeats}"
    );
    let mut full = None;
    for f in [1.0, 0.5, 0.25, 0.10, 0.05] {
        let kept = ((f * nb as f64).round() as usize).max(1);
        let mask = random_mask(nb, kept, 2026)?;
        let inputs = AttnInputs::contiguous(&cfg, AttnShape::self_attn(shape), [&q[..], &k[..], &v[..]])?
            .with_masks(Masks { block: Some(mask.view()), ..Masks::NONE });
        let mut best = f64::INFINITY;
        for _ in 0..repeats {
            let t = Instant::now();
            be.forward(&inputs, TensorViewMut::contiguous(TensorName::Output, &mut out, shape)?, &mut lse)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let base = *full.get_or_insert(best);
        println!(
            "f = {:>5.1}% ({kept:>3} of {nb} blocks a row): {:>8.1} ms, {:.3}x of all kept",
            f * 100.0,
            best * 1e3,
            best / base
        );
    }
    Ok(())
}
