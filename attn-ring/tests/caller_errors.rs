//! Caller mistakes at the public entry points are typed errors on every rank, never a
//! panic, a hang or a silently wrong answer: global tensors unlike the problem (or k/v
//! unlike q) in the in-process runners, communicators out of rank order, an invalid
//! communicator (world 0, rank outside the world), a zigzag world too large for `2p`,
//! a problem for a far larger world than the communicator's, and problems whose byte
//! figures would leave u64 or whose plan tables (world^2) no machine could hold.

use std::time::{Duration, Instant};

use attn_core::error::TensorName;
use attn_core::{AttnError, DilatedConfig, Pass, Result, Shape4, TensorView, TensorViewMut};
use attn_ring::comm::Framing;
use attn_ring::{
    Communicator, Layout, MAX_WORLD, Plan, Strategy, ThreadComm, backward_on, expected_bytes, forward_on, local_rows,
    problem_for, ring_forward, ring_workspace_bytes, run_in_process, run_in_process_backward, run_on,
};
use attn_testkit::random_vec;

fn cfg() -> DilatedConfig {
    DilatedConfig::new(&[4, 8], &[1, 2]).unwrap()
}

fn shape(seq: usize) -> Shape4 {
    Shape4::new(1, seq, 2, 4).unwrap()
}

fn view(x: &[f32], s: Shape4) -> TensorView<'_, f32> {
    TensorView::contiguous(TensorName::Other("x"), x, s).unwrap()
}

fn is_mismatch(r: &Result<impl std::fmt::Debug>, name: TensorName) -> bool {
    matches!(r, Err(AttnError::ShapeMismatch { tensor, .. }) if *tensor == name)
}

#[test]
fn k_v_or_grad_out_unlike_q_is_a_shape_mismatch() {
    let q = random_vec(1, shape(16).numel());
    for kv_seq in [8, 32] {
        // A longer k must not run on its first 16 rows, nor a shorter one panic a rank thread.
        let k = random_vec(2, shape(kv_seq).numel());
        let (qv, kv) = (view(&q, shape(16)), view(&k, shape(kv_seq)));
        let r = run_in_process(2, &cfg(), Layout::Contiguous, Strategy::Auto, qv, kv, qv);
        assert!(is_mismatch(&r, TensorName::Key), "k seq {kv_seq}: {r:?}");
        let r = run_in_process(2, &cfg(), Layout::Zigzag, Strategy::Ring, qv, qv, kv);
        assert!(is_mismatch(&r, TensorName::Value), "v seq {kv_seq}: {r:?}");
        let r = run_in_process_backward(2, &cfg(), Layout::Contiguous, Strategy::Auto, [qv, qv, qv], kv);
        assert!(is_mismatch(&r, TensorName::GradOutput), "grad_out seq {kv_seq}: {r:?}");
    }
}

#[test]
fn global_tensors_unlike_the_problem_fail_every_rank() {
    let q = random_vec(1, shape(16).numel());
    let qv = view(&q, shape(16));
    let mut problem = problem_for(&cfg(), shape(16), Layout::Contiguous, Strategy::Auto, 2);
    problem.seq = 32;
    let res = forward_on(ThreadComm::world(2).unwrap(), &problem, qv, qv, qv);
    assert_eq!(res.len(), 2);
    assert!(res.iter().all(|r| is_mismatch(r, TensorName::Query)), "{res:?}");
    let res = backward_on(ThreadComm::world(2).unwrap(), &problem, [qv, qv, qv], qv);
    assert!(res.iter().all(|r| is_mismatch(r, TensorName::Query)), "{res:?}");
}

#[test]
fn communicators_out_of_rank_order_are_refused() {
    let q = random_vec(1, shape(16).numel());
    let qv = view(&q, shape(16));
    // Reversed, the ranks' rows must not be reassembled at each other's positions.
    let mut comms = ThreadComm::world(2).unwrap();
    comms.reverse();
    let r = run_on(comms, &cfg(), Layout::Contiguous, Strategy::Auto, [qv, qv, qv]);
    assert!(matches!(r, Err(AttnError::InvalidArgument(ref m)) if m.contains("rank order")), "{r:?}");
    // Two ranks of a world of three.
    let comms: Vec<ThreadComm> = ThreadComm::world(3).unwrap().into_iter().take(2).collect();
    let r = run_on(comms, &cfg(), Layout::Contiguous, Strategy::Auto, [qv, qv, qv]);
    assert!(matches!(r, Err(AttnError::InvalidArgument(_))), "{r:?}");
}

/// A communicator reporting any rank and world size; it has no peers to talk to.
#[derive(Debug)]
struct Claims {
    rank: usize,
    world: usize,
    framing: Framing,
}

