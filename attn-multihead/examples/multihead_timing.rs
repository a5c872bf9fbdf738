//! Times `MultiheadDilatedAttention<f32>` on the CPU kernels, forward and forward+backward, with a per-stage split.
//!
//! `cargo run --release -p attn-multihead --example multihead_timing -- [--seq N] [--embed E]
//! [--heads H] [--runs R] [--causal]` (segments 2048,4096,8192, dilations 1,2,4 as the
//! PyTorch peer's default). Prints one JSON line per mode with median milliseconds.

use std::sync::Arc;
use std::time::Instant;

use attn_core::{AttnError, DilatedConfig, Result};
use attn_kernels::CpuBackend;
use attn_multihead::{Call, MultiheadConfig, MultiheadDilatedAttention, SeededRng};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let (mut seq, mut embed, mut heads, mut runs, mut causal) = (8192usize, 512usize, 8usize, 5usize, false);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--causal" {
            causal = true;
            continue;
        }
        let v: usize = it
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| AttnError::InvalidArgument(format!("{flag} needs a number")))?;
        match flag.as_str() {
            "--seq" => seq = v,
            "--embed" => embed = v,
            "--heads" => heads = v,
            "--runs" => runs = v.max(1),
            _ => return Err(AttnError::InvalidArgument(format!("unknown flag {flag}"))),
        }
    }
    let cfg = MultiheadConfig::new(
        embed,
        heads,
        DilatedConfig::builder()
            .segments(&[2048, 4096, 8192])
            .dilations(&[1, 2, 4])
            .causality(causal.into())
            .build()
            .unwrap(),
    );
    let layer = MultiheadDilatedAttention::<f32>::new(cfg, 7, Arc::new(CpuBackend::new(0)?))?;
    let mut rng = SeededRng::new(1);
    let x: Vec<f32> = (0..seq * embed).map(|_| rng.normal() as f32).collect();
    let g: Vec<f32> = (0..seq * embed).map(|_| rng.normal() as f32).collect();
    let (mut fwd, mut both) = (Vec::new(), Vec::new());
    layer.forward(&x, &Call::new(1, seq))?; // warm-up
    for _ in 0..runs {
        let t = Instant::now();
        std::hint::black_box(layer.forward(&x, &Call::new(1, seq))?);
        fwd.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let (y, cache) = layer.forward_train(&x, &Call::new(1, seq))?;
        let mut grads = layer.zero_grads();
        let dx = layer.backward(&cache, &g, &mut grads)?;
        std::hint::black_box((y, dx, grads));
        both.push(t.elapsed().as_secs_f64() * 1e3);
    }
    for (mode, v) in [("forward", fwd), ("forward_backward", both)] {
        let ms = median(v);
        println!(
            "{{\"impl\":\"attn-multihead\",\"mode\":\"{mode}\",\"seq\":{seq},\"embed\":{embed},\"heads\":{heads},\
             \"causal\":{causal},\"median_ms\":{ms:.1},\"tokens_per_s\":{:.0}}}",
            seq as f64 / ms * 1e3
        );
    }
    Ok(())
}
