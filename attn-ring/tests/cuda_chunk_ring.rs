//! The chunk ring with its blocks on the GPU ([`CudaChunks`]): ranks are threads sharing
//! one device, k/v slices handed on device to device (each rank on a stream of its own)
//! in three rounds, or staged through the host over [`ThreadComm`] in one; every golden file of
//! `conformance/dilated` and `conformance/features` at world sizes 1, 2, 4 and 8, both
//! layouts, f32/bf16/f16, forward and gradients. Skips, printing the reason, without a
//! driver, NVRTC or GPU (fails instead with `ATTN_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod common;

use common::{Moves, check_grad_lse_len, rank_lse_pieces};

use std::marker::PhantomData;
use std::time::Duration;

use attn_core::error::TensorName;
use attn_core::{AttnError, DType, Result, Shape4, TensorView};
use attn_kernels::cuda::{CudaDevice, CudaElement, DeviceTensor};
use attn_ring::chunk_ring::{
    ChunkOptions, ChunkTransport, CudaChunks, DeviceRowStats, HostTransport, InProcessTransport, Metered,
    chunk_backward, chunk_forward, place_piece, rank_pieces,
};
use attn_ring::{Layout, Plan, RingProblem, Strategy, ThreadComm};
use attn_testkit::golden::{DilatedBackend, Forward32, Gradients32, Problem, check_case, golden_dir, load_dir};
use attn_testkit::gpu_or_skip;
use half::{bf16, f16};

const TIMEOUT: Duration = Duration::from_secs(60);

fn device_or_skip(test: &str) -> Option<CudaDevice> {
    gpu_or_skip(test, CudaDevice::new(0))
}

struct CudaChunkBackend<T> {
    dev: CudaDevice,
    world: usize,
    layout: Layout,
    strategy: Strategy,
    moves: Moves,
    opts: ChunkOptions,
    dtype: PhantomData<T>,
}

/// A rank's compute and end of the ring: the shared stream and host staging, or a stream
/// of its own and its buffers handed on in process.
enum RankEnd<T: CudaElement> {
    Staged(CudaChunks, ThreadComm),
    Device(CudaChunks, InProcessTransport<ThreadComm, Metered<DeviceTensor<T>>, Metered<DeviceRowStats>>),
}

/// Rank `rank`'s pieces of a global f32 tensor of shape `s`, uploaded in `T` and counted in
/// its compute's meter.
fn rank_uploads<T: CudaElement>(
    x: &CudaChunks,
    problem: &RingProblem,
    rank: usize,
    data: &[f32],
    s: Shape4,
) -> Result<Vec<Metered<DeviceTensor<T>>>> {
    let conv: Vec<T> = data.iter().map(|&v| T::from_f32(v)).collect();
    let view = TensorView::contiguous(TensorName::Query, &conv, s)?;
    rank_pieces(problem, rank)
        .into_iter()
        .map(|range| {
            let rows = attn_ring::chunk_ring::HostRows::from_view_rows(&view, range)?;
            let t =
                DeviceTensor::from_view(&x.dev, &TensorView::contiguous(TensorName::Query, &rows.data, rows.shape)?)?;
            Ok(x.adopt(t))
        })
        .collect()
}

fn f32s<T: CudaElement>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

impl<T: CudaElement> CudaChunkBackend<T> {
    fn new(
        dev: CudaDevice,
        (world, layout, strategy): (usize, Layout, Strategy),
        moves: Moves,
        opts: ChunkOptions,
    ) -> Self {
        CudaChunkBackend { dev, world, layout, strategy, moves, opts, dtype: PhantomData }
    }

    fn problem(&self, p: &Problem<'_>) -> RingProblem {
        RingProblem::new(p.cfg, p.shape, self.layout, self.strategy, self.world).with_masks(p.masks.into())
    }

