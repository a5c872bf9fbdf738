//! The chunk ring moves k/v only as far as the farthest rank whose queries reach them:
//! segments inside ranks move nothing, a causal window one step, dense causal attention
//! the whole ring; the backward's dk/dv go straight home from the last rank they reached.
//! Data bytes per rank, counted by the communicator, against the count of those steps.

use attn_core::error::TensorName;
use attn_core::{DilatedConfig, Shape4, TensorView};
use attn_ring::chunk_ring::{ChunkOptions, CpuChunks, HostRows, HostTransport, chunk_backward, chunk_forward};
use attn_ring::plan::MSG_HEADER_BYTES;
use attn_ring::{Layout, RingProblem, RingStats, Strategy, ThreadComm};

const WORLD: usize = 4;
const SHAPE: Shape4 = Shape4 { batch: 1, seq: 64, heads: 2, head_dim: 4 };

/// Every rank's forward and backward statistics for `cfg` over host-staged threads.
fn stats(cfg: &DilatedConfig) -> Vec<(RingStats, RingStats)> {
    let problem = RingProblem::new(cfg, SHAPE.into(), Layout::Contiguous, Strategy::Auto, WORLD);
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
                    let (x, opts) = (CpuChunks::default(), ChunkOptions::default());
                    let mut t = HostTransport::new(&mut comm);
                    let f = chunk_forward(&mut t, &x, problem, opts, qkv).unwrap();
                    let b = chunk_backward(&mut t, &x, problem, opts, qkv, &pieces).unwrap();
                    (f.stats, b.stats)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// (forward, backward) data bytes of a rank when k/v travel `steps` steps: a k/v message
/// per step; the backward recomputes the forward, sends k/v with their f32 dk/dv per step,
/// then the dk/dv alone straight home.
fn bytes_for(steps: u64) -> (u64, u64) {
    let rows = (SHAPE.seq / WORLD * SHAPE.heads * SHAPE.head_dim) as u64;
    let kv = MSG_HEADER_BYTES + 2 * rows * 4;
    let grads = MSG_HEADER_BYTES + 2 * rows * 4;
    let kv_grads = MSG_HEADER_BYTES + 2 * rows * 4 + 2 * rows * 4;
    let backward = if steps == 0 { 0 } else { steps * kv + steps * kv_grads + grads };
    (steps * kv, backward)
}

#[test]
fn keys_travel_only_as_far_as_the_queries_reaching_them() {
    let cases = [
        ("segments inside ranks", DilatedConfig::builder().segments(&[16, 8]).dilations(&[1, 2]).build(), 0),
        ("causal window (5, 0)", DilatedConfig::builder().window(5, 0).causal(true).build(), 1),
        ("causal segments of 32", DilatedConfig::builder().segments(&[32]).dilations(&[1]).causal(true).build(), 1),
        ("dense causal", DilatedConfig::builder().segments(&[64]).dilations(&[1]).causal(true).build(), 3),
    ];
    for (name, cfg, steps) in cases {
        let (fwd, bwd) = bytes_for(steps);
        for (r, (f, b)) in stats(&cfg.unwrap()).iter().enumerate() {
            assert_eq!(f.data_bytes_sent, fwd, "{name}: rank {r} forward");
            assert_eq!(b.data_bytes_sent, bwd, "{name}: rank {r} backward");
        }
    }
}
