//! Rough timing: full causal attention (non-causal with RING_TIMING_CAUSAL=0) over `p` in-process ranks (zigzag, one
//! thread per rank unless RANK_THREADS is given) against the single-device CPU
//! backend with `p * RANK_THREADS` threads.
//! `cargo run --release -p attn-ring --example ring_timing -- SEQ HEADS HEAD_DIM P [ring|allgather|auto] [bwd|fwd] [RANK_THREADS]`

use std::time::Instant;

use attn_core::error::TensorName;
use attn_core::{DilatedConfig, Shape4, TensorView};
use attn_kernels::CpuBackend;
use attn_ring::{Layout, RingOptions, Strategy, ThreadComm, backward_on_with, forward_on_with, problem_for};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: usize| a.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (seq, heads, d, p) = (num(0, 8192), num(1, 4), num(2, 64), num(3, 2));
    let strategy = Strategy::parse(a.get(4).map(String::as_str).unwrap_or("ring"))?;
    let bwd = a.get(5).is_some_and(|s| s == "bwd");
    let rank_threads = num(6, 1).max(1);
    let shape = Shape4::new(1, seq, heads, d)?;
    let causal = std::env::var("RING_TIMING_CAUSAL").map_or(true, |v| v != "0");
    let cfg = DilatedConfig::builder().segments(&[seq]).dilations(&[1]).causality(causal.into()).build()?;
    let x: Vec<f32> = (0..shape.numel()).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
    let v = TensorView::contiguous(TensorName::Query, &x, shape)?;
    let cpu = CpuBackend::new(p * rank_threads)?;
    for rep in 0..3 {
        let t = Instant::now();
        let (out, lse) = cpu.forward_vec(&cfg, shape, &x, &x, &x)?;
        if bwd {
            cpu.backward_vec(&cfg, shape, [&x, &x, &x], &out, &lse, &x)?;
        }
        let single = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let problem = problem_for(&cfg, shape, Layout::Zigzag, strategy, p);
        let opts = RingOptions::default().with_threads(rank_threads);
        if bwd {
            for r in backward_on_with(ThreadComm::world(p)?, &problem, &opts, [v, v, v], v) {
                r?;
            }
        } else {
            for r in forward_on_with(ThreadComm::world(p)?, &problem, &opts, [v, v, v]) {
                r?;
            }
        }
        let ring = t.elapsed().as_secs_f64() * 1e3;
        println!(
            "rep {rep}: seq {seq} heads {heads} d {d} p {p} x {rank_threads} threads: single-device {} threads {single:.1} ms, ring {ring:.1} ms, ratio {:.2}",
            p * rank_threads,
            ring / single
        );
    }
    Ok(())
}
