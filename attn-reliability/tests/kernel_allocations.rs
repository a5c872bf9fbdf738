//! The CPU kernels' memory: `CpuBackend::workspace_bytes` is a true upper bound on the
//! peak bytes a forward or backward call allocates beyond the caller's buffers, and the
//! ring's block calls allocate nothing once their thread is warm (measured by the
//! workspace's counting allocator).

use attn_core::error::TensorName;
use attn_core::{
    Attention, AttnInputs, AttnShape, Band, DilatedConfig, Grads, KeyPadding, Masks, Mixing, PackedSequences, Pass,
    Saved, Shape4, TensorView, TensorViewMut,
};
use attn_kernels::{Block, BlockGradients, BlockRows, CpuBackend, Upstream, attend_block, attend_block_backward};
use attn_reliability::counting_alloc::{self, CountingAlloc, measure};
use attn_testkit::random_vec;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn check(cfg: &DilatedConfig, shape: Shape4) {
    check_masked(cfg, AttnShape::self_attn(shape), Masks::NONE);
}

fn check_masked(cfg: &DilatedConfig, shape: AttnShape, masks: Masks<'_>) {
    let _guard = counting_alloc::exclusive();
    let (n, nk) = (shape.q.numel(), shape.kv.numel());
    let (q, k, v, go) = (random_vec(1, n), random_vec(2, nk), random_vec(3, nk), random_vec(4, n));
    let (mut out, mut lse) = (vec![0.0f32; n], vec![0.0f32; shape.q.lse_len()]);
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; n], vec![0.0f32; nk], vec![0.0f32; nk]);
    let be = CpuBackend::new(2).unwrap();
    let view = |x, s| TensorView::contiguous(TensorName::Query, x, s).unwrap();
    let inputs = || AttnInputs::new(cfg, view(&q, shape.q), view(&k, shape.kv), view(&v, shape.kv)).with_masks(masks);
    let ((), fwd) = measure(|| {
        let o = TensorViewMut::contiguous(TensorName::Output, &mut out, shape.q).unwrap();
        be.forward(&inputs(), o, &mut lse).unwrap();
    });
    let fwd = fwd.peak_extra;
    let ((), bwd) = measure(|| {
        let m = |x, s| TensorViewMut::contiguous(TensorName::GradQuery, x, s).unwrap();
        let grads = Grads { dq: m(&mut dq, shape.q), dk: m(&mut dk, shape.kv), dv: m(&mut dv, shape.kv) };
        be.backward(&inputs(), Saved { out: view(&out, shape.q), lse: &lse }, view(&go, shape.q), grads).unwrap();
    });
    let bwd = bwd.peak_extra;
    let wf = be.workspace_bytes_masked(cfg, shape, &masks, Pass::Forward);
    let wb = be.workspace_bytes_masked(cfg, shape, &masks, Pass::Backward);
    println!("{shape:?}: forward peak {fwd} <= {wf}, backward peak {bwd} <= {wb}");
    assert!(fwd <= wf, "forward allocated {fwd} bytes, workspace_bytes says {wf}");
    assert!(bwd <= wb, "backward allocated {bwd} bytes, workspace_bytes says {wb}");
}

#[test]
fn workspace_bytes_bounds_the_allocations() {
    let hg = DilatedConfig::builder().segments(&[256, 512, 1024]).dilations(&[1, 2, 4]).causal().build().unwrap();
    check(&hg, Shape4::new(1, 2048, 3, 64).unwrap());
    let ln = DilatedConfig::builder().segments(&[200, 300]).dilations(&[1, 3]).mixing(Mixing::LongNet).build().unwrap();
    check(&ln, Shape4::new(2, 900, 2, 40).unwrap());
    let big = DilatedConfig::builder().segments(&[4096]).dilations(&[1]).build().unwrap();
    check(&big, Shape4::new(1, 4096, 1, 32).unwrap());
}

