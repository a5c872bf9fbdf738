//! The chunk ring on one GPU with its ranks as threads (a stream each, buffers handed on
//! device to device): per-rank peak device memory (each rank's `DeviceMeter`) and the
//! forward's median time for every world size, against the single rank. Prints one line per
//! world size and the two checks: per-rank memory falls by at least 0.95·P from P = 1, and
//! P = 4 runs within 1.25x of P = 1; exits 1 when a check fails.
//!
//! `cargo run --release -p attn-ring --features cuda --example cuda_ring_bench -- --seq 262144 --rounds 8`

use std::time::{Duration, Instant};

use attn_core::error::TensorName;
use attn_core::{AttnError, DilatedConfig, Result, Shape4, TensorView};
use attn_kernels::cuda::{CudaDevice, DeviceTensor};
use attn_ring::chunk_ring::{ChunkOptions, CudaChunks, InProcessTransport, chunk_forward, rank_pieces};
use attn_ring::{Layout, RingProblem, Strategy, ThreadComm};
use half::bf16;

struct Args {
    seq: usize,
    worlds: Vec<usize>,
    heads: usize,
    head_dim: usize,
    iters: usize,
    rounds: usize,
}

fn parse() -> std::result::Result<Args, String> {
    let mut a = Args { seq: 262_144, worlds: vec![1, 2, 4, 8], heads: 16, head_dim: 128, iters: 3, rounds: 8 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = |v: &str| v.parse::<usize>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--seq" => a.seq = num(&value)?,
            "--worlds" => a.worlds = value.split(',').map(num).collect::<std::result::Result<_, _>>()?,
            "--heads" => a.heads = num(&value)?,
            "--head-dim" => a.head_dim = num(&value)?,
            "--iters" => a.iters = num(&value)?.max(1),
            "--rounds" => a.rounds = num(&value)?,
            other => return Err(format!("unknown flag {other} (--seq --worlds --heads --head-dim --iters --rounds)")),
        }
    }
    Ok(a)
}

/// One world size: each rank's peak bytes and the median forward time.
fn run_world(base: &CudaDevice, cfg: &DilatedConfig, shape: Shape4, world: usize, a: &Args) -> Result<(u64, f64)> {
    let (iters, opts) = (a.iters, ChunkOptions::with_rounds(a.rounds)?);
    let problem = RingProblem::new(cfg, shape.into(), Layout::Zigzag, Strategy::Auto, world);
    let tile: Vec<bf16> = (0..4096).map(|i| bf16::from_f32(((i * 37 % 101) as f32 / 101.0) - 0.5)).collect();
    let ends = InProcessTransport::world(ThreadComm::world_with_timeout(world, Duration::from_secs(300))?)?;
    let per_rank: Vec<Result<(u64, Vec<f64>)>> = std::thread::scope(|s| {
        let hs: Vec<_> = ends
            .into_iter()
            .enumerate()
            .map(|(rank, mut t)| {
                let (problem, tile) = (&problem, &tile);
                s.spawn(move || -> Result<(u64, Vec<f64>)> {
                    let x = CudaChunks::new(base.with_own_stream()?);
                    let piece = |rows: usize| -> Result<_> {
                        let s = Shape4::new(shape.batch, rows, shape.heads, shape.head_dim)?;
                        let host: Vec<bf16> = tile.iter().copied().cycle().take(s.numel()).collect();
                        Ok(x.adopt(DeviceTensor::from_view(
                            &x.dev,
                            &TensorView::contiguous(TensorName::Query, &host, s)?,
                        )?))
                    };
                    let ranges = rank_pieces(problem, rank);
                    let qkv: Vec<Vec<_>> = (0..3)
                        .map(|_| ranges.iter().map(|r| piece(r.len())).collect::<Result<Vec<_>>>())
                        .collect::<Result<_>>()?;
                    // Warm-up (kernel compilation), then timed calls from the inputs' footprint.
                    drop(chunk_forward(&mut t, &x, problem, opts, [&qkv[0], &qkv[1], &qkv[2]])?);
                    x.dev.synchronize()?;
                    x.meter.reset_peak();
                    let mut times = Vec::with_capacity(iters);
                    for _ in 0..iters {
                        let t0 = Instant::now();
                        let f = chunk_forward(&mut t, &x, problem, opts, [&qkv[0], &qkv[1], &qkv[2]])?;
                        x.dev.synchronize()?;
                        times.push(t0.elapsed().as_secs_f64() * 1e3);
                        drop(f);
                    }
                    Ok((x.meter.peak(), times))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(AttnError::InvalidArgument("rank panicked".into()))))
            .collect()
    });
    let (mut peak, mut slowest) = (0u64, vec![0.0f64; iters]);
    for r in per_rank {
        let (p, times) = r?;
        peak = peak.max(p);
        for (s, t) in slowest.iter_mut().zip(times) {
            *s = s.max(t);
        }
    }
    slowest.sort_by(f64::total_cmp);
    Ok((peak, slowest[slowest.len() / 2]))
}

fn main() -> std::process::ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    match bench(&args) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("cuda_ring_bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn bench(a: &Args) -> Result<bool> {
    let dev = CudaDevice::new(0)?;
    let cfg =
        DilatedConfig::builder().segments(&[2048, 4096, 8192, 16384, 32768]).dilations(&[1, 2, 4, 8, 16]).build()?;
    let shape = Shape4::new(1, a.seq, a.heads, a.head_dim)?;
    println!(
        "chunk ring on one GPU (bf16, seq {}, heads {}, head_dim {}, zigzag, {} rounds), median of {}",
        a.seq, a.heads, a.head_dim, a.rounds, a.iters
    );
    let mut rows = Vec::new();
    for &p in &a.worlds {
        let (peak, ms) = run_world(&dev, &cfg, shape, p, a)?;
        println!("P={p}: per-rank peak {:.1} MiB, forward {ms:.2} ms", peak as f64 / (1 << 20) as f64);
        rows.push((p, peak, ms));
    }
    let Some(&(_, peak1, ms1)) = rows.iter().find(|r| r.0 == 1) else { return Ok(true) };
    let mut ok = true;
    for &(p, peak, ms) in rows.iter().filter(|r| r.0 > 1) {
        let fall = peak1 as f64 / peak as f64;
        let mem_ok = fall >= 0.95 * p as f64;
        println!(
            "P={p}: memory falls {fall:.2}x (want >= {:.2}): {}",
            0.95 * p as f64,
            if mem_ok { "PASS" } else { "FAIL" }
        );
        ok &= mem_ok;
        if p == 4 {
            let time_ok = ms <= 1.25 * ms1;
            println!("P=4: time {:.2}x of P=1 (want <= 1.25): {}", ms / ms1, if time_ok { "PASS" } else { "FAIL" });
            ok &= time_ok;
        }
    }
    Ok(ok)
}
