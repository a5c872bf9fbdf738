//! The chunk ring over `NcclDeviceTransport` on the stand-in libraries: ranks on threads,
//! each on a stand-in device of its own, k/v slices and dk/dv sent by NCCL between device
//! buffers. The compute keeps rows and accumulators in (stand-in) device memory and runs
//! the CPU block kernels on host copies, so its results must equal, bit for bit, the same
//! ring with the CPU compute staged through the host.

use std::sync::Arc;
use std::time::Duration;

use attn_core::AttnShape;
use attn_core::error::TensorName;
use attn_core::{DilatedConfig, Element, Result, Shape4, TensorView};
use attn_kernels::cuda::CudaElement;
use attn_ring::chunk_ring::{
    ChunkBlock, ChunkCompute, ChunkGrads, ChunkOptions, ChunkTransport, ChunkUpstream, CpuChunks, DeviceBuffers,
    HeadSlot, HostAcc, HostPartial, HostRowStats, HostRows, HostTransport, NcclDeviceTransport, Travel, TravelKind,
    chunk_backward, chunk_forward, rank_pieces,
};
use attn_ring::{Layout, RingProblem, Strategy, ThreadComm};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;

pub(super) fn dev_err(e: cudarc::driver::DriverError) -> attn_core::AttnError {
    attn_core::AttnError::backend("stand-in", e)
}

/// Rows or f32 accumulators in device memory.
pub struct Dev<E> {
    pub(super) data: CudaSlice<E>,
    pub(super) shape: Shape4,
}

/// Device-resident buffers, CPU block kernels on host copies.
pub(super) struct StandInChunks {
    pub(super) stream: Arc<CudaStream>,
    pub(super) cpu: CpuChunks,
}

impl StandInChunks {
    pub(super) fn down<E: CudaElement>(&self, x: &CudaSlice<E>) -> Result<Vec<E>> {
        self.stream.clone_dtoh(x).map_err(dev_err)
    }
    pub(super) fn up<E: CudaElement>(&self, x: &[E]) -> Result<CudaSlice<E>> {
        self.stream.clone_htod(x).map_err(dev_err)
    }
    fn host<T: CudaElement>(&self, r: &Dev<T>) -> Result<HostRows<T>> {
        Ok(HostRows { shape: r.shape, data: self.down(&r.data)? })
    }
    fn dev<T: CudaElement>(&self, r: &HostRows<T>) -> Result<Dev<T>> {
        Ok(Dev { data: self.up(&r.data)?, shape: r.shape })
    }
    fn host_acc(&self, a: &Dev<f32>) -> Result<HostAcc> {
        let flat = self.down(&a.data)?;
        let n = a.shape.seq * a.shape.head_dim;
        Ok(HostAcc { shape: a.shape, data: flat.chunks(n.max(1)).map(<[f32]>::to_vec).collect() })
    }
    fn put_acc(&self, h: &HostAcc, a: &mut Dev<f32>) -> Result<()> {
        self.stream.memcpy_htod(&h.data.concat(), &mut a.data).map_err(dev_err)
    }
    /// `f` on the host copy of block `b`.
    fn on_host<T: CudaElement, R>(
        &self,
        b: &ChunkBlock<'_, Dev<T>, Masks<T>>,
        f: impl FnOnce(&ChunkBlock<'_, HostRows<T>, Masks<T>>) -> Result<R>,
    ) -> Result<R> {
        let (q, k, v) = (self.host(b.q)?, self.host(b.k)?, self.host(b.v)?);
        let (problem, masks, q_start, k_start) = (b.problem, b.masks, b.q_start, b.k_start);
        f(&ChunkBlock { problem, masks, q: &q, q_start, k: &k, v: &v, k_start, heads: HeadSlot::Every })
    }
}

type Masks<T> = <CpuChunks as ChunkCompute<T>>::Masks;

impl<T: CudaElement> ChunkCompute<T> for StandInChunks {
    type Rows = Dev<T>;
    type Partial = HostPartial;
    type Acc = Dev<f32>;
    type RowStats = HostRowStats;
    type Masks = Masks<T>;

