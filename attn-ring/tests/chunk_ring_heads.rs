//! Ulysses and the hybrid on the chunk ring (CPU compute): heads exchanged by the
//! transports' all-to-all (host-staged bytes and in-process hand-off), attention on the
//! rank's heads, and back. Every file of `conformance/dilated` and `conformance/features`
//! at Ulysses P = 2, 3, 4 and the hybrid (U, P) = (2, 4), both layouts (refused with the
//! typed error where the degree exceeds the heads); uneven head splits and key/value heads
//! read by several slots against the float64 reference, the LSE's gradient included; the
//! bytes each rank sends equal `expected_bytes`; a fault mid-exchange fails every rank.

use crate::common;
use crate::ulysses::{golden_dir_through, uneven_heads_case};

use std::marker::PhantomData;
use std::time::Duration;

use attn_core::error::TensorName;
use attn_core::{AttnShape, DType, DilatedConfig, Mixing, Pass, Shape4, TensorView};
use attn_ring::chunk_ring::{ChunkOptions, CpuChunks, HostRows, HostTransport, chunk_backward, chunk_forward};
use attn_ring::{Communicator, FaultyComm, Layout, Plan, RingProblem, RingStats, Strategy, ThreadComm, expected_bytes};
use attn_testkit::{feature_case, judge_lse_gradients, random_vec};
use common::{ChunkBackend, Moves};
use proptest::prelude::*;

const TIMEOUT: Duration = Duration::from_secs(20);

/// The (world, strategy) runs: Ulysses at P = 2, 3, 4 and the hybrid (2, 4).
const RUNS: [(usize, Strategy); 4] =
    [(2, Strategy::Ulysses), (3, Strategy::Ulysses), (4, Strategy::Ulysses), (4, Strategy::Hybrid { ulysses: 2 })];

fn chunk(
    world: usize,
    layout: Layout,
    strategy: Strategy,
    moves: Moves,
) -> ChunkBackend<f32, impl Fn(usize) -> attn_core::Result<Vec<ThreadComm>>> {
    ChunkBackend {
        label: "chunk-heads",
        world,
        layout,
        strategy,
        join: |p| ThreadComm::world_with_timeout(p, TIMEOUT),
        moves,
        opts: ChunkOptions::default(),
        compute: CpuChunks::default(),
        dtype: PhantomData,
    }
}

#[test]
fn chunk_ring_heads_match_the_dilated_and_feature_files() {
    for (dir, counts) in [("dilated", DILATED_COUNTS), ("features", FEATURE_COUNTS)] {
        for moves in [Moves::HostStaged, Moves::InProcess] {
            let got = golden_dir_through(dir, &RUNS, |w, l, s| chunk(w, l, s, moves));
            assert_eq!(got, counts, "{dir} {moves:?}");
        }
    }
}

/// (passed, refused) runs of the sweep above, per transport.
const DILATED_COUNTS: (usize, usize) = (68, 4);
const FEATURE_COUNTS: (usize, usize) = (66, 6);

/// Heads that do not divide the degree and key/value heads read by several slots (8 over
/// 2 at U = 3: slot 1 reads both; 6 over 2 at U = 4; 5 over 1 at U = 4; 6 over 3 in the
/// hybrid (2, 4)), both mixings, causal or not, both transports, against the float64
/// reference.
#[test]
fn uneven_heads_and_shared_kv_heads_equal_the_reference() {
    let mut runs = 0;
    for (heads, kv_heads, world, strategy) in [
        (8, 2, 3, Strategy::Ulysses),
        (6, 2, 4, Strategy::Ulysses),
        (5, 1, 4, Strategy::Ulysses),
        (6, 3, 4, Strategy::Hybrid { ulysses: 2 }),
    ] {
        for (mixing, causal) in [(Mixing::HeadGroups, false), (Mixing::LongNet, true), (Mixing::HeadGroups, true)] {
            for (layout, moves) in [(Layout::Contiguous, Moves::HostStaged), (Layout::Zigzag, Moves::InProcess)] {
                let backend = chunk(world, layout, strategy, moves);
                let v = uneven_heads_case(&backend, (heads, kv_heads), mixing, causal);
                let at = format!("heads {heads}/{kv_heads} {strategy:?} p={world} {layout:?} {mixing:?} {moves:?}");
                assert!(v.is_ok(), "{at}: {}", v.unwrap_err());
                runs += 1;
            }
        }
    }
    assert_eq!(runs, 4 * 3 * 2);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(24), max_shrink_iters: 32, ..ProptestConfig::default() })]

    /// Random feature cases (grouped heads, padding, packing, windows, causal, both
    /// mixings) through every run the heads allow: the gradients with a gradient into the
    /// LSE within the f32 bound of the float64 reference.
    #[test]
    fn lse_gradients_through_chunk_ring_heads_match_the_reference(
        case in feature_case(1..=32, 24, vec![2, 4, 8]),
        run in 0usize..RUNS.len(),
        layout in prop::sample::select(vec![Layout::Contiguous, Layout::Zigzag]),
        moves in prop::sample::select(vec![Moves::HostStaged, Moves::InProcess]),
    ) {
        let (world, strategy) = RUNS[run];
        prop_assume!(layout.check(case.shape.q.seq, world).is_ok());
        prop_assume!(case.shape.q.heads >= strategy.ulysses_degree(world).unwrap());
        let v = judge_lse_gradients(&chunk(world, layout, strategy, moves), &case);
        prop_assert!(v.is_ok(), "{strategy:?} p={world}: {}", v.unwrap_err());
    }
}

