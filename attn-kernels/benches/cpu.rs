//! Criterion benchmarks of the CPU backend on the config (batch 1, heads 8,
//! head_dim 64, segments 2048/4096/8192, rates 1/2/4), kept small: seq 8192 forward
//! (f32, causal f32, bf16) and seq 4096 forward + backward. Throughput is in model
//! FLOPs ([`attn_kernels::model_flops`]); criterion reports it as "elements/s" = FLOP/s.
//!
//! `cargo bench -p attn-kernels --bench cpu` (about a minute).

use std::time::Duration;

use attn_core::{DilatedConfig, Element, Pass, Shape4};
use attn_kernels::{CpuBackend, model_flops};
use attn_testkit::random_vec;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;

fn config(causal: bool) -> DilatedConfig {
    DilatedConfig::builder()
        .segments(&[2048, 4096, 8192])
        .dilations(&[1, 2, 4])
        .causality(causal.into())
        .build()
        .unwrap()
}

fn inputs<T: Element>(shape: Shape4, seed: u64) -> Vec<T> {
    random_vec(seed, shape.numel()).into_iter().map(T::from_f32).collect()
}

fn forward<T: Element>(c: &mut Criterion, be: &CpuBackend, seq: usize, causal: bool) {
    let cfg = config(causal);
    let shape = Shape4::new(1, seq, 8, 64).unwrap();
    let (q, k, v) = (inputs::<T>(shape, 1), inputs::<T>(shape, 2), inputs::<T>(shape, 3));
    let mut g = c.benchmark_group(format!("forward_{}{}", T::DTYPE.as_str(), if causal { "_causal" } else { "" }));
    g.throughput(Throughput::Elements(model_flops(&cfg, shape, Pass::Forward) as u64));
    g.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(5));
    g.bench_function(BenchmarkId::from_parameter(seq), |b| {
        b.iter(|| std::hint::black_box(be.forward_vec(&cfg, shape, &q, &k, &v).unwrap()))
    });
    g.finish();
}

fn backward(c: &mut Criterion, be: &CpuBackend, seq: usize) {
    let cfg = config(false);
    let shape = Shape4::new(1, seq, 8, 64).unwrap();
    let (q, k, v, go) =
        (inputs::<f32>(shape, 1), inputs::<f32>(shape, 2), inputs::<f32>(shape, 3), inputs::<f32>(shape, 4));
    let mut g = c.benchmark_group("forward_backward_f32");
    g.throughput(Throughput::Elements(
        (model_flops(&cfg, shape, Pass::Forward) + model_flops(&cfg, shape, Pass::Backward)) as u64,
    ));
    g.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(5));
    g.bench_function(BenchmarkId::from_parameter(seq), |b| {
        b.iter(|| {
            let (out, lse) = be.forward_vec(&cfg, shape, &q, &k, &v).unwrap();
            std::hint::black_box(be.backward_vec(&cfg, shape, [&q, &k, &v], &out, &lse, &go).unwrap())
        })
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    let threads = std::env::var("ATTN_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(2);
    let be = CpuBackend::new(threads).unwrap();
    forward::<f32>(c, &be, 8192, false);
    forward::<f32>(c, &be, 8192, true);
    forward::<bf16>(c, &be, 8192, false);
    backward(c, &be, 4096);
}

criterion_group!(cpu, benches);
criterion_main!(cpu);