    fn shape_of(&self, rows: &Dev<T>) -> Shape4 {
        rows.shape
    }
    fn masks(&self, problem: &RingProblem) -> Result<Self::Masks> {
        ChunkCompute::<T>::masks(&self.cpu, problem)
    }
    fn empty_partial(&self, q: Shape4) -> Result<HostPartial> {
        ChunkCompute::<T>::empty_partial(&self.cpu, q)
    }
    fn zero_acc(&self, shape: Shape4) -> Result<Dev<f32>> {
        Ok(Dev { data: self.stream.alloc_zeros(shape.numel()).map_err(dev_err)?, shape })
    }
    fn forward_block(&self, b: &ChunkBlock<'_, Dev<T>, Self::Masks>, p: &mut HostPartial) -> Result<()> {
        self.on_host(b, |hb| self.cpu.forward_block(hb, p))
    }
    fn finish_forward(&self, problem: &RingProblem, p: &HostPartial) -> Result<(Dev<T>, HostRowStats)> {
        let (out, lse) = ChunkCompute::<T>::finish_forward(&self.cpu, problem, p)?;
        Ok((self.dev(&out)?, lse))
    }
    fn delta(
        &self,
        grad_out: &Dev<T>,
        out: &Dev<T>,
        l: Option<(&HostRowStats, &HostRowStats)>,
    ) -> Result<HostRowStats> {
        self.cpu.delta(&self.host(grad_out)?, &self.host(out)?, l)
    }
    fn stats_shape(&self, stats: &HostRowStats) -> Option<Shape4> {
        ChunkCompute::<T>::stats_shape(&self.cpu, stats)
    }
    fn stats_from_bsh(&self, shape: Shape4, values: &[f32]) -> Result<HostRowStats> {
        ChunkCompute::<T>::stats_from_bsh(&self.cpu, shape, values)
    }
    fn backward_block(
        &self,
        b: &ChunkBlock<'_, Dev<T>, Self::Masks>,
        up: &ChunkUpstream<'_, Dev<T>, HostRowStats>,
        g: ChunkGrads<'_, Dev<f32>>,
    ) -> Result<()> {
        let go = self.host(up.grad_out)?;
        let hup = ChunkUpstream { grad_out: &go, lse: up.lse, delta: up.delta };
        let (mut dq, mut dk, mut dv) = (self.host_acc(g.dq)?, self.host_acc(g.dk)?, self.host_acc(g.dv)?);
        self.on_host(b, |hb| self.cpu.backward_block(hb, &hup, ChunkGrads { dq: &mut dq, dk: &mut dk, dv: &mut dv }))?;
        self.put_acc(&dq, g.dq)?;
        self.put_acc(&dk, g.dk)?;
        self.put_acc(&dv, g.dv)
    }
    fn store_acc(&self, acc: &Dev<f32>) -> Result<Dev<T>> {
        self.dev(&ChunkCompute::<T>::store_acc(&self.cpu, &self.host_acc(acc)?)?)
    }
    fn rows_to_bytes(&self, rows: &Dev<T>, out: &mut Vec<u8>) -> Result<()> {
        self.cpu.rows_to_bytes(&self.host(rows)?, out)
    }
    fn rows_from_bytes(&self, shape: Shape4, bytes: &[u8]) -> Result<Dev<T>> {
        self.dev(&self.cpu.rows_from_bytes(shape, bytes)?)
    }
    fn acc_to_bytes(&self, acc: &Dev<f32>, out: &mut Vec<u8>) -> Result<()> {
        ChunkCompute::<T>::acc_to_bytes(&self.cpu, &self.host_acc(acc)?, out)
    }
    fn acc_from_bytes(&self, shape: Shape4, bytes: &[u8]) -> Result<Dev<f32>> {
        let h = ChunkCompute::<T>::acc_from_bytes(&self.cpu, shape, bytes)?;
        Ok(Dev { data: self.up(&h.data.concat())?, shape })
    }
    fn acc_bytes(&self, acc: &Dev<f32>) -> usize {
        acc.data.len() * 4
    }
    fn slice_rows(&self, src: &Dev<T>, rows: std::ops::Range<usize>) -> Result<Dev<T>> {
        self.dev(&self.host(src)?.slice_rows(rows)?)
    }
    fn zero_rows(&self, shape: Shape4) -> Result<Dev<T>> {
        Ok(Dev { data: self.stream.alloc_zeros(shape.numel()).map_err(dev_err)?, shape })
    }
    fn write_rows(&self, dst: &mut Dev<T>, at: usize, src: &Dev<T>) -> Result<()> {
        let mut h = self.host(dst)?;
        h.write_rows(at, &self.host(src)?)?;
        self.stream.memcpy_htod(&h.data, &mut dst.data).map_err(dev_err)
    }
    fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(dev_err)
    }
}