impl Communicator for Claims {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn timeout(&self) -> Duration {
        Duration::from_millis(50)
    }
    fn exchange_frames(&mut self, _: Vec<(usize, Vec<u8>)>, from: &[usize]) -> Result<Vec<Vec<u8>>> {
        match from.first() {
            None => Ok(Vec::new()),
            Some(&peer) => Err(AttnError::Timeout { rank: self.rank, peer, timeout_ms: 50 }),
        }
    }
    fn framing_mut(&mut self) -> &mut Framing {
        &mut self.framing
    }
    fn framing(&self) -> &Framing {
        &self.framing
    }
}

#[test]
fn a_communicator_with_no_world_or_a_rank_outside_it_is_refused() {
    let s = shape(16);
    let q = random_vec(1, s.numel());
    // World 0 must not skip the handshake's checks and write a result, nor rank 1 of 1
    // wait for itself until the timeout.
    for (rank, world) in [(0, 0), (1, 1), (3, 2)] {
        let mut comm = Claims { rank, world, framing: Framing::new(0, world) };
        let problem = problem_for(&cfg(), s, Layout::Contiguous, Strategy::Auto, world.max(1));
        let (mut out, mut lse) = (vec![7.0f32; s.numel()], vec![7.0f32; s.lse_len()]);
        let mut ov = TensorViewMut::contiguous(TensorName::Output, &mut out, s).unwrap();
        let r = ring_forward(&mut comm, &problem, [view(&q, s), view(&q, s), view(&q, s)], &mut ov, &mut lse);
        assert!(matches!(r, Err(AttnError::InvalidArgument(_))), "rank {rank} of {world}: {r:?}");
        assert!(out.iter().chain(&lse).all(|&x| x == 7.0), "output written despite an error");
    }
}

#[test]
fn a_zigzag_world_beyond_half_of_usize_is_an_error() {
    let huge = usize::MAX / 2 + 1;
    // 2 * world would wrap to 0: a division by zero.
    assert!(matches!(Layout::Zigzag.check(10, huge), Err(AttnError::InvalidArgument(_))));
    assert!(Layout::Zigzag.ranges(10, huge, 0).len() <= 1 && Layout::Zigzag.rows(10, huge, huge - 1) <= 1);
    // n = p = usize::MAX: exact, with no intermediate overflow (chunk h of 2p starts at h/2).
    let m = usize::MAX;
    assert_eq!(Layout::Zigzag.ranges(m, m, 0), vec![m - 1..m]);
    assert_eq!(Layout::Zigzag.ranges(m, m, 1), vec![0..1]);
    assert_eq!(Layout::Zigzag.ranges(m, m, m - 1), vec![m / 2..m / 2 + 1]);
    assert_eq!(Layout::Contiguous.ranges(m, m, m - 1), vec![m - 1..m]);
    let mut problem = problem_for(&cfg(), shape(16), Layout::Zigzag, Strategy::Auto, 1);
    problem.world = huge;
    assert!(matches!(Plan::new(problem.clone()), Err(AttnError::InvalidArgument(_))));
    let mut comm = ThreadComm::world(1).unwrap().remove(0);
    let q = random_vec(1, shape(16).numel());
    let (mut out, mut lse) = (vec![0.0f32; q.len()], vec![0.0f32; shape(16).lse_len()]);
    let mut ov = TensorViewMut::contiguous(TensorName::Output, &mut out, shape(16)).unwrap();
    let qv = view(&q, shape(16));
    let r = ring_forward(&mut comm, &problem, [qv, qv, qv], &mut ov, &mut lse);
    assert!(matches!(r, Err(AttnError::RankDisagreement(_))), "{r:?}");
}

