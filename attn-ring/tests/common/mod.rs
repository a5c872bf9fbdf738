//! Test helpers: the ring as a golden-file backend (in-process, or over any
//! communicator), the golden sweep over worlds x layouts x strategies, the list of
//! injected faults, f32 views.
#![allow(dead_code)]

use std::ops::RangeInclusive;
use std::time::Duration;

use attn_core::error::TensorName;
use attn_core::{AttnShape, DilatedConfig, Result, TensorView};
use attn_ring::chunk_ring::{
    ChunkCompute, ChunkOptions, ChunkTransport, CpuChunks, HostRowStats, HostRows, HostTransport, InProcessTransport,
    chunk_backward, chunk_forward, place_piece, rank_pieces,
};
use attn_ring::comm::DEFAULT_TIMEOUT;
use attn_ring::{
    Communicator, Fault, Layout, RingProblem, Strategy, ThreadComm, run_problem_backward_on, run_problem_on,
};
use attn_testkit::golden::{
    DilatedBackend, Forward32, GoldenCase, Gradients32, Problem, check_case, golden_dir, load_dir,
};

/// The ring over `world` in-process ranks, seen as one device.
#[derive(Debug, Clone, Copy)]
pub struct RingBackend {
    pub world: usize,
    pub layout: Layout,
    pub strategy: Strategy,
}

pub fn views<'a>(shape: AttnShape, q: &'a [f32], k: &'a [f32], v: &'a [f32]) -> Result<[TensorView<'a, f32>; 3]> {
    Ok([
        TensorView::contiguous(TensorName::Query, q, shape.q)?,
        TensorView::contiguous(TensorName::Key, k, shape.kv)?,
        TensorView::contiguous(TensorName::Value, v, shape.kv)?,
    ])
}

/// The ring problem of a test problem on `world` ranks.
fn ring_problem(p: &Problem<'_>, world: usize, layout: Layout, strategy: Strategy) -> RingProblem {
    RingProblem::new(p.cfg, p.shape, layout, strategy, world).with_masks(p.masks.into())
}

/// The problem's global views.
fn problem_views<'a>(p: &Problem<'_>, [q, k, v]: [&'a [f32]; 3]) -> Result<[TensorView<'a, f32>; 3]> {
    views(p.shape, q, k, v)
}

impl DilatedBackend for RingBackend {
    fn name(&self) -> String {
        format!("ring(p={}, {}, {})", self.world, self.layout.as_str(), self.strategy.as_str())
    }

    fn forward(&self, p: &Problem<'_>, qkv: [&[f32]; 3]) -> Result<Forward32> {
        let comms = ThreadComm::world_with_timeout(self.world, DEFAULT_TIMEOUT)?;
        let r =
            run_problem_on(comms, &ring_problem(p, self.world, self.layout, self.strategy), problem_views(p, qkv)?)?;
        Ok(Forward32 { out: r.out, lse: r.lse })
    }

    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<Gradients32> {
        let go = TensorView::contiguous(TensorName::GradOutput, grad_out, p.shape.q)?;
        let comms = ThreadComm::world_with_timeout(self.world, DEFAULT_TIMEOUT)?;
        let problem = ring_problem(p, self.world, self.layout, self.strategy);
        let r = run_problem_backward_on(comms, &problem, problem_views(p, qkv)?, go)?;
        Ok(Gradients32 { dq: r.dq, dk: r.dk, dv: r.dv })
    }

    fn backward_lse(&self, p: &Problem<'_>, qkv: [&[f32]; 3], go: &[f32], grad_lse: &[f32]) -> Result<Gradients32> {
        let problem = ring_problem(p, self.world, self.layout, self.strategy);
        let (sq, skv, world) = (p.shape.q, p.shape.kv, self.world);
        let comms = ThreadComm::world_with_timeout(world, DEFAULT_TIMEOUT)?;
        let ranks: Vec<Result<[Vec<f32>; 3]>> = std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut comm| {
                    let problem = &problem;
                    scope.spawn(move || rank_backward_lse(&mut comm, problem, [qkv[0], qkv[1], qkv[2], go], grad_lse))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        });
        let mut g = Gradients32 { dq: vec![0.0; sq.numel()], dk: vec![0.0; skv.numel()], dv: vec![0.0; skv.numel()] };
        for (rank, r) in ranks.into_iter().enumerate() {
            let [dq, dk, dv] = r?;
            let pos = self.layout.positions(sq.seq, world, rank);
            for (dst, src, s) in [(&mut g.dq, dq, sq), (&mut g.dk, dk, skv), (&mut g.dv, dv, skv)] {
                let row = s.heads * s.head_dim;
                for b in 0..s.batch {
                    for (i, &x) in pos.iter().enumerate() {
                        let from = (b * pos.len() + i) * row;
                        dst[(b * s.seq + x) * row..][..row].copy_from_slice(&src[from..from + row]);
                    }
                }
            }
        }
        Ok(g)
    }
}

