//! The chunk ring (CPU compute) against every golden file of `conformance/dilated` and
//! `conformance/features`: whole pieces travelling over threads at world sizes 1..=8 in
//! f32, 2..=4 in bf16 and f16, the emulated NCCL transport at 2..=4; slices in 3 rounds
//! (both transports, 2..=5) and in more rounds than rows; the ring and all-gather
//! strategies in 2 rounds (both transports, 2..=5); every file of `conformance/blocks`
//! (block masks) at 1..=8 and in 2 rounds along the ring and straight (2..=5); a fault or
//! a disagreeing rank is a typed error on every rank.

use crate::common;

use std::marker::PhantomData;
use std::time::Duration;

use attn_core::error::TensorName;
use attn_core::{AttnError, DilatedConfig, Shape4, TensorView};
use attn_ring::chunk_ring::{
    ChunkBlock, ChunkCompute, ChunkGrads, ChunkOptions, ChunkTransport, ChunkUpstream, CpuChunks, HostAcc, HostPartial,
    HostRowStats, HostRows, HostTransport, InProcessTransport, Travel, TravelKind, chunk_backward, chunk_forward,
};
use attn_ring::comm::EmulatedNccl;
use attn_ring::{Communicator, FaultyComm, Layout, RingProblem, Strategy, ThreadComm};
use common::{ChunkBackend, Moves, chunk_sweep};
use half::{bf16, f16};

const TIMEOUT: Duration = Duration::from_secs(20);

fn threads<T>(world: usize, layout: Layout) -> ChunkBackend<T, impl Fn(usize) -> attn_core::Result<Vec<ThreadComm>>> {
    let join = |p| ThreadComm::world_with_timeout(p, TIMEOUT);
    let (moves, compute) = (Moves::HostStaged, CpuChunks::default());
    let opts = ChunkOptions::default();
    let strategy = Strategy::Auto;
    ChunkBackend { label: "threads", world, layout, strategy, join, moves, opts, compute, dtype: PhantomData }
}

#[test]
fn chunk_ring_matches_every_golden_file_f32() {
    for dir in ["dilated", "features"] {
        let runs = chunk_sweep(dir, 9, &[1, 2, 3, 4, 5, 6, 7, 8], threads::<f32>);
        assert_eq!(runs, 9 * 8 * 2, "{dir}");
    }
}

#[test]
fn chunk_ring_matches_every_golden_file_bf16_f16() {
    for dir in ["dilated", "features"] {
        assert_eq!(chunk_sweep(dir, 9, &[2, 3, 4], threads::<bf16>), 9 * 3 * 2, "{dir}");
        assert_eq!(chunk_sweep(dir, 9, &[2, 3, 4], threads::<f16>), 9 * 3 * 2, "{dir}");
    }
}

#[test]
fn chunk_ring_in_process_matches_every_golden_file() {
    for dir in ["dilated", "features"] {
        let runs = chunk_sweep(dir, 9, &[1, 2, 3, 4, 5, 6, 7, 8], |world, layout| ChunkBackend::<f32, _> {
            moves: Moves::InProcess,
            ..threads::<f32>(world, layout)
        });
        assert_eq!(runs, 9 * 8 * 2, "{dir}");
    }
}

/// Along the ring (both ways) and straight to each rank: the strategies the chunk ring
/// honours, over both transports, in 2 rounds.
#[test]
fn chunk_ring_every_strategy_matches_every_golden_file() {
    for dir in ["dilated", "features"] {
        for strategy in [Strategy::Ring, Strategy::AllGather] {
            for moves in [Moves::HostStaged, Moves::InProcess] {
                let runs = chunk_sweep(dir, 9, &[2, 3, 4, 5], |world, layout| ChunkBackend::<f32, _> {
                    strategy,
                    moves,
                    opts: ChunkOptions::with_rounds(2).unwrap(),
                    ..threads::<f32>(world, layout)
                });
                assert_eq!(runs, 9 * 4 * 2, "{dir} {strategy:?} {moves:?}");
            }
        }
    }
}