#[test]
fn a_problem_for_a_far_larger_world_fails_at_once() {
    // A world of 2^20 over one rank: the plan's world^2 tables (a terabyte) must not be
    // built before the handshake reports the mismatch.
    let s = Shape4::new(1, 1 << 20, 1, 1).unwrap();
    let mut problem = problem_for(&DilatedConfig::new(&[4], &[1]).unwrap(), s, Layout::Contiguous, Strategy::Auto, 1);
    problem.world = 1 << 20;
    let ls = Shape4::new(1, 1, 1, 1).unwrap();
    let (x, mut out, mut lse) = (vec![0.5f32], vec![0.0f32], vec![0.0f32]);
    let mut ov = TensorViewMut::contiguous(TensorName::Output, &mut out, ls).unwrap();
    let mut comm = ThreadComm::world(1).unwrap().remove(0);
    let t = Instant::now();
    let r = ring_forward(&mut comm, &problem, [view(&x, ls), view(&x, ls), view(&x, ls)], &mut ov, &mut lse);
    assert!(matches!(r, Err(AttnError::RankDisagreement(ref m)) if m.contains("ranks")), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
}

#[test]
fn byte_figures_that_would_leave_u64_are_refused() {
    // Shapes `Shape4` accepts whose byte figures wrap in u64 if unchecked: an f64
    // backward's io_bytes over 2^59 elements, LongNet with 64 patterns over 2^56 elements
    // (whose payload would wrap to 0, leaving only the headers' 27 bytes per rank).
    let big = Shape4::new(1, 1 << 40, 1, 1 << 19).unwrap();
    let problem =
        problem_for(&DilatedConfig::new(&[1 << 20], &[1]).unwrap(), big, Layout::Contiguous, Strategy::Auto, 2);
    assert!(matches!(Plan::new(problem.clone()), Err(AttnError::ShapeOverflow { .. })));
    let r = ring_workspace_bytes(&problem, attn_core::DType::F64, Pass::Backward);
    assert!(matches!(r, Err(AttnError::ShapeOverflow { .. })), "{r:?}");
    let segs: Vec<usize> = (0..64).map(|i| 1 << (10 + i % 8)).collect();
    let longnet = DilatedConfig::builder()
        .segments(&segs)
        .dilations(&[1; 64])
        .mixing(attn_core::Mixing::LongNet)
        .build()
        .unwrap();
    let wide = Shape4::new(1, 1 << 40, 1, 1 << 16).unwrap();
    let problem = problem_for(&longnet, wide, Layout::Contiguous, Strategy::Ring, 2);
    assert!(matches!(Plan::new(problem), Err(AttnError::ShapeOverflow { .. })));
    // Just inside the bound, the figures are exact: one pattern spanning both ranks,
    // every row's k and v (f32) sent once by its owner, plus one header.
    let edge = Shape4::new(1, 1 << 40, 1, 1 << 10).unwrap();
    let problem =
        problem_for(&DilatedConfig::new(&[1 << 40], &[1]).unwrap(), edge, Layout::Contiguous, Strategy::Ring, 2);
    let plan = Plan::new(problem).unwrap();
    let half = (1u64 << 39) * 2 * (1 << 10) * 4;
    assert_eq!(expected_bytes(&plan, attn_core::DType::F32, Pass::Forward), vec![9 + half, 9 + half]);
}

#[test]
fn worlds_beyond_max_world_are_refused() {
    let s = Shape4::new(1, 2 * (MAX_WORLD + 1), 1, 4).unwrap();
    let problem =
        problem_for(&DilatedConfig::new(&[4], &[1]).unwrap(), s, Layout::Zigzag, Strategy::Auto, MAX_WORLD + 1);
    let t = Instant::now();
    let r = Plan::new(problem);
    assert!(matches!(&r, Err(AttnError::InvalidArgument(m)) if m.contains("at most")), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(1), "took {:?}", t.elapsed());
}

#[test]
fn local_rows_outside_the_sequence_are_refused() {
    let x = random_vec(3, shape(8).numel());
    let v = view(&x, shape(8));
    // A position past the sequence is an error, not an index out of range.
    let r = local_rows(&v, &[0, 8]);
    assert!(matches!(&r, Err(AttnError::InvalidArgument(m)) if m.contains("position 8")), "{r:?}");
    let rows = local_rows(&v, &[7, 2]).unwrap();
    let row = |p: usize, h: usize| x[(p * 2 + h) * 4..(p * 2 + h + 1) * 4].to_vec();
    assert_eq!(rows, [row(7, 0), row(7, 1), row(2, 0), row(2, 1)].concat());
    assert!(local_rows(&v, &[]).unwrap().is_empty());
}

#[test]
fn a_segment_longer_than_the_sequence_sizes_like_one_segment() {
    // Every `w > n` is one segment of length n (SPEC), so every such `w` has the same
    // workspace bound; with `w = usize::MAX` its per-segment row cap overflowed (wrapped
    // to 1: an underestimate).
    let s = Shape4::new(1, 64, 2, 8).unwrap();
    for (layout, strategy) in [(Layout::Contiguous, Strategy::Ring), (Layout::Zigzag, Strategy::AllGather)] {
        for backward in [false, true] {
            let pass = if backward { Pass::Backward } else { Pass::Forward };
            let bytes = |w: usize| {
                let cfg = DilatedConfig::new(&[w], &[1]).unwrap();
                ring_workspace_bytes(&problem_for(&cfg, s, layout, strategy, 4), attn_core::DType::F32, pass).unwrap()
            };
            assert_eq!(bytes(usize::MAX), bytes(65), "{layout:?} {strategy:?} backward {backward}");
        }
    }
}