/// One rank's gradients with a gradient into the LSE (`ring_backward_with` on its rows of
/// the global q, k, v, grad_out and `grad_lse`).
fn rank_backward_lse(
    comm: &mut ThreadComm,
    problem: &RingProblem,
    global: [&[f32]; 4],
    grad_lse: &[f32],
) -> Result<[Vec<f32>; 3]> {
    use attn_core::TensorViewMut;
    use attn_ring::{BackwardOutputs, RingOptions, local_rows, ring_backward_with};
    let (sq, skv) = (
        attn_core::Shape4::new(problem.batch, problem.seq, problem.heads, problem.head_dim)?,
        attn_core::Shape4::named(TensorName::Key, [problem.batch, problem.seq, problem.kv_heads, problem.head_dim])?,
    );
    let pos = problem.layout.positions(problem.seq, problem.world, comm.rank());
    let rows = |x: &[f32], s| local_rows(&TensorView::contiguous(TensorName::Other("global"), x, s)?, &pos);
    let [q, k, v, go] = [(0, sq), (1, skv), (2, skv), (3, sq)].map(|(i, s)| rows(global[i], s));
    let (ls, lkv) = (sq.with_seq(pos.len())?, skv.with_seq(pos.len())?);
    let h = sq.heads;
    let gl: Vec<f32> = (0..sq.batch)
        .flat_map(|b| pos.iter().flat_map(move |&x| grad_lse[(b * sq.seq + x) * h..][..h].iter().copied()))
        .collect();
    let (q, k, v, go) = (q?, k?, v?, go?);
    let view = |x, s| TensorView::contiguous(TensorName::Other("local"), x, s);
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; ls.numel()], vec![0.0f32; lkv.numel()], vec![0.0f32; lkv.numel()]);
    let mut dqv = TensorViewMut::contiguous(TensorName::GradQuery, &mut dq, ls)?;
    let mut dkv = TensorViewMut::contiguous(TensorName::GradKey, &mut dk, lkv)?;
    let mut dvv = TensorViewMut::contiguous(TensorName::GradValue, &mut dv, lkv)?;
    let outs = BackwardOutputs { dq: &mut dqv, dk: &mut dkv, dv: &mut dvv };
    let qkv = [view(&q, ls)?, view(&k, lkv)?, view(&v, lkv)?];
    ring_backward_with(comm, problem, &RingOptions::default(), qkv, view(&go, ls)?, Some(&gl), outs)?;
    Ok([dq, dk, dv])
}

/// The ring over `world` ranks whose communicators `join(world)` makes (a fresh set per
/// call), seen as one device.
pub struct CommBackend<F> {
    pub label: &'static str,
    pub world: usize,
    pub layout: Layout,
    pub strategy: Strategy,
    pub join: F,
}

impl<C: Communicator + Send, F: Fn(usize) -> Result<Vec<C>>> DilatedBackend for CommBackend<F> {
    fn name(&self) -> String {
        format!("{} ring(p={}, {}, {})", self.label, self.world, self.layout.as_str(), self.strategy.as_str())
    }

    fn forward(&self, p: &Problem<'_>, qkv: [&[f32]; 3]) -> Result<Forward32> {
        let views = problem_views(p, qkv)?;
        let comms = (self.join)(self.world)?;
        let r = run_problem_on(comms, &ring_problem(p, self.world, self.layout, self.strategy), views)?;
        Ok(Forward32 { out: r.out, lse: r.lse })
    }

    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<Gradients32> {
        let go = TensorView::contiguous(TensorName::GradOutput, grad_out, p.shape.q)?;
        let views = problem_views(p, qkv)?;
        let comms = (self.join)(self.world)?;
        let r = run_problem_backward_on(comms, &ring_problem(p, self.world, self.layout, self.strategy), views, go)?;
        Ok(Gradients32 { dq: r.dq, dk: r.dk, dv: r.dv })
    }
}

/// One run of a golden sweep.
pub struct SweepRun {
    pub cfg: DilatedConfig,
    pub shape: AttnShape,
    pub world: usize,
    pub layout: Layout,
    pub strategy: Strategy,
    /// The run's ring problem, masks included.
    pub problem: RingProblem,
}