impl<T: CudaElement> DeviceBuffers<T> for StandInChunks {
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn rows_buffer<'a>(&self, rows: &'a Dev<T>) -> &'a CudaSlice<T> {
        &rows.data
    }
    fn rows_buffer_mut<'a>(&self, rows: &'a mut Dev<T>) -> &'a mut CudaSlice<T> {
        &mut rows.data
    }
    fn acc_buffer<'a>(&self, acc: &'a Dev<f32>) -> &'a CudaSlice<f32> {
        &acc.data
    }
    fn acc_buffer_mut<'a>(&self, acc: &'a mut Dev<f32>) -> &'a mut CudaSlice<f32> {
        &mut acc.data
    }
}

/// Every rank's forward output and lse and gradients (host values, per piece).
type RankResult<T> = (Vec<HostRows<T>>, Vec<Vec<f32>>, [Vec<HostRows<T>>; 3]);

/// The pieces of `x` (`[batch, seq, heads, head_dim]`) that `rank` holds.
fn pieces<T: Element>(problem: &RingProblem, rank: usize, x: &[T], shape: Shape4) -> Vec<HostRows<T>> {
    let view = TensorView::contiguous(TensorName::Query, x, shape).expect("view");
    rank_pieces(problem, rank).into_iter().map(|r| HostRows::from_view_rows(&view, r).expect("piece")).collect()
}

/// Run forward and backward on every rank, over NCCL between device buffers
/// (`device: true`) or staged through the host with the CPU compute.
fn run<T: CudaElement>(
    problem: &RingProblem,
    opts: ChunkOptions,
    inputs: &[(Vec<T>, Shape4); 4],
    device: bool,
) -> Vec<RankResult<T>> {
    let comms = ThreadComm::world_with_timeout(problem.world, Duration::from_secs(20)).expect("threads");
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, mut comm)| {
                s.spawn(move || -> Result<RankResult<T>> {
                    let [q, k, v, go] = inputs.each_ref().map(|(x, sh)| pieces(problem, rank, x, *sh));
                    if !device {
                        let x = CpuChunks::default();
                        let mut t = HostTransport::new(&mut comm);
                        let f = chunk_forward(&mut t, &x, problem, opts, [&q, &k, &v])?;
                        let g = chunk_backward(&mut t, &x, problem, opts, [&q, &k, &v], &go, None)?;
                        return Ok((f.out, f.lse.iter().map(HostRowStats::to_bsh).collect(), [g.dq, g.dk, g.dv]));
                    }
                    let ctx = CudaContext::new(rank).map_err(dev_err)?;
                    let x = StandInChunks { stream: ctx.new_stream().map_err(dev_err)?, cpu: CpuChunks::default() };
                    let mut t = NcclDeviceTransport::bootstrap(comm, &ctx)?;
                    let up = |ps: &[HostRows<T>]| ps.iter().map(|p| x.dev(p)).collect::<Result<Vec<_>>>();
                    let (q, k, v, go) = (up(&q)?, up(&k)?, up(&v)?, up(&go)?);
                    let f = chunk_forward(&mut t, &x, problem, opts, [&q, &k, &v])?;
                    let g = chunk_backward(&mut t, &x, problem, opts, [&q, &k, &v], &go, None)?;
                    let down = |ps: &[Dev<T>]| ps.iter().map(|p| x.host(p)).collect::<Result<Vec<_>>>();
                    let lse = f.lse.iter().map(HostRowStats::to_bsh).collect();
                    Ok((down(&f.out)?, lse, [down(&g.dq)?, down(&g.dk)?, down(&g.dv)?]))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread").expect("rank")).collect()
    })
}

