//! A LongNet encoder over a 1,000,000-token sequence on the CPU, with a progress bar and tokens/s.
//!
//! `cargo run --release -p attn-multihead --example longnet_encoder -- [--tokens N] [--embed E]
//! [--heads H] [--layers L] [--ffn F] [--window W] [--full]`
//!
//! By default the sequence runs in windows of the largest segment length (exactly the
//! full-sequence function: attention never crosses such a window, everything else is
//! per token), so memory stays small; `--full` runs the whole sequence in one call.

use std::sync::Arc;
use std::time::Instant;

use attn_core::{DilatedConfig, Result};
use attn_kernels::CpuBackend;
use attn_multihead::{Call, EncoderConfig, LongNetEncoder, NamedParams, SeededRng};
use indicatif::{ProgressBar, ProgressStyle};

struct Args {
    tokens: usize,
    embed: usize,
    heads: usize,
    layers: usize,
    ffn: usize,
    window: Option<usize>,
    full: bool,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut a = Args { tokens: 1_000_000, embed: 64, heads: 4, layers: 1, ffn: 256, window: None, full: false };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--full" {
            a.full = true;
            continue;
        }
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let n: usize = value.parse().map_err(|e| format!("{flag} {value}: {e}"))?;
        match flag.as_str() {
            "--tokens" => a.tokens = n,
            "--embed" => a.embed = n,
            "--heads" => a.heads = n,
            "--layers" => a.layers = n,
            "--ffn" => a.ffn = n,
            "--window" => a.window = Some(n),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

/// Peak resident memory of this process in MiB (Linux), if known.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn main() -> Result<()> {
    let args = parse_args().map_err(attn_core::AttnError::InvalidArgument)?;
    let segments = [2048, 8192, 32768];
    let dilations = [1, 4, 16];
    let cfg = EncoderConfig::new(args.embed, args.heads, DilatedConfig::new(&segments, &dilations).unwrap(), args.ffn);
    let backend = Arc::new(CpuBackend::new(0)?);
    let threads = backend.threads();
    let encoder = LongNetEncoder::<f32>::new(cfg, args.layers, 2024, backend)?;
    println!(
        "LongNet encoder: {} layer(s), embed {}, heads {}, ffn {}, segments {segments:?}, dilations {dilations:?}, \
         {} parameters, {threads} threads, f32",
        args.layers,
        args.embed,
        args.heads,
        args.ffn,
        encoder.num_params()
    );
    let mut rng = SeededRng::new(1);
    let x: Vec<f32> = (0..args.tokens * args.embed).map(|_| rng.normal() as f32).collect();
    let bar = ProgressBar::new(args.tokens as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} tokens [{elapsed_precise}, {per_sec}, eta {eta}]")
            .map_err(|e| attn_core::AttnError::InvalidArgument(e.to_string()))?,
    );
    let start = Instant::now();
    let y = if args.full {
        let y = encoder.forward(&x, &Call::new(1, args.tokens))?;
        bar.set_position(args.tokens as u64);
        y
    } else {
        let window = args.window.unwrap_or(segments[2]);
        let mut next_report = 0;
        encoder.forward_windows(&x, 1, args.tokens, window, |done| {
            bar.set_position(done as u64);
            // Without a terminal the bar is hidden: print a line every tenth instead.
            if bar.is_hidden() && done >= next_report {
                let secs = start.elapsed().as_secs_f64();
                println!("progress: {done}/{} tokens, {:.0} tokens/s", args.tokens, done as f64 / secs);
                next_report = done + args.tokens / 10;
            }
        })?
    };
    let secs = start.elapsed().as_secs_f64();
    bar.finish();
    let finite = y.iter().all(|v| v.is_finite());
    let mean_abs = y.iter().map(|v| v.abs() as f64).sum::<f64>() / y.len() as f64;
    println!(
        "{} tokens in {secs:.2} s: {:.0} tokens/s ({}; output finite: {finite}, mean |y| {mean_abs:.4}, peak RSS {})",
        args.tokens,
        args.tokens as f64 / secs,
        if args.full { "one full-sequence call" } else { "windowed" },
        peak_rss_mib().map_or("unknown".to_string(), |m| format!("{m:.0} MiB"))
    );
    Ok(())
}
