//! Soak: the ring forward and backward at world size 8, repeated hundreds of times in one
//! process, give bit-identical results every time and no growth in live heap bytes
//! (counted by the crate's counting allocator).

use std::time::Duration;

use attn_core::error::TensorName;
use attn_core::{DilatedConfig, Mixing, Shape4, TensorView};
use attn_reliability::counting_alloc::{self, CountingAlloc};
use attn_reliability::watchdog::within;
use attn_ring::{Layout, Strategy, run_in_process, run_in_process_backward};
use attn_testkit::rng::random_vec;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Iterations of forward + backward (override with `ATTN_SOAK_ITERS`).
fn iterations() -> usize {
    std::env::var("ATTN_SOAK_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(300)
}

/// One forward + backward: everything each call returns, flattened.
fn step(cfg: &DilatedConfig, shape: Shape4, layout: Layout, strategy: Strategy, x: &[Vec<f32>; 4]) -> Vec<u32> {
    let v = |i: usize| TensorView::contiguous(TensorName::Other("soak"), &x[i], shape).unwrap();
    let (q, k, vv, go) = (v(0), v(1), v(2), v(3));
    let f = run_in_process(8, cfg, layout, strategy, q, k, vv).expect("ring forward");
    let b = run_in_process_backward(8, cfg, layout, strategy, [q, k, vv], go).expect("ring backward");
    f.out.iter().chain(&f.lse).chain(&b.dq).chain(&b.dk).chain(&b.dv).map(|x| x.to_bits()).collect()
}

#[test]
fn ring_world_8_soak_is_deterministic_and_leak_free() {
    let _g = counting_alloc::exclusive();
    let report = within(Duration::from_secs(300), || {
        let cfg = DilatedConfig::builder()
            .segments(&[8, 16, 64])
            .dilations(&[1, 2, 4])
            .mixing(Mixing::LongNet)
            .causal()
            .build()
            .unwrap();
        let shape = Shape4::new(1, 64, 2, 8).unwrap();
        let x = [0, 1, 2, 3].map(|i| random_vec(100 + i, shape.numel()));
        let variants = [(Layout::Contiguous, Strategy::Ring), (Layout::Zigzag, Strategy::AllGather)];
        let first: Vec<Vec<u32>> = variants.iter().map(|&(l, s)| step(&cfg, shape, l, s, &x)).collect();
        // Warm up (thread-local and lazily initialised state), then take the baseline.
        for _ in 0..10 {
            for (i, &(l, s)) in variants.iter().enumerate() {
                assert_eq!(step(&cfg, shape, l, s, &x), first[i]);
            }
        }
        let base = counting_alloc::snapshot().live;
        let n = iterations();
        let mut max_live = base;
        for it in 0..n {
            for (i, &(l, s)) in variants.iter().enumerate() {
                let r = step(&cfg, shape, l, s, &x);
                assert!(r == first[i], "iteration {it} ({l:?}, {s:?}): result differs from the first run");
            }
            max_live = max_live.max(counting_alloc::snapshot().live);
        }
        let end = counting_alloc::snapshot().live;
        (n, base, end, max_live)
    })
    .expect("soak hung");
    let (n, base, end, max_live) = report;
    eprintln!(
        "soak: {n} iterations x 2 variants of forward+backward at world 8; live bytes {base} -> {end} (max {max_live})"
    );
    // Allow a page of slack for allocator-internal rounding in thread bookkeeping; a leak
    // of even one f32 per rank per iteration would exceed it.
    let grown = end.saturating_sub(base);
    assert!(grown <= 4096, "live heap grew by {grown} bytes over {n} iterations");
}