/// Forward and gradients over NCCL between device buffers equal the host-staged ring's,
/// bit for bit: grouped heads, causal, both layouts, one and three rounds, 2 and 3 ranks,
/// dilated segments, a causal window (whose k/v go one step and whose dk/dv come home
/// from there, two ranks on at 3 ranks) and, at 4 ranks, a two-sided window (k/v one
/// step each way, or straight to each rank under all-gather).
pub fn device_transport_matches_host_staging() {
    let segments = DilatedConfig::builder().segments(&[8, 16]).dilations(&[1, 2]).causal().build();
    let window = DilatedConfig::builder().window(10, 0).causal().build();
    let two_sided = DilatedConfig::builder().window(5, 4).build();
    let (q_shape, kv_shape) = (Shape4::new(2, 48, 4, 8).expect("q"), Shape4::new(2, 48, 2, 8).expect("kv"));
    let make = |seed: usize, s: Shape4| -> (Vec<bf16>, Shape4) {
        ((0..s.numel()).map(|i| bf16::from_f32(((i * 7 + seed * 13) % 23) as f32 / 11.0 - 1.0)).collect(), s)
    };
    let inputs = [make(1, q_shape), make(2, kv_shape), make(3, kv_shape), make(4, q_shape)];
    let mut runs = 0;
    let (auto, both) = (&[Strategy::Auto][..], &[Strategy::Ring, Strategy::AllGather][..]);
    let cases =
        [(segments.expect("s"), 2..=3, auto), (window.expect("w"), 2..=3, auto), (two_sided.expect("t"), 4..=4, both)];
    for (cfg, worlds, strategies) in cases {
        for (world, &strategy) in worlds.flat_map(|w| strategies.iter().map(move |s| (w, s))) {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                for rounds in [1, 3] {
                    let shape = AttnShape { q: q_shape, kv: kv_shape };
                    let problem = RingProblem::new(&cfg, shape, layout, strategy, world);
                    let opts = ChunkOptions::with_rounds(rounds).expect("rounds");
                    let dev = run(&problem, opts, &inputs, true);
                    let host = run(&problem, opts, &inputs, false);
                    let case = format!("{cfg:?} world {world} {strategy:?} {layout:?} rounds {rounds}");
                    assert!(dev == host, "{case}: device NCCL differs from host staging");
                    runs += 1;
                }
            }
        }
    }
    println!("device ring: {runs} runs over NCCL between device buffers equal host staging bit for bit");
}

