//! The chunk ring moves k/v only as far as the ranks whose queries reach them: segments
//! inside ranks move nothing, a causal window one step, a two-sided window one step each
//! way, dense causal attention the whole ring; the backward's dk/dv go straight home from
//! the last rank they reached; in rounds, only the slices some query reaches move. Data
//! bytes per rank, counted by the communicator (host-staged) or by the in-process
//! transport (each hand-over as the message it replaces), against the count of those
//! steps; both transports count the same for every strategy, and the head strategies'
//! counts are the byte formula's (`expected_traffic`). The ring and all-gather send whole
//! slices around the chunk ring, not the plan ring's routed blocks of selected rows, so
//! the formula does not describe them: their counts are checked against the steps above.

use crate::common;

use attn_core::error::TensorName;
use attn_core::{AttnShape, DType, DilatedConfig, Pass, Shape4, TensorView};
use attn_ring::chunk_ring::{
    ChunkOptions, ChunkTransport, CpuChunks, HostRows, HostTransport, InProcessTransport, chunk_backward,
    chunk_forward, rank_pieces,
};
use attn_ring::plan::MSG_HEADER_BYTES;
use attn_ring::{Layout, Plan, RingProblem, RingStats, Strategy, ThreadComm, Traffic, expected_traffic};
use common::Moves;

const WORLD: usize = 4;
const SHAPE: Shape4 = Shape4 { batch: 1, seq: 64, heads: 2, head_dim: 4 };
const BOTH: [Moves; 2] = [Moves::HostStaged, Moves::InProcess];

/// Every rank's forward and backward statistics for `cfg` over threads, rows moved as `moves` says.
fn stats(cfg: &DilatedConfig, layout: Layout, strategy: Strategy, moves: Moves) -> Vec<(RingStats, RingStats)> {
    stats_in(cfg, layout, strategy, ChunkOptions::default(), moves)
}

/// [`stats`] with k/v moving in `opts`' rounds.
fn stats_in(
    cfg: &DilatedConfig,
    layout: Layout,
    strategy: Strategy,
    opts: ChunkOptions,
    moves: Moves,
) -> Vec<(RingStats, RingStats)> {
    stats_of(&RingProblem::new(cfg, SHAPE.into(), layout, strategy, WORLD), opts, moves)
}

/// A rank's end of the ring: its communicator (host-staged) or its in-process transport.
enum End {
    Comm(ThreadComm),
    InProcess(InProcessTransport<ThreadComm, HostRows<f32>, attn_ring::chunk_ring::HostAcc>),
}