/// Every rank's q (heads) and k, v (kv heads) pieces of `problem`.
fn pieces(problem: &RingProblem, qkv: [&[f32]; 3], [qs, ks]: [Shape4; 2]) -> Vec<[Vec<HostRows<f32>>; 3]> {
    let views = [
        TensorView::contiguous(TensorName::Query, qkv[0], qs).unwrap(),
        TensorView::contiguous(TensorName::Key, qkv[1], ks).unwrap(),
        TensorView::contiguous(TensorName::Value, qkv[2], ks).unwrap(),
    ];
    (0..problem.world)
        .map(|r| {
            views.each_ref().map(|view| {
                attn_ring::chunk_ring::rank_pieces(problem, r)
                    .into_iter()
                    .map(|range| HostRows::from_view_rows(view, range).unwrap())
                    .collect()
            })
        })
        .collect()
}

/// Every rank's (forward, backward) statistics (or error) over `comms`, host-staged.
fn run_all<C: Communicator + Send>(
    comms: Vec<C>,
    problem: &RingProblem,
    pieces: &[[Vec<HostRows<f32>>; 3]],
) -> Vec<attn_core::Result<(RingStats, RingStats)>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .zip(pieces)
            .map(|(mut comm, [q, k, v])| {
                s.spawn(move || {
                    let (x, opts) = (CpuChunks::default(), ChunkOptions::default());
                    let mut t = HostTransport::new(&mut comm);
                    let f = chunk_forward(&mut t, &x, problem, opts, [q, k, v])?;
                    let b = chunk_backward(&mut t, &x, problem, opts, [q, k, v], q, None)?;
                    Ok((f.stats, b.stats))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The data bytes each rank sends, forward and backward, equal `expected_bytes` (the host
/// path's formula), for Ulysses and the hybrid, even and uneven head splits, grouped
/// key/value heads, both layouts.
#[test]
fn measured_bytes_equal_the_formula() {
    let cfg = DilatedConfig::builder().segments(&[8, 16, 64]).dilations(&[1, 2, 4]).causal().build().unwrap();
    let mut checked = 0;
    for (heads, kv_heads) in [(4, 4), (6, 2), (5, 1)] {
        for (world, strategy) in RUNS {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                let (qs, ks) = (Shape4::new(2, 45, heads, 4).unwrap(), Shape4::new(2, 45, kv_heads, 4).unwrap());
                let shape = AttnShape { q: qs, kv: Shape4::named(TensorName::Key, ks.dims()).unwrap() };
                let (q, k, v) = (random_vec(1, qs.numel()), random_vec(2, ks.numel()), random_vec(3, ks.numel()));
                let problem = RingProblem::new(&cfg, shape, layout, strategy, world);
                let plan = Plan::new(problem.clone()).unwrap();
                let pieces = pieces(&problem, [&q, &k, &v], [qs, ks]);
                let stats: Vec<_> = run_all(ThreadComm::world_with_timeout(world, TIMEOUT).unwrap(), &problem, &pieces)
                    .into_iter()
                    .map(Result::unwrap)
                    .collect();
                let at = format!("{heads}/{kv_heads} p={world} {strategy:?} {layout:?}");
                let fwd: Vec<u64> = stats.iter().map(|s| s.0.data_bytes_sent).collect();
                assert_eq!(fwd, expected_bytes(&plan, DType::F32, Pass::Forward), "forward {at}");
                let bwd: Vec<u64> = stats.iter().map(|s| s.1.data_bytes_sent).collect();
                assert_eq!(bwd, expected_bytes(&plan, DType::F32, Pass::Backward), "backward {at}");
                assert!(fwd.iter().chain(&bwd).all(|&x| x > 0), "{at}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 3 * RUNS.len() * 2);
}

/// A fault of any kind on one rank mid-exchange (its third data frame: inside the
/// all-to-all or the ring over the groups) is an error on every rank, within the timeout.
#[test]
fn every_injected_fault_fails_every_rank() {
    let cfg = DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).causal().build().unwrap();
    let (qs, world) = (Shape4::new(1, 16, 4, 4).unwrap(), 4);
    let problem = RingProblem::new(&cfg, qs.into(), Layout::Zigzag, Strategy::Hybrid { ulysses: 2 }, world);
    let x = random_vec(7, qs.numel());
    let pieces = pieces(&problem, [&x, &x, &x], [qs, qs]);
    for fault in common::faults_at(3, Duration::from_millis(1500)) {
        let comms: Vec<_> = ThreadComm::world_with_timeout(world, Duration::from_millis(800))
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(r, c)| FaultyComm::new(c, if r == 1 { vec![fault] } else { vec![] }))
            .collect();
        let res = run_all(comms, &problem, &pieces);
        assert!(res.iter().all(|r| r.is_err()), "{fault:?}: {res:?}");
    }
}