/// Ranks out of step (rank 1 sends step 2 where rank 0 sends step 1): the header check
/// fails both before any NCCL call, with a typed error.
pub fn ranks_out_of_step_fail_at_the_header() {
    let cfg = DilatedConfig::builder().segments(&[8]).dilations(&[1]).build().expect("config");
    let shape = Shape4::new(1, 16, 1, 4).expect("shape");
    let problem = RingProblem::new(&cfg, shape.into(), Layout::Contiguous, Strategy::Auto, 2);
    let comms = ThreadComm::world_with_timeout(2, Duration::from_secs(5)).expect("threads");
    let res: Vec<Result<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let problem = &problem;
                s.spawn(move || -> Result<()> {
                    let ctx = CudaContext::new(rank).map_err(dev_err)?;
                    let x = StandInChunks { stream: ctx.new_stream().map_err(dev_err)?, cpu: CpuChunks::default() };
                    let mut t = NcclDeviceTransport::bootstrap(comm, &ctx)?;
                    let rows = Shape4 { seq: 8, ..shape };
                    let k: Dev<bf16> = ChunkCompute::<bf16>::zero_rows(&x, rows)?;
                    let v: Dev<bf16> = ChunkCompute::<bf16>::zero_rows(&x, rows)?;
                    let travel = Travel {
                        kind: TravelKind::Kv,
                        owner: rank,
                        hop: 1,
                        step: rank + 1,
                        k: vec![Arc::new(k)],
                        v: vec![Arc::new(v)],
                        dk: Vec::new(),
                        dv: Vec::new(),
                        arriving: vec![rows],
                    };
                    ChunkTransport::<bf16, StandInChunks>::start(&mut t, &x, problem, travel)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    for r in &res {
        assert!(matches!(r, Err(attn_core::AttnError::Comm { .. })), "{res:?}");
    }
    println!("device ring: ranks out of step fail at the header: {res:?}");
}

/// A rank's outputs of the first and the second call, and the refusal of a mismatched link.
type LinkReuse = (Vec<Vec<bf16>>, Vec<Vec<bf16>>, String);

/// A link joined once serves a later call: each rank's forward over a bootstrapped
/// transport, its link taken back (`into_link`) and lent to a transport over a fresh
/// control communicator (`over`), gives the same output bits again; a link lent to a
/// control of another rank is refused before any round.
pub fn a_link_serves_later_calls() {
    let cfg = DilatedConfig::builder().segments(&[8, 16]).dilations(&[1, 2]).causal().build().expect("config");
    let shape = Shape4::new(1, 32, 2, 4).expect("shape");
    let problem = RingProblem::new(&cfg, shape.into(), Layout::Zigzag, Strategy::Ring, 2);
    let x: Vec<bf16> = (0..shape.numel()).map(|i| bf16::from_f32((i % 13) as f32 / 7.0 - 0.9)).collect();
    let firsts = ThreadComm::world_with_timeout(2, Duration::from_secs(20)).expect("threads");
    let seconds = ThreadComm::world_with_timeout(2, Duration::from_secs(20)).expect("threads");
    let outs: Vec<Result<LinkReuse>> = std::thread::scope(|s| {
        let hs: Vec<_> = firsts
            .into_iter()
            .zip(seconds)
            .enumerate()
            .map(|(rank, (first, second))| {
                let (problem, x) = (&problem, &x);
                s.spawn(move || {
                    let ctx = CudaContext::new(rank).map_err(dev_err)?;
                    let c = StandInChunks { stream: ctx.new_stream().map_err(dev_err)?, cpu: CpuChunks::default() };
                    let mine = pieces(problem, rank, x, shape);
                    let up = mine.iter().map(|p| c.dev(p)).collect::<Result<Vec<_>>>()?;
                    let opts = ChunkOptions::default();
                    let mut t = NcclDeviceTransport::bootstrap(first, &ctx)?;
                    let once = chunk_forward(&mut t, &c, problem, opts, [&up, &up, &up])?.out;
                    let link = t.into_link();
                    link.usable()?;
                    let mut t = NcclDeviceTransport::over(link, second)?;
                    let twice = chunk_forward(&mut t, &c, problem, opts, [&up, &up, &up])?.out;
                    let down = |ps: &[Dev<bf16>]| -> Result<Vec<Vec<bf16>>> {
                        ps.iter().map(|p| Ok(c.host(p)?.data)).collect()
                    };
                    // The link back, lent to a control of the other rank: refused.
                    let other = ThreadComm::world(2).expect("threads").swap_remove(1 - rank);
                    let refused = match NcclDeviceTransport::<_, Dev<bf16>, Dev<f32>>::over(t.into_link(), other) {
                        Err(e) => e.to_string(),
                        Ok(_) => "accepted".into(),
                    };
                    Ok((down(&once)?, down(&twice)?, refused))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    for (rank, got) in outs.into_iter().enumerate() {
        let (once, twice, refused) = got.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(once == twice, "rank {rank}: the reused link's call differs from the first");
        assert!(refused.contains("cannot carry the data of rank"), "rank {rank}: {refused}");
    }
    println!("device ring: a link joined once served a second call, bit for bit");
}
