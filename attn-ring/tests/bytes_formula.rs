//! Bytes sent per rank equal the closed-form formula of each strategy, and
//! only selected rows travel (segment-local patterns send nothing).

use crate::common;

use attn_core::error::TensorName;
use attn_core::{AttnShape, DType, DilatedConfig, KeyPaddingMask, Mixing, OwnedMasks, Pass, Shape4, TensorView};
use attn_ring::plan::ring_route::Way;
use attn_ring::{
    Layout, PatternStrategy, Plan, RingProblem, Strategy, ThreadComm, expected_bytes, problem_for, run_in_process,
    run_in_process_backward, run_problem_backward_on, run_problem_on,
};
use attn_testkit::random_vec;
use common::views;

fn cfg(w: &[usize], r: &[usize], mixing: Mixing, causal: bool) -> DilatedConfig {
    DilatedConfig::builder().segments(w).dilations(r).mixing(mixing).causality(causal.into()).build().unwrap()
}

#[test]
fn measured_bytes_equal_the_formula() {
    let configs = [
        cfg(&[8, 16, 64], &[1, 2, 4], Mixing::HeadGroups, false),
        cfg(&[8, 16, 64], &[1, 2, 4], Mixing::LongNet, true),
        cfg(&[64], &[1], Mixing::HeadGroups, true),
        cfg(&[10, 30], &[3, 2], Mixing::LongNet, false),
    ];
    for cfg in &configs {
        for world in [1, 2, 3, 4, 5] {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                for strategy in [Strategy::Auto, Strategy::Ring, Strategy::AllGather] {
                    let shape = Shape4::new(2, 61, 3, 4).unwrap();
                    let n = shape.numel();
                    let (q, k, v, go) = (random_vec(1, n), random_vec(2, n), random_vec(3, n), random_vec(4, n));
                    let a = attn_core::AttnShape::self_attn(shape);
                    let [qv, kv, vv] = views(a, &q, &k, &v).unwrap();
                    let plan = Plan::new(problem_for(cfg, shape, layout, strategy, world)).unwrap();
                    let f = run_in_process(world, cfg, layout, strategy, qv, kv, vv).unwrap();
                    let got: Vec<u64> = f.stats.iter().map(|s| s.data_bytes_sent).collect();
                    assert_eq!(
                        got,
                        expected_bytes(&plan, DType::F32, Pass::Forward),
                        "{cfg:?} p={world} {layout:?} {strategy:?}"
                    );
                    let gov = attn_core::TensorView::contiguous(attn_core::error::TensorName::GradOutput, &go, shape)
                        .unwrap();
                    let b = run_in_process_backward(world, cfg, layout, strategy, [qv, kv, vv], gov).unwrap();
                    let got: Vec<u64> = b.stats.iter().map(|s| s.data_bytes_sent).collect();
                    assert_eq!(
                        got,
                        expected_bytes(&plan, DType::F32, Pass::Backward),
                        "bwd {cfg:?} p={world} {layout:?} {strategy:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn segment_local_patterns_send_nothing_and_plain_ring_sends_everything() {
    // Segments of 16 with 4 ranks of 16 rows: every segment inside one rank.
    let local = cfg(&[16, 8], &[1, 2], Mixing::LongNet, false);
    let shape = Shape4::new(1, 64, 2, 8).unwrap();
    let plan = Plan::new(problem_for(&local, shape, Layout::Contiguous, Strategy::Ring, 4)).unwrap();
    assert_eq!(plan.strategies, vec![PatternStrategy::Local, PatternStrategy::Local]);
    assert_eq!(expected_bytes(&plan, DType::F32, Pass::Forward), vec![0; 4]);
    // Plain ring attention: one pattern, w >= n, r = 1, non-causal: every block visits every rank.
    let dense = cfg(&[64], &[1], Mixing::HeadGroups, false);
    let plan = Plan::new(problem_for(&dense, shape, Layout::Contiguous, Strategy::Ring, 4)).unwrap();
    assert_eq!(plan.strategies, vec![PatternStrategy::Ring]);
    assert_eq!(plan.hops, [vec![3; 4], vec![0; 4]]);
    // Each rank forwards 3 blocks of 16 rows x 2 heads x (k + v) x 8 floats x 4 bytes, plus headers.
    let per_block = 9 + 16 * 2 * 2 * 8 * 4;
    assert_eq!(expected_bytes(&plan, DType::F32, Pass::Forward), vec![3 * per_block; 4]);
    // Dilation r = 4 on the same segment: a quarter of the rows travel.
    let dil = cfg(&[64], &[4], Mixing::HeadGroups, false);
    let plan = Plan::new(problem_for(&dil, shape, Layout::Contiguous, Strategy::Ring, 4)).unwrap();
    assert_eq!(expected_bytes(&plan, DType::F32, Pass::Forward), vec![3 * (9 + 4 * 2 * 2 * 8 * 4); 4]);
}

#[test]
fn per_rank_buffers_shrink_with_the_world_size() {
    use attn_ring::forward_buffer_bytes;
    // Non-causal: every row travels (causal zigzag sends only keys that precede the receiver's queries).
    let dense = cfg(&[4096], &[1], Mixing::HeadGroups, false);
    let shape = Shape4::new(1, 4096, 4, 64).unwrap();
    for p in [2u64, 4, 8, 16] {
        let plan = Plan::new(problem_for(&dense, shape, Layout::Zigzag, Strategy::Ring, p as usize)).unwrap();
        let (b, h, d, l) = (1u64, 4u64, 64u64, 4096 / p);
        // Closed form for plain ring attention (see `forward_buffer_bytes`).
        // The visitor is decoded whole when passed on (p >= 3), else one (batch, head) at a time.
        let visitor = if p >= 3 { b * l * h * 2 * d * 4 } else { l * 2 * d * 4 };
        let want = b * l * h * (d + 1) * 4 + (9 + b * l * h * 2 * d * 4) + (visitor + 8 * l * h) + 2 * l * d * 4;
        for r in 0..p as usize {
            assert_eq!(forward_buffer_bytes(&plan, DType::F32, r), want, "p={p} rank {r}");
        }
        // Proportional to n/p: p times the per-rank bytes at most the p = 4 figure times 4.
        let at4 = b * (4096 / 4) * h * ((d + 1) * 4 + 2 * 2 * d * 4 + 8) + 9 + 2 * (4096 / 4) * d * 4;
        assert!(want * p <= at4 * 4 + 9 * p, "p={p}: {want} per rank");
        assert!(p == 2 || want * p * 100 >= at4 * 4 * 99, "p={p}: {want} per rank");
    }
}

#[test]
fn the_workspace_bound_covers_the_buffers_and_shrinks_with_the_world_size() {
    use attn_ring::{forward_buffer_bytes, ring_workspace_bytes};
    let dense = cfg(&[4096], &[1], Mixing::HeadGroups, false);
    let shape = Shape4::new(1, 4096, 4, 64).unwrap();
    let at = |p: usize, pass: Pass| {
        ring_workspace_bytes(&problem_for(&dense, shape, Layout::Zigzag, Strategy::Ring, p), DType::F32, pass).unwrap()
    };
    let (f2, b2) = (at(2, Pass::Forward), at(2, Pass::Backward));
    for p in [2usize, 4, 8, 16] {
        let plan = Plan::new(problem_for(&dense, shape, Layout::Zigzag, Strategy::Ring, p)).unwrap();
        let (f, b) = (at(p, Pass::Forward), at(p, Pass::Backward));
        for r in 0..p {
            let w = plan.workspace_bytes(DType::F32, r, Pass::Forward);
            assert!(w >= forward_buffer_bytes(&plan, DType::F32, r) && w <= f, "p={p} rank {r}");
            assert!(plan.workspace_bytes(DType::F32, r, Pass::Backward) <= b);
        }
        // Per-rank bytes proportional to n/p (within 20% of the p = 2 figure: kernel tiles
        // and bookkeeping do not shrink). The backward bound shrinks too, less than n/p:
        // it counts every dk/dv partial a rank sends (p - 1 here) as possibly unread.
        let pf = p as u64;
        assert!((f * pf).abs_diff(2 * f2) * 5 < 2 * f2, "p={p}: forward {f} per rank vs {f2} at p=2");
        assert!(b < b2 || p == 2, "p={p}: backward {b} per rank vs {b2} at p=2");
    }
    // Unknown ranks need nothing; an invalid problem is the plan's error.
    let plan = Plan::new(problem_for(&dense, shape, Layout::Zigzag, Strategy::Ring, 4)).unwrap();
    assert_eq!(plan.workspace_bytes(DType::F32, 4, Pass::Forward), 0);
    assert!(
        ring_workspace_bytes(
            &problem_for(&dense, shape, Layout::Zigzag, Strategy::Ring, 5000),
            DType::F32,
            Pass::Forward
        )
        .is_err()
    );
}

/// The ring problem of a feature case (grouped heads, padding, packing, windows).
fn feature_problem(
    cfg: &DilatedConfig,
    kv_heads: usize,
    masks: OwnedMasks,
    world: usize,
    layout: Layout,
    strategy: Strategy,
) -> (RingProblem, AttnShape) {
    let q = Shape4::new(if masks.cu_seqlens().is_some() { 1 } else { 2 }, 61, 4, 4).unwrap();
    let shape = AttnShape { q, kv: Shape4 { heads: kv_heads, ..q } };
    (RingProblem::new(cfg, shape, layout, strategy, world).with_masks(masks), shape)
}

/// With the features too, every rank sends exactly `expected_bytes`, forward and backward.
#[test]
fn feature_bytes_equal_the_formula() {
    let pad: Vec<bool> = (0..2 * 61).map(|i| i % 5 == 2).collect();
    let cases = [
        (cfg(&[8, 16, 64], &[1, 2, 4], Mixing::HeadGroups, false), 2, OwnedMasks::none()),
        (
            cfg(&[16, 64], &[1, 2], Mixing::LongNet, true),
            1,
            OwnedMasks::none().with_key_padding(KeyPaddingMask::new(pad, 2, 61).unwrap()),
        ),
        (
            cfg(&[8, 32], &[1, 2], Mixing::LongNet, false),
            2,
            OwnedMasks::none().with_cu_seqlens(vec![0, 7, 30, 61]).unwrap(),
        ),
        (DilatedConfig::builder().window(6, 3).build().unwrap(), 4, OwnedMasks::none()),
        (
            DilatedConfig::builder().window(9, 0).causal().build().unwrap(),
            2,
            OwnedMasks::none().with_cu_seqlens(vec![0, 20, 61]).unwrap(),
        ),
    ];
    for (cfg, kv_heads, masks) in &cases {
        for world in [1, 2, 3, 5] {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                for strategy in [Strategy::Auto, Strategy::Ring, Strategy::AllGather] {
                    let (problem, shape) = feature_problem(cfg, *kv_heads, masks.clone(), world, layout, strategy);
                    let (nq, nk) = (shape.q.numel(), shape.kv.numel());
                    let (q, k, v, go) = (random_vec(1, nq), random_vec(2, nk), random_vec(3, nk), random_vec(4, nq));
                    let qkv = views(shape, &q, &k, &v).unwrap();
                    let plan = Plan::new(problem.clone()).unwrap();
                    let comms = ThreadComm::world(world).unwrap();
                    let f = run_problem_on(comms, &problem, qkv).unwrap();
                    let got: Vec<u64> = f.stats.iter().map(|s| s.data_bytes_sent).collect();
                    let case = format!("{cfg:?} kv={kv_heads} p={world} {layout:?} {strategy:?}");
                    assert_eq!(got, expected_bytes(&plan, DType::F32, Pass::Forward), "{case}");
                    let gov = TensorView::contiguous(TensorName::GradOutput, &go, shape.q).unwrap();
                    let b = run_problem_backward_on(ThreadComm::world(world).unwrap(), &problem, qkv, gov).unwrap();
                    let got: Vec<u64> = b.stats.iter().map(|s| s.data_bytes_sent).collect();
                    assert_eq!(got, expected_bytes(&plan, DType::F32, Pass::Backward), "bwd {case}");
                }
            }
        }
    }
}

/// Grouped heads: the k/v bytes scale with the key/value heads (a pair's rows travel
/// once however many query heads read them): 8 query heads on 1 key/value head send an
/// eighth of what 8 key/value heads send, headers aside.
#[test]
fn grouped_heads_send_their_key_value_heads_once() {
    let cfg = cfg(&[4096], &[1], Mixing::HeadGroups, true);
    let q = Shape4::new(1, 4096, 8, 64).unwrap();
    for strategy in [Strategy::Ring, Strategy::AllGather] {
        let bytes = |kv_heads: usize| {
            let shape = AttnShape { q, kv: Shape4 { heads: kv_heads, ..q } };
            let plan = Plan::new(RingProblem::new(&cfg, shape, Layout::Zigzag, strategy, 4)).unwrap();
            let data: u64 = expected_bytes(&plan, DType::BF16, Pass::Forward).iter().sum();
            let messages = plan.ring_heads.len().max(1) as u64;
            (data, messages)
        };
        let ((full, _), (one, _)) = (bytes(8), bytes(1));
        // Headers (9 bytes per message) aside, exactly an eighth.
        assert!(one * 8 >= full - 8 * 9 * 64 && one * 8 <= full + 8 * 9 * 64, "{strategy:?}: {one} x 8 vs {full}");
    }
}

/// A window sends a rank only the keys within the window of its queries: at most `left +
/// right` rows per contiguous chunk it holds (two under zigzag), times key/value heads
/// and batch, whatever the sequence length and the strategy (a ring block goes both ways,
/// one hop each, instead of around the ring); `expected_bytes` says so.
#[test]
fn a_window_sends_only_keys_within_reach() {
    let (left, right, kv_heads, d) = (40usize, 8usize, 2usize, 8usize);
    for causal in [false, true] {
        let cfg = DilatedConfig::builder().window(left, right).causality(causal.into()).build().unwrap();
        let reach = left + if causal { 0 } else { right };
        for seq in [1024, 8192, 65536] {
            for (layout, chunks) in [(Layout::Contiguous, 1), (Layout::Zigzag, 2)] {
                for strategy in [Strategy::Auto, Strategy::Ring, Strategy::AllGather] {
                    let q = Shape4::new(1, seq, 4, d).unwrap();
                    let shape = AttnShape { q, kv: Shape4 { heads: kv_heads, ..q } };
                    let plan = Plan::new(RingProblem::new(&cfg, shape, layout, strategy, 4)).unwrap();
                    let per_row = (2 * d * 2) as u64; // k and v rows of bf16
                    let bound = (chunks * reach * kv_heads) as u64 * per_row;
                    let case = format!("seq {seq} {layout:?} {strategy:?} causal={causal}");
                    for r in 0..4 {
                        let rows = received_rows(&plan, r);
                        assert!(rows * per_row <= bound, "{case} rank {r}: {rows} rows");
                    }
                    let sent: u64 = expected_bytes(&plan, DType::BF16, Pass::Forward).iter().sum();
                    assert!(sent <= 4 * (bound + 2 * 3 * 9 * 64), "{case}: {sent} bytes in all");
                }
            }
        }
    }
}

/// The k/v rows rank `r` receives in a forward, from the plan's per-pair counts: every
/// all-gather message to it and every ring block that visits it (either way).
fn received_rows(plan: &Plan, r: usize) -> u64 {
    let p = plan.problem.world;
    let gathered: u64 = (0..p)
        .filter(|&o| o != r)
        .map(|o| plan.gather_heads.iter().map(|ph| plan.gather_count(o, r, ph) as u64).sum::<u64>())
        .sum();
    let ring: u64 = Way::BOTH
        .into_iter()
        .flat_map(|way| (0..p).filter(move |&o| plan.ring_visits(way, o, r)).map(move |o| (way, o)))
        .map(|(way, o)| plan.ring_heads.iter().map(|ph| plan.ring_count(way, o, ph) as u64).sum::<u64>())
        .sum();
    gathered + ring
}

/// The ring strategy's blocks go the way that reaches their receivers in the fewest hops:
/// a rank needing only the rank before it (a two-sided window) gets that block in one hop
/// back; every block still visits only its receivers.
#[test]
fn ring_blocks_take_the_shorter_way() {
    let cfg = DilatedConfig::builder().window(6, 3).build().unwrap();
    let shape = AttnShape::self_attn(Shape4::new(1, 64, 2, 4).unwrap());
    let plan = Plan::new(RingProblem::new(&cfg, shape, Layout::Contiguous, Strategy::Ring, 4)).unwrap();
    // Owner 0 feeds rank 1 (next); owner 3 feeds rank 2 (back); inner owners both.
    assert_eq!(plan.hops, [vec![1, 1, 1, 0], vec![0, 1, 1, 1]]);
    assert_eq!(plan.ring_steps(), 1);
    for way in Way::BOTH {
        for o in 0..4 {
            let visited: Vec<usize> = (0..4).filter(|&r| plan.ring_visits(way, o, r)).collect();
            assert!(visited.iter().all(|&r| r.abs_diff(o) == 1), "{way:?} owner {o}: {visited:?}");
        }
    }
}