/// Every golden file in `conformance/<dir>` (at least 9) through
/// `backend(world, layout, strategy)` for every world in `worlds` and layout the
/// sequence allows, and every strategy, forward and gradients. Panics listing every
/// failed run; returns the runs.
pub fn golden_sweep<B: DilatedBackend>(
    dir: &str,
    worlds: RangeInclusive<usize>,
    backend: impl Fn(usize, Layout, Strategy) -> B,
) -> Vec<SweepRun> {
    let dir = golden_dir().join(dir);
    let cases = load_dir(&dir).expect("golden dir");
    assert!(cases.len() >= 9, "expected the golden files in {}", dir.display());
    let cases = cases.into_iter().map(|(path, case)| case.unwrap_or_else(|e| panic!("{}: {e}", path.display())));
    golden_sweep_cases(cases.collect(), worlds, backend)
}

/// [`golden_sweep`] over the given cases.
pub fn golden_sweep_cases<B: DilatedBackend>(
    cases: Vec<GoldenCase>,
    worlds: RangeInclusive<usize>,
    backend: impl Fn(usize, Layout, Strategy) -> B,
) -> Vec<SweepRun> {
    let (mut runs, mut failures) = (Vec::new(), Vec::new());
    for case in cases {
        let (shape, cfg) = (case.attn_shape().unwrap(), case.config().unwrap());
        for world in worlds.clone() {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                if layout.check(shape.q.seq, world).is_err() {
                    continue;
                }
                for strategy in [Strategy::Auto, Strategy::Ring, Strategy::AllGather] {
                    let report = check_case(&case, Some(&backend(world, layout, strategy)), None);
                    if !report.passed() {
                        failures.push(report.to_string());
                    }
                    let masks = case.masks();
                    let problem = RingProblem::new(&cfg, shape, layout, strategy, world).with_masks(masks.into());
                    runs.push(SweepRun { cfg: cfg.clone(), shape, world, layout, strategy, problem });
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} runs failed:\n{}", failures.len(), runs.len(), failures.join("\n"));
    runs
}

/// Every kind of injected fault at frame `nth` of the faulty rank (a delay of `delay`).
pub fn faults_at(nth: u64, delay: Duration) -> [Fault; 7] {
    [
        Fault::Drop { nth },
        Fault::Duplicate { nth },
        Fault::Reorder { nth },
        Fault::Truncate { nth },
        Fault::Corrupt { nth },
        Fault::Kill { nth },
        Fault::Delay { nth, delay },
    ]
}

/// The chunk ring on the CPU compute over `world` ranks whose communicators `join(world)`
/// makes, in dtype `T`, seen as one device.
pub struct ChunkBackend<T, F, X = CpuChunks> {
    pub label: &'static str,
    pub world: usize,
    pub layout: Layout,
    /// How the chunk ring moves k/v: along the ring, straight, or as `Auto` chooses.
    pub strategy: Strategy,
    pub join: F,
    pub moves: Moves,
    /// How many rounds the k/v rows travel in.
    pub opts: ChunkOptions,
    pub compute: X,
    pub dtype: std::marker::PhantomData<T>,
}

/// How the chunk-ring test backend moves pieces between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moves {
    /// `HostTransport`: bytes over the communicators.
    HostStaged,
    /// `InProcessTransport`: buffers handed to the next rank's thread.
    InProcess,
}

/// Per-row values a chunk-ring compute returns as the lse, as `[batch, rows, heads]`.
pub trait LseRows {
    fn to_bsh(&self) -> Vec<f32>;
}

impl LseRows for HostRowStats {
    fn to_bsh(&self) -> Vec<f32> {
        HostRowStats::to_bsh(self)
    }
}

/// A rank's end of the ring: its communicator (host-staged) or its in-process transport.
enum RankEnd<C, R, A> {
    Comm(C),
    InProcess(InProcessTransport<C, R, A>),
}

/// A rank's work on its transport.
type RankWork<'w, T, X, C, const N: usize> = dyn Fn(&mut dyn ChunkTransport<T, X, Control = C>, &RingProblem, Vec<Vec<HostRows<T>>>) -> Result<[Vec<HostRows<T>>; N]>
    + Sync
    + 'w;

impl<T: attn_core::Element, C: Communicator + Send, F: Fn(usize) -> Result<Vec<C>>, X> ChunkBackend<T, F, X>
where
    X: ChunkCompute<T, Rows = HostRows<T>> + Sync,
    X::Acc: Send,
    X::RowStats: LseRows,
{
    fn problem(&self, p: &Problem<'_>) -> RingProblem {
        ring_problem(p, self.world, self.layout, self.strategy)
    }

    /// Run `rank_work(comm, pieces of q, k, v, grad_out)` on every rank; each returns its
    /// per-piece results, which are put back at their global rows.
    fn run<const N: usize>(
        &self,
        p: &Problem<'_>,
        inputs: &[(&[f32], attn_core::Shape4)],
        heads_of: [usize; N],
        rank_work: &RankWork<'_, T, X, C, N>,
    ) -> Result<[Vec<f32>; N]> {
        let problem = self.problem(p);
        let comms = (self.join)(self.world)?;
        let ends: Vec<RankEnd<C, HostRows<T>, X::Acc>> = match self.moves {
            Moves::HostStaged => comms.into_iter().map(RankEnd::Comm).collect(),
            Moves::InProcess => InProcessTransport::world(comms)?.into_iter().map(RankEnd::InProcess).collect(),
        };
        let conv: Vec<(Vec<T>, attn_core::Shape4)> =
            inputs.iter().map(|(x, s)| (x.iter().map(|&v| T::from_f32(v)).collect(), *s)).collect();
        let results: Vec<Result<[Vec<HostRows<T>>; N]>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ends
                .into_iter()
                .enumerate()
                .map(|(rank, end)| {
                    let (problem, conv) = (&problem, &conv);
                    scope.spawn(move || {
                        let pieces = conv
                            .iter()
                            .map(|(x, s)| {
                                let view = TensorView::contiguous(TensorName::Query, x, *s)?;
                                rank_pieces(problem, rank)
                                    .into_iter()
                                    .map(|r| HostRows::from_view_rows(&view, r))
                                    .collect::<Result<Vec<_>>>()
                            })
                            .collect::<Result<Vec<_>>>()?;
                        match end {
                            RankEnd::Comm(mut comm) => rank_work(&mut HostTransport::new(&mut comm), problem, pieces),
                            RankEnd::InProcess(mut t) => rank_work(&mut t, problem, pieces),
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        });
        let (b, seq, d) = (p.shape.q.batch, p.shape.q.seq, p.shape.q.head_dim);
        let mut outs: [Vec<f32>; N] = std::array::from_fn(|i| vec![0.0; b * seq * heads_of[i] * d.max(1)]);
        for (rank, res) in results.into_iter().enumerate() {
            let res = res?;
            for (i, pieces) in res.iter().enumerate() {
                for (piece, range) in pieces.iter().zip(rank_pieces(&problem, rank)) {
                    let values: Vec<f32> = piece.data.iter().map(|x| x.to_f32()).collect();
                    place_piece(&mut outs[i], seq, &range, piece.shape.heads * piece.shape.head_dim, &values)?;
                }
            }
        }
        Ok(outs)
    }
}

impl<T: attn_core::Element, C: Communicator + Send, F: Fn(usize) -> Result<Vec<C>>, X> DilatedBackend
    for ChunkBackend<T, F, X>
where
    X: ChunkCompute<T, Rows = HostRows<T>> + Sync,
    X::Acc: Send,
    X::RowStats: LseRows,
{
    fn name(&self) -> String {
        let (p, layout, dt) = (self.world, self.layout.as_str(), T::DTYPE.as_str());
        let rounds = self.opts.rounds();
        format!("{} chunk ring(p={p}, {layout}, {dt}, {:?}, rounds {rounds})", self.label, self.moves)
    }

    fn dtype(&self) -> attn_core::DType {
        T::DTYPE
    }

    fn forward(&self, p: &Problem<'_>, [q, k, v]: [&[f32]; 3]) -> Result<Forward32> {
        let (sq, skv) = (p.shape.q, p.shape.kv);
        let lse = std::sync::Mutex::new(vec![0.0f32; sq.lse_len()]);
        let (compute, opts) = (&self.compute, self.opts);
        let [out] = self.run(p, &[(q, sq), (k, skv), (v, skv)], [sq.heads], &|t, problem, pieces| {
            let rank = t.control().rank();
            let r = chunk_forward(t, compute, problem, opts, [&pieces[0], &pieces[1], &pieces[2]])?;
            let mut all = lse.lock().expect("lse");
            for (stats, range) in r.lse.iter().zip(rank_pieces(problem, rank)) {
                place_piece(&mut all, sq.seq, &range, sq.heads, &stats.to_bsh())?;
            }
            Ok([r.out])
        })?;
        Ok(Forward32 { out, lse: lse.into_inner().expect("lse") })
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

impl<T: attn_core::Element, C: Communicator + Send, F: Fn(usize) -> Result<Vec<C>>, X> ChunkBackend<T, F, X>
where
    X: ChunkCompute<T, Rows = HostRows<T>> + Sync,
    X::Acc: Send,
    X::RowStats: LseRows,
{
    /// The gradients with `grad_lse` (`[batch, seq, heads]`, f32) handed to each rank as its
    /// query pieces' rows.
    fn backward_with(
        &self,
        p: &Problem<'_>,
        [q, k, v]: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: Option<&[f32]>,
    ) -> Result<Gradients32> {
        let (sq, skv) = (p.shape.q, p.shape.kv);
        check_grad_lse_len(grad_lse, sq)?;
        let inputs = [(q, sq), (k, skv), (v, skv), (grad_out, sq)];
        let (compute, opts) = (&self.compute, self.opts);
        let [dq, dk, dv] = self.run(p, &inputs, [sq.heads, skv.heads, skv.heads], &|t, problem, pieces| {
            let rank = t.control().rank();
            let lse_pieces = grad_lse.map(|g| rank_lse_pieces::<T, X>(compute, problem, rank, g, sq)).transpose()?;
            let qkv = [&pieces[0][..], &pieces[1][..], &pieces[2][..]];
            let g = chunk_backward(t, compute, problem, opts, qkv, &pieces[3], lse_pieces.as_deref())?;
            Ok([g.dq, g.dk, g.dv])
        })?;
        Ok(Gradients32 { dq, dk, dv })
    }
}

/// A typed error where `grad_lse` is not one value a row and head of `q`.
pub fn check_grad_lse_len(grad_lse: Option<&[f32]>, q: attn_core::Shape4) -> Result<()> {
    match grad_lse.filter(|g| g.len() != q.lse_len()) {
        None => Ok(()),
        Some(g) => Err(attn_core::AttnError::ShapeMismatch {
            tensor: TensorName::GradLse,
            expected: vec![q.batch, q.seq, q.heads],
            got: vec![g.len()],
        }),
    }
}

/// Rank `rank`'s pieces of per-row values laid out `[batch, seq, heads]` as `q`'s (a
/// gradient into the LSE), one per query piece, in `compute`'s memory.
pub fn rank_lse_pieces<T: attn_core::Element, X: ChunkCompute<T>>(
    compute: &X,
    problem: &RingProblem,
    rank: usize,
    values: &[f32],
    q: attn_core::Shape4,
) -> Result<Vec<X::RowStats>> {
    let piece = |rows: std::ops::Range<usize>| {
        let at = |b| rows.clone().flat_map(move |i| (0..q.heads).map(move |h| (b * q.seq + i) * q.heads + h));
        let piece_values: Vec<f32> = (0..q.batch).flat_map(at).map(|i| values[i]).collect();
        compute.stats_from_bsh(attn_core::Shape4 { seq: rows.len(), head_dim: 1, ..q }, &piece_values)
    };
    rank_pieces(problem, rank).into_iter().map(piece).collect()
}

/// Every file of `conformance/<dir>` (`count` of them) through `backend(world, layout)` for
/// every world in `worlds` and layout the sequence allows; panics listing every failed
/// run; returns the number of runs.
pub fn chunk_sweep<B: DilatedBackend>(
    dir: &str,
    count: usize,
    worlds: &[usize],
    backend: impl Fn(usize, Layout) -> B,
) -> usize {
    let setups: Vec<(usize, Layout)> = worlds.iter().flat_map(|&w| both_layouts(w)).collect();
    chunk_sweep_setups(dir, count, &setups, backend)
}

/// Both layouts at `world`.
pub fn both_layouts(world: usize) -> [(usize, Layout); 2] {
    [(world, Layout::Contiguous), (world, Layout::Zigzag)]
}

/// [`chunk_sweep`] over the given `(world, layout)` setups only (a sampled sweep).
pub fn chunk_sweep_setups<B: DilatedBackend>(
    dir: &str,
    count: usize,
    setups: &[(usize, Layout)],
    backend: impl Fn(usize, Layout) -> B,
) -> usize {
    let dir = golden_dir().join(dir);
    let cases = load_dir(&dir).expect("golden dir");
    assert_eq!(cases.len(), count, "the golden files in {}", dir.display());
    let (mut runs, mut failures) = (0, Vec::new());
    for (path, case) in cases {
        let case = case.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let seq = case.attn_shape().unwrap().q.seq;
        for &(world, layout) in setups {
            if layout.check(seq, world).is_err() {
                continue;
            }
            let report = check_case(&case, Some(&backend(world, layout)), None);
            if !report.passed() {
                failures.push(report.to_string());
            }
            runs += 1;
        }
    }
    assert!(failures.is_empty(), "{} of {runs} runs failed:\n{}", failures.len(), failures.join("\n"));
    runs
}