/// Every rank's forward and backward statistics for `problem` (q, k, v and grad_out the
/// same values, sized for q or for k/v).
fn stats_of(problem: &RingProblem, opts: ChunkOptions, moves: Moves) -> Vec<(RingStats, RingStats)> {
    let comms = ThreadComm::world(problem.world).unwrap();
    let ends: Vec<End> = match moves {
        Moves::HostStaged => comms.into_iter().map(End::Comm).collect(),
        Moves::InProcess => InProcessTransport::world(comms).unwrap().into_iter().map(End::InProcess).collect(),
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = ends
            .into_iter()
            .enumerate()
            .map(|(r, end)| {
                s.spawn(move || match end {
                    End::Comm(mut comm) => rank_stats(&mut HostTransport::new(&mut comm), problem, opts, r),
                    End::InProcess(mut t) => rank_stats(&mut t, problem, opts, r),
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank `r`'s forward and backward statistics on transport `t`.
fn rank_stats<Tr: ChunkTransport<f32, CpuChunks> + ?Sized>(
    t: &mut Tr,
    problem: &RingProblem,
    opts: ChunkOptions,
    r: usize,
) -> (RingStats, RingStats) {
    let pieces = |heads: usize| -> Vec<HostRows<f32>> {
        let shape = Shape4 { batch: problem.batch, seq: problem.seq, heads, head_dim: problem.head_dim };
        let x: Vec<f32> = (0..shape.numel()).map(|i| (i as f32 * 0.37).sin()).collect();
        let view = TensorView::contiguous(TensorName::Query, &x, shape).unwrap();
        rank_pieces(problem, r).into_iter().map(|range| HostRows::from_view_rows(&view, range).unwrap()).collect()
    };
    let (q, kv) = (pieces(problem.heads), pieces(problem.kv_heads));
    let qkv = [&q[..], &kv[..], &kv[..]];
    let x = CpuChunks::default();
    let f = chunk_forward(t, &x, problem, opts, qkv).unwrap();
    let b = chunk_backward(t, &x, problem, opts, qkv, &q, None).unwrap();
    (f.stats, b.stats)
}

/// (forward, backward) data bytes of a rank when k/v travel `next` steps to the next rank
/// and `prev` steps back: a k/v message per step; the backward recomputes the forward,
/// sends k/v with their f32 dk/dv per step, then the dk/dv alone straight home after
/// each way's trip.
fn bytes_for(next: u64, prev: u64) -> (u64, u64) {
    bytes_of_slices(SHAPE.seq / WORLD, next, prev)
}

/// [`bytes_for`] of slices of `rows` rows.
fn bytes_of_slices(rows: usize, next: u64, prev: u64) -> (u64, u64) {
    let rows = (rows * SHAPE.heads * SHAPE.head_dim) as u64;
    let kv = MSG_HEADER_BYTES + 2 * rows * 4;
    let grads = MSG_HEADER_BYTES + 2 * rows * 4;
    let kv_grads = MSG_HEADER_BYTES + 2 * rows * 4 + 2 * rows * 4;
    let trip = |steps: u64| if steps == 0 { 0 } else { steps * kv_grads + grads };
    let forward = (next + prev) * kv;
    (forward, forward + trip(next) + trip(prev))
}

#[test]
fn keys_travel_only_as_far_as_the_queries_reaching_them() {
    let b = DilatedConfig::builder;
    let cases = [
        ("segments inside ranks", b().segments(&[16, 8]).dilations(&[1, 2]).build(), Layout::Contiguous, (0, 0)),
        ("causal window (5, 0)", b().window(5, 0).causal().build(), Layout::Contiguous, (1, 0)),
        ("causal segments of 32", b().segments(&[32]).dilations(&[1]).causal().build(), Layout::Contiguous, (1, 0)),
        ("window (5, 5)", b().window(5, 5).build(), Layout::Contiguous, (1, 1)),
        ("zigzag causal window (5, 0)", b().window(5, 0).causal().build(), Layout::Zigzag, (1, 1)),
        ("dense causal", b().segments(&[64]).dilations(&[1]).causal().build(), Layout::Contiguous, (3, 0)),
    ];
    for ((name, cfg, layout, (next, prev)), moves) in cases.iter().flat_map(|c| BOTH.map(|m| (c, m))) {
        let (fwd, bwd) = bytes_for(*next, *prev);
        for (r, (f, b)) in stats(cfg.as_ref().unwrap(), *layout, Strategy::Ring, moves).iter().enumerate() {
            assert_eq!(f.data_bytes_sent, fwd, "{name} {moves:?}: rank {r} forward");
            assert_eq!(b.data_bytes_sent, bwd, "{name} {moves:?}: rank {r} backward");
        }
    }
}

/// A causal window of 3 over 16-row chunks in 4 rounds of 4 rows: only the last round's
/// slice reaches the next rank's queries, so one 4-row slice travels one step, where
/// sending every round's slice would move four.
#[test]
fn in_rounds_only_reached_slices_travel() {
    let cfg = DilatedConfig::builder().window(3, 0).causal().build().unwrap();
    let opts = ChunkOptions::with_rounds(4).unwrap();
    let (fwd, bwd) = bytes_of_slices(SHAPE.seq / WORLD / 4, 1, 0);
    for (strategy, moves) in
        [Strategy::Ring, Strategy::AllGather, Strategy::Auto].into_iter().flat_map(|s| BOTH.map(|m| (s, m)))
    {
        for (r, (f, b)) in stats_in(&cfg, Layout::Contiguous, strategy, opts, moves).iter().enumerate() {
            assert_eq!(f.data_bytes_sent, fwd, "{strategy:?} {moves:?}: rank {r} forward");
            assert_eq!(b.data_bytes_sent, bwd, "{strategy:?} {moves:?}: rank {r} backward");
        }
    }
}

/// All-gather: k/v straight to the rank each distance on, its dk/dv with them, and back
/// home from there: one k/v message per distance (the recomputed forward's too) and, per
/// distance, k/v with dk/dv out and dk/dv home.
#[test]
fn all_gather_sends_each_distance_once() {
    let b = DilatedConfig::builder;
    let cases = [
        ("window (5, 5)", b().window(5, 5).build(), Layout::Contiguous, 2),
        ("dense causal", b().segments(&[64]).dilations(&[1]).causal().build(), Layout::Contiguous, 3),
        ("segments inside ranks", b().segments(&[16]).dilations(&[1]).build(), Layout::Contiguous, 0),
    ];
    let rows = (SHAPE.seq / WORLD * SHAPE.heads * SHAPE.head_dim) as u64;
    let (kv, grads) = (MSG_HEADER_BYTES + 2 * rows * 4, MSG_HEADER_BYTES + 2 * rows * 4);
    let kv_grads = MSG_HEADER_BYTES + 4 * rows * 4;
    for ((name, cfg, layout, distances), moves) in cases.iter().flat_map(|c| BOTH.map(|m| (c, m))) {
        let (fwd, bwd) = (distances * kv, distances * (kv + kv_grads + grads));
        for (r, (f, b)) in stats(cfg.as_ref().unwrap(), *layout, Strategy::AllGather, moves).iter().enumerate() {
            assert_eq!(f.data_bytes_sent, fwd, "{name} {moves:?}: rank {r} forward");
            assert_eq!(b.data_bytes_sent, bwd, "{name} {moves:?}: rank {r} backward");
        }
    }
}

/// What a rank's statistics say it sent, as the formula counts it.
fn traffic(s: &RingStats) -> Traffic {
    Traffic { bytes: s.data_bytes_sent, messages: s.data_messages }
}

/// Every strategy, grouped k/v heads (4 query heads reading 2), both layouts: the
/// in-process transport counts every rank's data bytes and messages exactly as host
/// staging sends them, forward and backward (the ring's travels, all-gather's direct
/// sends, both all-to-alls of Ulysses and the hybrid). For the head strategies that count
/// is the byte formula's.
#[test]
fn in_process_counts_what_host_staging_sends_and_the_formula_predicts() {
    let b = DilatedConfig::builder;
    let dense = b().segments(&[64]).dilations(&[1]).causal().build().unwrap();
    let dilated = b().segments(&[16, 32]).dilations(&[1, 2]).build().unwrap();
    let shape = AttnShape { q: Shape4 { heads: 4, ..SHAPE }, kv: Shape4 { heads: 2, ..SHAPE } };
    let heads = [Strategy::Ulysses, Strategy::Hybrid { ulysses: 2 }];
    let rows = [Strategy::Ring, Strategy::AllGather];
    let mut formula = 0;
    for (cfg, layout, strategy) in [&dense, &dilated]
        .into_iter()
        .flat_map(|c| [Layout::Contiguous, Layout::Zigzag].map(|l| (c, l)))
        .flat_map(|(c, l)| heads.iter().chain(&rows).map(move |&s| (c, l, s)))
    {
        let problem = RingProblem::new(cfg, shape, layout, strategy, WORLD);
        let case = format!("{cfg:?} {layout:?} {strategy:?}");
        let host = stats_of(&problem, ChunkOptions::default(), Moves::HostStaged);
        let moved = stats_of(&problem, ChunkOptions::default(), Moves::InProcess);
        for (r, (h, m)) in host.iter().zip(&moved).enumerate() {
            assert_eq!((traffic(&m.0), traffic(&m.1)), (traffic(&h.0), traffic(&h.1)), "{case}: rank {r}");
        }
        let plan = Plan::new(problem.clone()).unwrap();
        if heads.contains(&strategy) {
            let [f, b] = [Pass::Forward, Pass::Backward].map(|p| expected_traffic(&plan, DType::F32, p));
            let got: Vec<_> = moved.iter().map(|(f, b)| (traffic(f), traffic(b))).collect();
            let want: Vec<_> = f.into_iter().zip(b).collect();
            assert_eq!(got, want, "{case}: in-process count against the formula");
            assert!(got.iter().all(|(f, _)| f.bytes > 0), "{case}: nothing counted");
            formula += 1;
        }
    }
    assert_eq!(formula, 8);
}

/// Where every segment sits inside a rank's 16 rows, Ulysses and the hybrid on the chunk
/// ring have nothing to exchange: no rank sends data, forward or backward, both transports,
/// as the formula says.
#[test]
fn head_strategies_send_nothing_where_every_segment_sits_inside_a_rank() {
    let cfg = DilatedConfig::builder().segments(&[8, 16]).dilations(&[1, 2]).causal().build().unwrap();
    let shape = AttnShape { q: Shape4 { heads: 4, ..SHAPE }, kv: Shape4 { heads: 2, ..SHAPE } };
    for strategy in [Strategy::Ulysses, Strategy::Hybrid { ulysses: 2 }] {
        let problem = RingProblem::new(&cfg, shape, Layout::Contiguous, strategy, WORLD);
        let plan = Plan::new(problem.clone()).unwrap();
        assert!(plan.head_split().is_none(), "{strategy:?}");
        for moves in [Moves::HostStaged, Moves::InProcess] {
            for (r, (f, b)) in stats_of(&problem, ChunkOptions::default(), moves).iter().enumerate() {
                assert_eq!((traffic(f), traffic(b)), (Traffic::default(), Traffic::default()), "{strategy:?} rank {r}");
            }
        }
    }
}