/// Block masks: every file of `conformance/blocks`, whole pieces at world sizes 1..=8,
/// and in 2 rounds along the ring and straight to each rank (in process, 2..=5).
#[test]
fn chunk_ring_matches_every_block_mask_file() {
    assert_eq!(chunk_sweep("blocks", 8, &[1, 2, 3, 4, 5, 6, 7, 8], threads::<f32>), 8 * 8 * 2);
    for strategy in [Strategy::Ring, Strategy::AllGather] {
        let runs = chunk_sweep("blocks", 8, &[2, 3, 4, 5], |world, layout| ChunkBackend::<f32, _> {
            strategy,
            moves: Moves::InProcess,
            opts: ChunkOptions::with_rounds(2).unwrap(),
            ..threads::<f32>(world, layout)
        });
        assert_eq!(runs, 8 * 4 * 2, "{strategy:?}");
    }
}

#[test]
fn chunk_ring_in_rounds_matches_every_golden_file() {
    let rounds = |n| ChunkOptions::with_rounds(n).unwrap();
    for dir in ["dilated", "features"] {
        for moves in [Moves::HostStaged, Moves::InProcess] {
            let runs = chunk_sweep(dir, 9, &[2, 3, 4, 5], |world, layout| ChunkBackend::<f32, _> {
                moves,
                opts: rounds(3),
                ..threads::<f32>(world, layout)
            });
            assert_eq!(runs, 9 * 4 * 2, "{dir} {moves:?}");
        }
        // More rounds than a piece has rows: some rounds carry nothing of some ranks.
        let runs = chunk_sweep(dir, 9, &[3], |world, layout| ChunkBackend::<f32, _> {
            opts: rounds(64),
            ..threads::<f32>(world, layout)
        });
        assert_eq!(runs, 9 * 2, "{dir}");
    }
}

#[test]
fn zero_rounds_is_an_error() {
    assert!(matches!(ChunkOptions::with_rounds(0), Err(AttnError::InvalidArgument(_))));
}

