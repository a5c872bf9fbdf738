//! The chunk ring moves k/v only as far as the ranks whose queries reach them: segments
//! inside ranks move nothing, a causal window one step, a two-sided window one step each
//! way, dense causal attention the whole ring; the backward's dk/dv go straight home from
//! the last rank they reached; in rounds, only the slices some query reaches move. Data
//! bytes per rank, counted by the communicator, against the count of those steps.

use attn_core::error::TensorName;
use attn_core::{DilatedConfig, Shape4, TensorView};
use attn_ring::chunk_ring::{ChunkOptions, CpuChunks, HostRows, HostTransport, chunk_backward, chunk_forward};
use attn_ring::plan::MSG_HEADER_BYTES;
use attn_ring::{Layout, RingProblem, RingStats, Strategy, ThreadComm};

const WORLD: usize = 4;
const SHAPE: Shape4 = Shape4 { batch: 1, seq: 64, heads: 2, head_dim: 4 };

/// Every rank's forward and backward statistics for `cfg` over host-staged threads.
fn stats(cfg: &DilatedConfig, layout: Layout, strategy: Strategy) -> Vec<(RingStats, RingStats)> {
    stats_in(cfg, layout, strategy, ChunkOptions::default())
}

/// [`stats`] with k/v moving in `opts`' rounds.
fn stats_in(
    cfg: &DilatedConfig,
    layout: Layout,
    strategy: Strategy,
    opts: ChunkOptions,
) -> Vec<(RingStats, RingStats)> {
    let problem = RingProblem::new(cfg, SHAPE.into(), layout, strategy, WORLD);
    let x: Vec<f32> = (0..SHAPE.numel()).map(|i| (i as f32 * 0.37).sin()).collect();
    let view = TensorView::contiguous(TensorName::Query, &x, SHAPE).unwrap();
    let comms = ThreadComm::world(WORLD).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, mut comm)| {
                let (problem, view) = (&problem, &view);
                s.spawn(move || {
                    let pieces: Vec<HostRows<f32>> = attn_ring::chunk_ring::rank_pieces(problem, r)
                        .into_iter()
                        .map(|range| HostRows::from_view_rows(view, range).unwrap())
                        .collect();
                    let qkv = [&pieces[..], &pieces[..], &pieces[..]];
                    let x = CpuChunks::default();
                    let mut t = HostTransport::new(&mut comm);
                    let f = chunk_forward(&mut t, &x, problem, opts, qkv).unwrap();
                    let b = chunk_backward(&mut t, &x, problem, opts, qkv, &pieces, None).unwrap();
                    (f.stats, b.stats)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
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
    for (name, cfg, layout, (next, prev)) in cases {
        let (fwd, bwd) = bytes_for(next, prev);
        for (r, (f, b)) in stats(&cfg.unwrap(), layout, Strategy::Ring).iter().enumerate() {
            assert_eq!(f.data_bytes_sent, fwd, "{name}: rank {r} forward");
            assert_eq!(b.data_bytes_sent, bwd, "{name}: rank {r} backward");
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
    for strategy in [Strategy::Ring, Strategy::AllGather, Strategy::Auto] {
        for (r, (f, b)) in stats_in(&cfg, Layout::Contiguous, strategy, opts).iter().enumerate() {
            assert_eq!(f.data_bytes_sent, fwd, "{strategy:?}: rank {r} forward");
            assert_eq!(b.data_bytes_sent, bwd, "{strategy:?}: rank {r} backward");
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
    for (name, cfg, layout, distances) in cases {
        let (fwd, bwd) = (distances * kv, distances * (kv + kv_grads + grads));
        for (r, (f, b)) in stats(&cfg.unwrap(), layout, Strategy::AllGather).iter().enumerate() {
            assert_eq!(f.data_bytes_sent, fwd, "{name}: rank {r} forward");
            assert_eq!(b.data_bytes_sent, bwd, "{name}: rank {r} backward");
        }
    }
}