    /// Every rank's per-piece host results of `work(transport, compute, rank)`.
    fn ranks<R: Send>(&self, work: &RankWork<'_, T, R>) -> Result<Vec<R>> {
        let comms = ThreadComm::world_with_timeout(self.world, TIMEOUT)?;
        let ends: Vec<RankEnd<T>> = match self.moves {
            Moves::HostStaged => {
                comms.into_iter().map(|c| RankEnd::Staged(CudaChunks::new(self.dev.clone()), c)).collect()
            }
            Moves::InProcess => InProcessTransport::world(comms)?
                .into_iter()
                .map(|t| Ok(RankEnd::Device(CudaChunks::new(self.dev.with_own_stream()?), t)))
                .collect::<Result<_>>()?,
        };
        std::thread::scope(|s| {
            let hs: Vec<_> = ends
                .into_iter()
                .enumerate()
                .map(|(r, end)| {
                    s.spawn(move || match end {
                        RankEnd::Staged(x, mut c) => work(&mut HostTransport::new(&mut c), &x, r),
                        RankEnd::Device(x, mut t) => work(&mut t, &x, r),
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank thread")).collect::<Result<Vec<R>>>()
        })
    }
}

/// A rank's work on its transport and compute.
type RankWork<'w, T, R> =
    dyn Fn(&mut dyn ChunkTransport<T, CudaChunks, Control = ThreadComm>, &CudaChunks, usize) -> Result<R> + Sync + 'w;

impl<T: CudaElement> DilatedBackend for CudaChunkBackend<T> {
    fn name(&self) -> String {
        let (p, layout, dt, s) = (self.world, self.layout.as_str(), T::DTYPE.as_str(), self.strategy.label());
        format!("cuda chunk ring(p={p}, {layout}, {s}, {dt}, {:?}, rounds {})", self.moves, self.opts.rounds())
    }

    fn dtype(&self) -> DType {
        T::DTYPE
    }

    fn forward(&self, p: &Problem<'_>, [q, k, v]: [&[f32]; 3]) -> Result<Forward32> {
        let (problem, (sq, skv)) = (self.problem(p), (p.shape.q, p.shape.kv));
        let per_rank = self.ranks(&|t, x, r| {
            let up = |data: &[f32], shape| rank_uploads::<T>(x, &problem, r, data, shape);
            let (qp, kp, vp) = (up(q, sq)?, up(k, skv)?, up(v, skv)?);
            let f = chunk_forward(t, x, &problem, self.opts, [&qp, &kp, &vp])?;
            let out =
                f.out.iter().map(|o| o.to_host_contiguous(&x.dev).map(|h| f32s(&h))).collect::<Result<Vec<_>>>()?;
            let lse = f
                .lse
                .iter()
                .map(|l| x.dev.stream().clone_dtoh(&l.data).map_err(|e| AttnError::backend("cuda", e)))
                .collect::<Result<Vec<_>>>()?;
            x.dev.synchronize()?;
            Ok((out, lse))
        })?;
        let (mut out, mut lse) = (vec![0.0; sq.numel()], vec![0.0; sq.lse_len()]);
        for (r, (o, l)) in per_rank.into_iter().enumerate() {
            for ((o, l), range) in o.iter().zip(&l).zip(rank_pieces(&problem, r)) {
                place_piece(&mut out, sq.seq, &range, sq.heads * sq.head_dim, o)?;
                place_piece(&mut lse, sq.seq, &range, sq.heads, l)?;
            }
        }
        Ok(Forward32 { out, lse })
    }

    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<Gradients32> {
        self.backward_with(p, qkv, grad_out, None)
    }

    fn backward_lse(
        &self,
        p: &Problem<'_>,
        qkv: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: &[f32],
    ) -> Result<Gradients32> {
        self.backward_with(p, qkv, grad_out, Some(grad_lse))
    }
}

impl<T: CudaElement> CudaChunkBackend<T> {
    /// The gradients, with `grad_lse` (`[batch, seq, heads]`) uploaded as each rank's query
    /// pieces' rows where given.
    fn backward_with(
        &self,
        p: &Problem<'_>,
        [q, k, v]: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: Option<&[f32]>,
    ) -> Result<Gradients32> {
        let (problem, (sq, skv)) = (self.problem(p), (p.shape.q, p.shape.kv));
        check_grad_lse_len(grad_lse, sq)?;
        let per_rank = self.ranks(&|t, x, r| {
            let up = |data: &[f32], shape| rank_uploads::<T>(x, &problem, r, data, shape);
            let (qp, kp, vp, gp) = (up(q, sq)?, up(k, skv)?, up(v, skv)?, up(grad_out, sq)?);
            let gl = grad_lse.map(|g| rank_lse_pieces::<T, CudaChunks>(x, &problem, r, g, sq)).transpose()?;
            let g = chunk_backward(t, x, &problem, self.opts, [&qp, &kp, &vp], &gp, gl.as_deref())?;
            let host = |ts: &[Metered<DeviceTensor<T>>]| {
                ts.iter().map(|t| t.to_host_contiguous(&x.dev).map(|h| f32s(&h))).collect::<Result<Vec<_>>>()
            };
            Ok([host(&g.dq)?, host(&g.dk)?, host(&g.dv)?])
        })?;
        let mut res = [vec![0.0; sq.numel()], vec![0.0; skv.numel()], vec![0.0; skv.numel()]];
        for (r, grads) in per_rank.into_iter().enumerate() {
            for (i, pieces) in grads.iter().enumerate() {
                let row = if i == 0 { sq.heads } else { skv.heads } * sq.head_dim;
                for (piece, range) in pieces.iter().zip(rank_pieces(&problem, r)) {
                    place_piece(&mut res[i], sq.seq, &range, row, piece)?;
                }
            }
        }
        let [dq, dk, dv] = res;
        Ok(Gradients32 { dq, dk, dv })
    }
}

fn run_all<T: CudaElement>(test: &str) {
    let Some(dev) = device_or_skip(test) else { return };
    // Device to device in three rounds (slices of every piece), host-staged in one.
    for (moves, rounds) in [(Moves::InProcess, 3), (Moves::HostStaged, 1)] {
        let opts = ChunkOptions::with_rounds(rounds).expect("rounds");
        for dir in ["dilated", "features"] {
            let runs = common::chunk_sweep(dir, 9, &[1, 2, 4, 8], |world, layout| {
                CudaChunkBackend::<T>::new(dev.clone(), (world, layout, Strategy::Auto), moves, opts)
            });
            println!("{test}: {dir} {moves:?}: {runs} runs passed");
        }
    }
}

/// A gradient into the LSE on the GPU: rows that attend nothing (a NaN gradient on them)
/// and the wide-head cases, bf16 and f32, world sizes 1, 2 and 4 (zigzag), both moves.
#[test]
fn cuda_chunk_ring_lse_gradients() {
    let Some(dev) = device_or_skip("cuda_chunk_ring_lse_gradients") else { return };
    let cases =
        attn_testkit::wide_head_cases().into_iter().chain([("unattended rows", attn_testkit::unattended_rows_case())]);
    let mut runs = 0;
    for (name, case) in cases {
        for world in [1, 2, 4] {
            if Layout::Zigzag.check(case.shape.q.seq, world).is_err() {
                continue;
            }
            for (moves, rounds) in [(Moves::InProcess, 3), (Moves::HostStaged, 1)] {
                let opts = ChunkOptions::with_rounds(rounds).expect("rounds");
                let (layout, dev) = (Layout::Zigzag, dev.clone());
                let setup = (world, layout, Strategy::Auto);
                let bf = CudaChunkBackend::<bf16>::new(dev.clone(), setup, moves, opts);
                let f = CudaChunkBackend::<f32>::new(dev, setup, moves, opts);
                for verdict in
                    [attn_testkit::judge_lse_gradients(&bf, &case), attn_testkit::judge_lse_gradients(&f, &case)]
                {
                    if let Err(e) = verdict {
                        panic!("{name}, world {world}, {moves:?}: {e}");
                    }
                }
                runs += 1;
            }
        }
    }
    assert!(runs >= 6, "only {runs} runs fit the cases");
}

#[test]
fn cuda_chunk_ring_golden_f32() {
    run_all::<f32>("cuda_chunk_ring_golden_f32");
}

#[test]
fn cuda_chunk_ring_golden_bf16() {
    run_all::<bf16>("cuda_chunk_ring_golden_bf16");
}

#[test]
fn cuda_chunk_ring_golden_f16() {
    run_all::<f16>("cuda_chunk_ring_golden_f16");
}

/// Ulysses (P = 2) and the hybrid (2 of 4) with the CUDA blocks: each rank's slot of heads
/// handed to the kernels as a head window, buffers moved device to device; every file of
/// `conformance/dilated` and `conformance/features` (both layouts at P = 2, zigzag in the
/// hybrid), bf16, judged against the files' bounds; a file with fewer heads than the
/// degree is refused, and heads are exchanged on at least one file of each sweep.
#[test]
fn cuda_chunk_ring_head_strategies() {
    let Some(dev) = device_or_skip("cuda_chunk_ring_head_strategies") else { return };
    let sweeps = [
        (2, Strategy::Ulysses, &[Layout::Contiguous, Layout::Zigzag][..]),
        (4, Strategy::Hybrid { ulysses: 2 }, &[Layout::Zigzag][..]),
    ];
    for (world, strategy, layouts) in sweeps {
        for dir in ["dilated", "features"] {
            let (mut passed, mut refused, mut exchanged, mut failures) = (0, 0, 0, Vec::new());
            for (path, case) in load_dir(&golden_dir().join(dir)).expect("golden dir") {
                let case = case.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                let (cfg, shape) = (case.config().expect("config"), case.attn_shape().expect("shape"));
                for &layout in layouts.iter().filter(|l| l.check(shape.q.seq, world).is_ok()) {
                    let setup = (world, layout, strategy);
                    let backend =
                        CudaChunkBackend::<bf16>::new(dev.clone(), setup, Moves::InProcess, ChunkOptions::default());
                    let problem = backend.problem(&Problem::new(&cfg, shape).with_masks(case.masks()));
                    exchanged += usize::from(Plan::new(problem).is_ok_and(|plan| plan.head_split().is_some()));
                    let report = check_case(&case, Some(&backend), None);
                    match (report.passed(), report.refused) {
                        (true, _) => passed += 1,
                        (false, true) => refused += 1,
                        (false, false) => failures.push(report.to_string()),
                    }
                }
            }
            let what = format!("{dir} {strategy:?}: {passed} passed, {refused} refused, {exchanged} exchanged heads");
            assert!(failures.is_empty(), "{what}:\n{}", failures.join("\n"));
            assert!(passed > 0 && exchanged > 0, "{what}");
            println!("cuda_chunk_ring_head_strategies: {what}");
        }
    }
}
