//! Quick speed check of the CPU backend (not a benchmark suite; see `cargo xtask bench`).
//!
//! `cargo run --release -p attn-kernels --example cpu_speed -- [seq] [threads] [f32|bf16|f16] [causal] [backward] [portable|avx2|avx512]`

use std::time::Instant;

use attn_core::{DilatedConfig, Element, Pass, Shape4};
use attn_kernels::{CpuBackend, Isa, model_flops};
use half::{bf16, f16};

/// CPU seconds this process has used (user + system, from /proc; 0 where unavailable).
/// On a shared machine, FLOP per CPU-second is steadier than per wall-second.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks: f64 = fields.get(11..13).map_or(0.0, |f| f.iter().filter_map(|x| x.parse::<f64>().ok()).sum());
    ticks / 100.0
}

fn run<T: Element>(seq: usize, threads: usize, causal: bool, backward: bool, isa: Option<Isa>) {
    let cfg = DilatedConfig::builder()
        .segments(&[2048, 4096, 8192])
        .dilations(&[1, 2, 4])
        .causality(causal.into())
        .build()
        .unwrap();
    let shape = Shape4::new(1, seq, 8, 64).unwrap();
    let n = shape.numel();
    let make = |s: u64| -> Vec<T> {
        let mut x = s.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                T::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
            })
            .collect()
    };
    let (q, k, v, go) = (make(1), make(2), make(3), make(4));
    let mut be = CpuBackend::new(threads).unwrap();
    if let Some(isa) = isa {
        be = be.with_isa(isa).unwrap();
    }
    let flops = model_flops(&cfg, shape, if backward { Pass::Backward } else { Pass::Forward });
    let mut times = Vec::new();
    let (out, lse) = be.forward_vec(&cfg, shape, &q, &k, &v).unwrap();
    // After the warm-up call: CPU time of the timed calls only.
    let cpu0 = cpu_seconds();
    for _ in 0..5 {
        let t = Instant::now();
        if backward {
            be.backward_vec(&cfg, shape, [&q, &k, &v], &out, &lse, &go).unwrap();
        } else {
            be.forward_vec(&cfg, shape, &q, &k, &v).unwrap();
        }
        times.push(t.elapsed().as_secs_f64());
    }
    let cpu = (cpu_seconds() - cpu0) / times.len() as f64;
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    println!(
        "{} seq={seq} threads={} isa={} causal={causal} backward={backward}: median {:.2} ms, {:.1} GFLOP/s (model {:.3} GFLOP); {:.1} GFLOP per CPU-second",
        T::DTYPE.as_str(),
        be.threads(),
        be.isa().as_str(),
        med * 1e3,
        flops / med / 1e9,
        flops / 1e9,
        flops / cpu / 1e9
    );
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let seq = a.first().and_then(|s| s.parse().ok()).unwrap_or(8192);
    let threads = a.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let has = |w: &str| a.iter().any(|x| x == w);
    let isa = Isa::ALL.into_iter().find(|i| has(i.as_str()));
    let (causal, backward) = (has("causal"), has("backward"));
    if has("bf16") {
        run::<bf16>(seq, threads, causal, backward, isa)
    } else if has("f16") {
        run::<f16>(seq, threads, causal, backward, isa)
    } else {
        run::<f32>(seq, threads, causal, backward, isa)
    }
}