#[test]
fn ranks_disagreeing_on_rounds_fail_every_rank() {
    let (problem, pieces) = small_problem(3);
    let res: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = ThreadComm::world_with_timeout(3, TIMEOUT)
            .unwrap()
            .into_iter()
            .zip(&pieces)
            .enumerate()
            .map(|(r, (mut comm, [q, k, v]))| {
                let problem = &problem;
                s.spawn(move || {
                    let opts = ChunkOptions::with_rounds(if r == 2 { 2 } else { 1 }).unwrap();
                    let mut t = HostTransport::new(&mut comm);
                    chunk_forward(&mut t, &CpuChunks::default(), problem, opts, [q, k, v]).map(|_| ())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in &res {
        assert!(matches!(r, Err(AttnError::RankDisagreement(_))), "{res:?}");
    }
}

#[test]
fn chunk_ring_over_emulated_nccl_matches_every_golden_file() {
    for dir in ["dilated", "features"] {
        let runs = chunk_sweep(dir, 9, &[2, 3, 4], |world, layout| ChunkBackend::<f32, _> {
            label: "emulated-nccl",
            world,
            layout,
            strategy: Strategy::Auto,
            join: |p| EmulatedNccl::world_with_timeout(p, TIMEOUT),
            moves: Moves::HostStaged,
            opts: ChunkOptions::default(),
            compute: CpuChunks::default(),
            dtype: PhantomData,
        });
        assert_eq!(runs, 9 * 3 * 2, "{dir}");
    }
}

/// A small causal problem on `world` ranks and every rank's q/k/v pieces.
pub(crate) fn small_problem(world: usize) -> (RingProblem, Vec<[Vec<HostRows<f32>>; 3]>) {
    let cfg = DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).causal().build().unwrap();
    let shape = Shape4::new(1, 16, 2, 4).unwrap();
    let problem = RingProblem::new(&cfg, shape.into(), Layout::Zigzag, Strategy::Auto, world);
    let x: Vec<f32> = (0..shape.numel()).map(|i| (i as f32 * 0.37).sin()).collect();
    let view = TensorView::contiguous(TensorName::Query, &x, shape).unwrap();
    let pieces = (0..world)
        .map(|r| {
            let p = |view| {
                attn_ring::chunk_ring::rank_pieces(&problem, r)
                    .into_iter()
                    .map(|range| HostRows::from_view_rows(view, range).unwrap())
                    .collect::<Vec<_>>()
            };
            [p(&view), p(&view), p(&view)]
        })
        .collect();
    (problem, pieces)
}

/// Run the forward and backward on every rank with its communicator; the results per rank.
fn run_all<C: Communicator + Send>(
    comms: Vec<C>,
    problem: &RingProblem,
    pieces: &[[Vec<HostRows<f32>>; 3]],
) -> Vec<attn_core::Result<()>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .zip(pieces)
            .map(|(mut comm, [q, k, v])| {
                s.spawn(move || {
                    let mut t = HostTransport::new(&mut comm);
                    chunk_forward(&mut t, &CpuChunks::default(), problem, ChunkOptions::default(), [q, k, v])?;
                    chunk_backward(&mut t, &CpuChunks::default(), problem, ChunkOptions::default(), [q, k, v], q, None)
                        .map(|_| ())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn every_injected_fault_fails_every_rank() {
    let (problem, pieces) = small_problem(3);
    for fault in common::faults_at(3, Duration::from_millis(1500)) {
        let comms: Vec<_> = ThreadComm::world_with_timeout(3, Duration::from_millis(800))
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(r, c)| FaultyComm::new(c, if r == 1 { vec![fault] } else { vec![] }))
            .collect();
        let res = run_all(comms, &problem, &pieces);
        assert!(res.iter().all(|r| r.is_err()), "{fault:?}: {res:?}");
    }
}

#[test]
fn a_wrong_piece_on_one_rank_is_the_same_error_on_every_rank() {
    let (problem, mut pieces) = small_problem(3);
    pieces[2][1].pop();
    let res = run_all(ThreadComm::world_with_timeout(3, TIMEOUT).unwrap(), &problem, &pieces);
    for r in &res {
        match r {
            Err(AttnError::RankDisagreement(m)) => assert!(m.contains("k pieces have shapes [], expected"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn kernels_that_fail_to_load_on_one_rank_are_every_rank_s_error() {
    let (problem, pieces) = small_problem(3);
    let comms = ThreadComm::world_with_timeout(3, TIMEOUT).unwrap();
    let res: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .zip(&pieces)
            .enumerate()
            .map(|(rank, (mut comm, [q, k, v]))| {
                let problem = &problem;
                s.spawn(move || {
                    let mut t = HostTransport::new(&mut comm);
                    let opts = ChunkOptions::default();
                    match rank {
                        1 => chunk_forward(
                            &mut t,
                            &Planted(CpuChunks::default(), Plant::Masks),
                            problem,
                            opts,
                            [q, k, v],
                        )
                        .map(|_| ()),
                        _ => chunk_forward(&mut t, &CpuChunks::default(), problem, opts, [q, k, v]).map(|_| ()),
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in &res {
        match r {
            Err(AttnError::RankDisagreement(m)) => assert!(m.contains("no kernels"), "{m}"),
            other => panic!("every rank reports the failed load, got {other:?}"),
        }
    }
}

/// The CPU compute with one planted fault in blocks whose keys start at position 0 and
/// whose queries do not.
#[derive(Clone, Copy)]
enum Plant {
    /// The block is dropped (a wrong answer the golden check must catch).
    Drop,
    /// The block fails (an error every rank must report).
    Fail,
    /// A round's slice of k/v is copied from one row too far on (a wrong answer).
    SliceShift,
    /// Preparing the masks (and a device's kernels) fails.
    Masks,
}

struct Planted(CpuChunks, Plant);

impl ChunkCompute<f32> for Planted {
    type Rows = HostRows<f32>;
    type Partial = HostPartial;
    type Acc = HostAcc;
    type RowStats = HostRowStats;
    type Masks = <CpuChunks as ChunkCompute<f32>>::Masks;

    fn shape_of(&self, rows: &HostRows<f32>) -> Shape4 {
        rows.shape
    }
    fn masks(&self, problem: &RingProblem) -> attn_core::Result<Self::Masks> {
        match self.1 {
            Plant::Masks => Err(AttnError::BackendUnavailable { backend: "planted", reason: "no kernels".into() }),
            _ => ChunkCompute::<f32>::masks(&self.0, problem),
        }
    }
    fn empty_partial(&self, q: Shape4) -> attn_core::Result<HostPartial> {
        ChunkCompute::<f32>::empty_partial(&self.0, q)
    }
    fn zero_acc(&self, shape: Shape4) -> attn_core::Result<HostAcc> {
        ChunkCompute::<f32>::zero_acc(&self.0, shape)
    }
    fn forward_block(
        &self,
        b: &ChunkBlock<'_, HostRows<f32>, Self::Masks>,
        p: &mut HostPartial,
    ) -> attn_core::Result<()> {
        if b.k_start == 0 && b.q_start != 0 {
            return match self.1 {
                Plant::Drop => Ok(()),
                Plant::Fail => Err(AttnError::InvalidArgument("planted block failure".into())),
                Plant::SliceShift | Plant::Masks => self.0.forward_block(b, p),
            };
        }
        self.0.forward_block(b, p)
    }
    fn finish_forward(&self, pr: &RingProblem, p: &HostPartial) -> attn_core::Result<(HostRows<f32>, HostRowStats)> {
        self.0.finish_forward(pr, p)
    }
    fn delta(
        &self,
        g: &HostRows<f32>,
        o: &HostRows<f32>,
        l: Option<(&HostRowStats, &HostRowStats)>,
    ) -> attn_core::Result<HostRowStats> {
        self.0.delta(g, o, l)
    }
    fn stats_shape(&self, s: &HostRowStats) -> Option<Shape4> {
        ChunkCompute::<f32>::stats_shape(&self.0, s)
    }
    fn stats_from_bsh(&self, shape: Shape4, values: &[f32]) -> attn_core::Result<HostRowStats> {
        ChunkCompute::<f32>::stats_from_bsh(&self.0, shape, values)
    }
    fn backward_block(
        &self,
        b: &ChunkBlock<'_, HostRows<f32>, Self::Masks>,
        u: &ChunkUpstream<'_, HostRows<f32>, HostRowStats>,
        g: ChunkGrads<'_, HostAcc>,
    ) -> attn_core::Result<()> {
        self.0.backward_block(b, u, g)
    }
    fn store_acc(&self, a: &HostAcc) -> attn_core::Result<HostRows<f32>> {
        self.0.store_acc(a)
    }
    fn rows_to_bytes(&self, r: &HostRows<f32>, out: &mut Vec<u8>) -> attn_core::Result<()> {
        self.0.rows_to_bytes(r, out)
    }
    fn rows_from_bytes(&self, s: Shape4, b: &[u8]) -> attn_core::Result<HostRows<f32>> {
        self.0.rows_from_bytes(s, b)
    }
    fn acc_to_bytes(&self, a: &HostAcc, out: &mut Vec<u8>) -> attn_core::Result<()> {
        ChunkCompute::<f32>::acc_to_bytes(&self.0, a, out)
    }
    fn acc_from_bytes(&self, s: Shape4, b: &[u8]) -> attn_core::Result<HostAcc> {
        ChunkCompute::<f32>::acc_from_bytes(&self.0, s, b)
    }
    fn acc_bytes(&self, a: &HostAcc) -> usize {
        ChunkCompute::<f32>::acc_bytes(&self.0, a)
    }
    fn slice_rows(&self, r: &HostRows<f32>, rows: std::ops::Range<usize>) -> attn_core::Result<HostRows<f32>> {
        match self.1 {
            Plant::SliceShift if rows.end < r.shape.seq => r.slice_rows(rows.start + 1..rows.end + 1),
            _ => r.slice_rows(rows),
        }
    }
    fn zero_rows(&self, s: Shape4) -> attn_core::Result<HostRows<f32>> {
        ChunkCompute::<f32>::zero_rows(&self.0, s)
    }
    fn write_rows(&self, d: &mut HostRows<f32>, at: usize, r: &HostRows<f32>) -> attn_core::Result<()> {
        d.write_rows(at, r)
    }
    fn sync(&self) -> attn_core::Result<()> {
        ChunkCompute::<f32>::sync(&self.0)
    }
}

/// How many of the `conformance/dilated` files (of how many) fail on 2 ranks with `plant`.
fn planted_failures(layout: Layout, moves: Moves, opts: ChunkOptions, plant: Plant) -> (usize, usize) {
    let dir = attn_testkit::golden::golden_dir().join("dilated");
    let cases = attn_testkit::golden::load_dir(&dir).unwrap();
    let join = |p| ThreadComm::world_with_timeout(p, TIMEOUT);
    let compute = Planted(CpuChunks::default(), plant);
    let planted = ChunkBackend::<f32, _, _> {
        label: "planted",
        world: 2,
        layout,
        strategy: Strategy::Auto,
        join,
        moves,
        opts,
        compute,
        dtype: PhantomData,
    };
    let failed = cases
        .iter()
        .filter(|(_, c)| !attn_testkit::golden::check_case(c.as_ref().unwrap(), Some(&planted), None).passed())
        .count();
    (failed, cases.len())
}

#[test]
fn the_golden_check_catches_a_dropped_block() {
    let (failed, of) = planted_failures(Layout::Contiguous, Moves::HostStaged, ChunkOptions::default(), Plant::Drop);
    // Files whose segments all fit inside one rank's rows never cross ranks.
    assert!(failed >= 3, "only {failed} of {of} golden files failed with a dropped block");
}

#[test]
fn the_golden_check_catches_a_slice_off_by_one_row() {
    let opts = ChunkOptions::with_rounds(3).unwrap();
    let (failed, of) = planted_failures(Layout::Zigzag, Moves::InProcess, opts, Plant::SliceShift);
    assert!(failed >= 3, "only {failed} of {of} golden files failed with shifted slices");
}

#[test]
fn a_block_failing_on_some_ranks_fails_every_rank_on_both_transports() {
    let (problem, pieces) = small_problem(3);
    let x = Planted(CpuChunks::default(), Plant::Fail);
    let comms = || ThreadComm::world_with_timeout(3, Duration::from_secs(5)).unwrap();
    let run = |t: &mut dyn ChunkTransport<f32, Planted, Control = ThreadComm>, [q, k, v]: &[Vec<HostRows<f32>>; 3]| {
        chunk_forward(t, &x, &problem, ChunkOptions::default(), [q, k, v]).map(|_| ())
    };
    let host: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms()
            .into_iter()
            .zip(&pieces)
            .map(|(mut c, p)| s.spawn(move || run(&mut HostTransport::new(&mut c), p)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let in_process: Vec<_> = std::thread::scope(|s| {
        let ends = InProcessTransport::world(comms()).unwrap();
        let hs: Vec<_> = ends.into_iter().zip(&pieces).map(|(mut t, p)| s.spawn(move || run(&mut t, p))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (label, res) in [("host-staged", host), ("in-process", in_process)] {
        assert!(res.iter().all(|r| r.is_err()), "{label}: {res:?}");
        // A rank meets its failing block or a peer that has gone; the first to fail names the plant.
        let planted = |r: &&attn_core::Result<()>| matches!(r, Err(AttnError::InvalidArgument(m)) if m == "planted block failure");
        assert!(res.iter().any(|r| planted(&r)), "{label}: {res:?}");
    }
}

#[test]
fn a_transport_refuses_a_second_start_a_finish_without_one_and_a_hop_off_the_ring() {
    let (problem, _) = small_problem(1);
    let x = CpuChunks::default();
    let hop_travel = |hop| Travel::<HostRows<f32>, HostAcc> {
        kind: TravelKind::Kv,
        owner: 0,
        hop,
        step: 1,
        k: Vec::new(),
        v: Vec::new(),
        dk: Vec::new(),
        dv: Vec::new(),
        arriving: Vec::new(),
    };
    let travel = || hop_travel(1);
    let check = |t: &mut dyn ChunkTransport<f32, CpuChunks, Control = ThreadComm>| {
        let refused = |r: attn_core::Result<()>| matches!(r, Err(AttnError::Comm { .. }));
        assert!(refused(t.finish(&x, &problem).map(|_| ())), "a finish with nothing started");
        assert!(refused(t.start(&x, &problem, hop_travel(0))), "a hop of no rank");
        assert!(refused(t.start(&x, &problem, hop_travel(2))), "a hop past the ring");
        t.start(&x, &problem, travel()).unwrap();
        assert!(refused(t.start(&x, &problem, travel())), "a second start");
        let arrived = t.finish(&x, &problem).unwrap();
        assert!(arrived.k.is_empty() && arrived.dk.is_empty());
        assert!(refused(t.finish(&x, &problem).map(|_| ())), "a second finish");
    };
    let mut comm = ThreadComm::world_with_timeout(1, TIMEOUT).unwrap().pop().unwrap();
    check(&mut HostTransport::new(&mut comm));
    let mut ends = InProcessTransport::world(ThreadComm::world_with_timeout(1, TIMEOUT).unwrap()).unwrap();
    check(&mut ends[0]);
}
