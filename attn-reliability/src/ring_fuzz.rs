//! The body of the `ring_plan` fuzz target: a ring problem from bytes (config, shape,
//! world, layout, strategy; sizes mostly small, sometimes huge). `Plan::new` either
//! refuses it, typed, or accepts a plan whose figures hold: the layout gives every
//! position to exactly one rank, the byte figures answer for every rank without
//! panicking, and a small accepted problem run over in-process ranks equals the
//! float64 reference and sends exactly `expected_bytes`.

use attn_core::{DType, DilatedConfig, Mixing, Pass, Shape4, reference};
use attn_ring::{
    Layout, MAX_PAIRS, MAX_WORLD, Plan, Strategy, expected_bytes, forward_buffer_bytes, problem_for, run_in_process,
};
use attn_testkit::{random_vec, rel_l2_error};

use crate::byte_cursor::ByteCursor;

/// Problems at most this many elements (and worlds up to 8) are also run.
const RUN_LIMIT: usize = 4096;

/// Returns whether the bytes made a problem that ran on the ring (so tests can check
/// that random bytes are not vacuous).
pub fn ring_plan(bytes: &[u8]) -> bool {
    let mut c = ByteCursor::new(bytes);
    let g = 1 + usize::from(c.u8() % 3);
    let segs: Vec<usize> = (0..g).map(|_| if c.u8().is_multiple_of(16) { c.size() } else { c.dim(40) }).collect();
    let rates: Vec<usize> = segs
        .iter()
        .map(|&w| if c.u8().is_multiple_of(16) { c.size() } else { 1 + usize::from(c.u8()) % w.clamp(1, 5) })
        .collect();
    let mixing = if c.bool() { Mixing::LongNet } else { Mixing::HeadGroups };
    let causal = c.bool();
    let (batch, seq, heads, d) = match c.u8() % 8 {
        0 => (c.size(), c.size(), c.size(), c.size()),
        _ => (c.dim(2), c.dim(80), c.dim(4), c.dim(8)),
    };
    let world = if c.u8().is_multiple_of(8) { c.size() } else { c.dim(9) };
    let layout = if c.bool() { Layout::Zigzag } else { Layout::Contiguous };
    let strategy = [Strategy::Auto, Strategy::Ring, Strategy::AllGather][usize::from(c.u8() % 3)];
    let built =
        DilatedConfig::builder().segments(&segs).dilations(&rates).mixing(mixing).causality(causal.into()).build();
    let (Ok(cfg), Ok(shape)) = (built, Shape4::new(batch, seq, heads, d)) else { return false };
    let problem = problem_for(&cfg, shape, layout, strategy, world);
    let plan = Plan::new(problem.clone());
    // The byte figures walk (pattern, head) pairs for every pair of ranks: linear in a
    // legitimately large problem, not a hang, so they are asked only of moderate ones.
    let figures = heads.saturating_mul(segs.len()).saturating_mul(world.saturating_mul(world)) <= 1 << 16;
    if figures || plan.is_err() {
        assert_eq!(plan.is_ok(), attn_ring::ring_workspace_bytes(&problem, DType::F32, Pass::Forward).is_ok());
    }
    let Ok(plan) = plan else { return false };
    assert!((1..=MAX_WORLD).contains(&world), "a plan for {world} ranks");
    assert!(heads * segs.len() <= MAX_PAIRS);
    assert!(layout.check(seq, world).is_ok());
    let rows: Vec<usize> = (0..world).map(|r| layout.rows(seq, world, r)).collect();
    assert_eq!(rows.iter().sum::<usize>(), seq, "{layout:?} rows of {seq} over {world}");
    assert!(rows.iter().all(|&r| r > 0), "an empty rank in an accepted plan");
    if seq <= 1 << 16 {
        let mut all: Vec<usize> = (0..world).flat_map(|r| layout.positions(seq, world, r)).collect();
        all.sort_unstable();
        assert!(all.iter().copied().eq(0..seq), "{layout:?} positions over {world} ranks");
    }
    if !figures {
        return false;
    }
    for pass in [Pass::Forward, Pass::Backward] {
        assert_eq!(expected_bytes(&plan, DType::F32, pass).len(), world);
        for r in 0..world {
            let _ = (plan.workspace_bytes(DType::BF16, r, pass), plan.io_bytes(DType::F64, r, pass));
        }
    }
    let _ = forward_buffer_bytes(&plan, DType::F32, world - 1);
    if shape.numel() > RUN_LIMIT || world > 8 {
        return false;
    }
    let n = shape.numel();
    let (q, k, v) = (random_vec(11, n), random_vec(12, n), random_vec(13, n));
    let view = |x| attn_core::TensorView::contiguous(attn_core::TensorName::Query, x, shape).expect("view");
    let got = run_in_process(world, &cfg, layout, strategy, view(&q), view(&k), view(&v));
    let got = got.unwrap_or_else(|e| panic!("an accepted plan failed to run: {e} ({cfg:?} {shape:?} p={world})"));
    let to64 = |x: &[f32]| x.iter().map(|&a| f64::from(a)).collect::<Vec<_>>();
    let attn = attn_core::AttnShape::self_attn(shape);
    let want = reference::dilated_forward(&cfg, attn, &to64(&q), &to64(&k), &to64(&v)).expect("reference");
    let err = rel_l2_error(&got.out, &want.out);
    assert!(err <= 1e-5, "ring differs from the reference by {err:e}: {cfg:?} {shape:?} p={world} {layout:?}");
    let sent: Vec<u64> = got.stats.iter().map(|s| s.data_bytes_sent).collect();
    assert_eq!(
        sent,
        expected_bytes(&plan, DType::F32, Pass::Forward),
        "{cfg:?} {shape:?} p={world} {layout:?} {strategy:?}"
    );
    true
}