/// The bound holds with the features: grouped heads (a fused unit holds the dq of every
/// query head of its group), padding, many packed sequences, a window.
#[test]
fn workspace_bytes_bounds_the_allocations_with_features() {
    let gqa = |q: Shape4, kv_heads| AttnShape { q, kv: Shape4 { heads: kv_heads, ..q } };
    let hg = DilatedConfig::builder().segments(&[128, 256, 1024]).dilations(&[1, 2, 4]).causal().build().unwrap();
    check_masked(&hg, gqa(Shape4::new(1, 2048, 6, 32).unwrap(), 2), Masks::NONE);
    let flags: Vec<bool> = (0..2 * 900).map(|i| i % 3 == 0).collect();
    let ln = DilatedConfig::builder().segments(&[200, 300]).dilations(&[1, 3]).mixing(Mixing::LongNet).build().unwrap();
    let pad = Masks { key_padding: Some(KeyPadding::new(&flags, 2, 900).unwrap()), ..Masks::NONE };
    check_masked(&ln, gqa(Shape4::new(2, 900, 4, 40).unwrap(), 1), pad);
    let cu: Vec<usize> = (0..=300).map(|i| i * 7).collect();
    let packed = Masks { packing: Some(PackedSequences::new(&cu).unwrap()), ..Masks::NONE };
    check_masked(&hg, gqa(Shape4::new(1, 2100, 3, 16).unwrap(), 3), packed);
    let window = DilatedConfig::builder().window(700, 100).build().unwrap();
    check_masked(&window, gqa(Shape4::new(1, 5000, 4, 32).unwrap(), 2), Masks::NONE);
}

/// Number of allocations (reallocations included) the calling thread makes in `f`: the
/// block calls run on it, and the harness's own allocations on other threads stay out.
fn allocs_during(f: impl FnOnce()) -> usize {
    counting_alloc::thread_allocations_during(f).1
}

#[test]
fn warm_block_calls_allocate_nothing() {
    let cfg = DilatedConfig::builder()
        .segments(&[64, 128, 256])
        .dilations(&[1, 2, 4])
        .mixing(Mixing::LongNet)
        .causal()
        .build()
        .unwrap();
    let (n, d) = (300, 40);
    let scale = cfg.scale_for(d) as f32;
    let (q, k, v, go) = (random_vec(5, n * d), random_vec(6, n * d), random_vec(7, n * d), random_vec(8, n * d));
    let ascending: Vec<usize> = (0..n).collect();
    // A zigzag-like block: two runs out of order, so the grouping sorts.
    let shuffled: Vec<usize> = (150..n).chain(0..150).collect();
    let patterns: Vec<_> = cfg.head_patterns(1, 0).patterns.into_iter().map(|(_, p)| p).collect();
    let (lse, delta) = (random_vec(9, n), random_vec(10, n));
    let mut out = vec![0.0f32; n * d];
    let mut partial_lse = vec![f32::NEG_INFINITY; n];
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; n * d], vec![0.0f32; n * d], vec![0.0f32; n * d]);
    let _guard = counting_alloc::exclusive();
    let mut calls = |pos: &[usize]| {
        let rows = |data| BlockRows::new(data, d, pos);
        let (qb, kb, vb, gb) = (rows(&q[..]), rows(&k[..]), rows(&v[..]), rows(&go[..]));
        // Keys split into two blocks, the way a ring step sees them.
        let (k1, k2) = (BlockRows::new(&k[..], d, &pos[..n / 2]), BlockRows::new(&k[n / 2 * d..], d, &pos[n / 2..]));
        let (v1, v2) = (BlockRows::new(&v[..], d, &pos[..n / 2]), BlockRows::new(&v[n / 2 * d..], d, &pos[n / 2..]));
        for p in &patterns {
            attend_block(&Block::new(p, Band::CAUSAL, scale, d, [qb, kb, vb]), &mut out, &mut partial_lse).unwrap();
            attend_block(&Block::new(p, Band::CAUSAL, scale, d, [qb, k1, v1]), &mut out, &mut partial_lse).unwrap();
            attend_block(&Block::new(p, Band::CAUSAL, scale, d, [qb, k2, v2]), &mut out, &mut partial_lse).unwrap();
            attend_block_backward(
                &Block::new(p, Band::CAUSAL, scale, d, [qb, kb, vb]),
                &Upstream { grad_out: gb, grad_scale: 1.0, lse: &lse, delta: &delta },
                BlockGradients { dq: &mut dq, dk: &mut dk, dv: &mut dv },
            )
            .unwrap();
        }
    };
    for pos in [&ascending, &shuffled] {
        calls(pos);
        let allocs = allocs_during(|| calls(pos));
        assert_eq!(allocs, 0, "a warm thread's block calls made {allocs} allocations");
    }
}
