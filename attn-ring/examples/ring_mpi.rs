//! The chunk ring with one process per rank, started by MPI: with `--compute cuda` (one
//! GPU a rank; features `nccl` and `cuda`) the blocks run on the CUDA kernels and the k/v
//! slices and dk/dv move by NCCL between device buffers (`NcclDeviceTransport`, no host
//! staging), MPI carrying NCCL's unique id, the handshake and the completion rounds; with
//! `--compute cpu` the blocks run on the CPU kernels and the rows travel over MPI. Each
//! rank makes only its own rows of a seeded global q, k, v and grad_out, runs the forward
//! and the exact backward, and prints its times (and, on a GPU, its peak device memory).
//! With `--check`, rank 0 gathers every rank's rows and judges the output, lse and
//! gradients row by row against the float64 reference (exit 1 when a row is outside its
//! bound); keep `--seq` small enough for the reference then.
//!
//! ```sh
//! cargo build --release -p attn-ring --features mpi,nccl,cuda --example ring_mpi
//! mpirun -n 4 target/release/examples/ring_mpi --compute cuda --seq 16384 --check
//! mpirun -n 8 target/release/examples/ring_mpi --compute cuda --seq 1048576 --rounds 8
//! ```
//!
//! A GPU rank uses the device of its node-local rank (`OMPI_COMM_WORLD_LOCAL_RANK`,
//! `MPI_LOCALRANKID`, `SLURM_LOCALID` or `LOCAL_RANK`; its world rank otherwise), modulo
//! the devices it sees.

use std::ops::Range;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use attn_core::{AttnError, DType, DilatedConfig, Element, Result, Shape4};
use attn_ring::chunk_ring::{
    ChunkCompute, ChunkOptions, ChunkTransport, CpuChunks, HostRows, HostTransport, chunk_backward, chunk_forward,
    place_piece, rank_pieces,
};
use attn_ring::comm::MpiComm;
use attn_ring::{Communicator, Layout, RingProblem, Strategy};
use attn_testkit::judge::{Expected, judge_backward, judge_forward, verdict};
use half::{bf16, f16};
use mpi::traits::Communicator as _;

/// Where the blocks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compute {
    Cpu,
    Cuda,
}

struct Args {
    seq: usize,
    heads: usize,
    head_dim: usize,
    segments: Vec<usize>,
    dilations: Vec<usize>,
    causal: bool,
    layout: Layout,
    rounds: usize,
    dtype: DType,
    compute: Compute,
    threads: usize,
    check: bool,
}

const USAGE: &str = "--seq N --heads H --head-dim D --segments a,b,.. --dilations a,b,.. [--causal] \
                     --layout zigzag|contiguous --rounds R --dtype bf16|f16|f32 --compute cpu|cuda --threads N [--check]";

fn parse() -> std::result::Result<Args, String> {
    let mut a = Args {
        seq: 16384,
        heads: 8,
        head_dim: 64,
        segments: vec![2048, 4096, 8192],
        dilations: vec![1, 2, 4],
        causal: false,
        layout: Layout::Zigzag,
        rounds: 4,
        dtype: DType::BF16,
        compute: Compute::Cuda,
        threads: 1,
        check: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--causal" => a.causal = true,
            "--check" => a.check = true,
            _ => {
                let value = it.next().ok_or(format!("{flag} needs a value ({USAGE})"))?;
                let num = |v: &str| v.parse::<usize>().map_err(|e| format!("{flag} {v}: {e}"));
                let list = |v: &str| v.split(',').map(num).collect::<std::result::Result<Vec<_>, _>>();
                match flag.as_str() {
                    "--seq" => a.seq = num(&value)?,
                    "--heads" => a.heads = num(&value)?,
                    "--head-dim" => a.head_dim = num(&value)?,
                    "--segments" => a.segments = list(&value)?,
                    "--dilations" => a.dilations = list(&value)?,
                    "--layout" => a.layout = Layout::parse(&value).map_err(|e| e.to_string())?,
                    "--rounds" => a.rounds = num(&value)?,
                    "--threads" => a.threads = num(&value)?,
                    "--compute" => {
                        a.compute = match value.as_str() {
                            "cpu" => Compute::Cpu,
                            "cuda" => Compute::Cuda,
                            _ => return Err(format!("--compute {value}: cpu or cuda")),
                        }
                    }
                    "--dtype" => {
                        a.dtype = DType::parse(&value)
                            .filter(|d| *d != DType::F64)
                            .ok_or(format!("--dtype {value}: bf16, f16 or f32"))?
                    }
                    other => return Err(format!("unknown flag {other} ({USAGE})")),
                }
            }
        }
    }
    Ok(a)
}

/// Element `i` of the seeded global tensor `tensor`: uniform in [-1, 1), the same on every
/// rank, so a rank makes its own rows without the whole tensor.
fn value(tensor: u64, i: usize) -> f32 {
    let mut z = (i as u64) ^ tensor.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Rows `range` (every batch) of the global tensor `tensor` of shape `s`, in `T`.
fn rows<T: Element>(tensor: u64, s: Shape4, range: &Range<usize>) -> Vec<T> {
    let row = s.heads * s.head_dim;
    (0..s.batch)
        .flat_map(|b| ((b * s.seq + range.start) * row..(b * s.seq + range.end) * row).map(move |i| value(tensor, i)))
        .map(T::from_f32)
        .collect()
}

/// The seeds of q, k, v and grad_out.
const TENSORS: [u64; 4] = [1, 2, 3, 4];

/// What the example needs of a compute beyond [`ChunkCompute`]: rows in and out of the
/// host, and the peak of the memory it holds where it counts it.
trait RankCompute<T: Element>: ChunkCompute<T> {
    fn upload(&self, host: Vec<T>, shape: Shape4) -> Result<Self::Rows>;
    fn download(&self, rows: &Self::Rows) -> Result<Vec<f32>>;
    /// `[batch, rows, heads]` values.
    fn download_stats(&self, stats: &Self::RowStats) -> Result<Vec<f32>>;
    fn peak_bytes(&self) -> Option<u64>;
    fn reset_peak(&self) {}
}

impl<T: Element> RankCompute<T> for CpuChunks {
    fn upload(&self, data: Vec<T>, shape: Shape4) -> Result<HostRows<T>> {
        Ok(HostRows { shape, data })
    }
    fn download(&self, rows: &HostRows<T>) -> Result<Vec<f32>> {
        Ok(rows.data.iter().map(|v| v.to_f32()).collect())
    }
    fn download_stats(&self, stats: &Self::RowStats) -> Result<Vec<f32>> {
        Ok(stats.to_bsh())
    }
    fn peak_bytes(&self) -> Option<u64> {
        None
    }
}

#[cfg(all(feature = "nccl", feature = "cuda"))]
mod gpu {
    //! The CUDA compute and its NCCL device transport.
    use super::*;
    use attn_core::TensorView;
    use attn_core::error::TensorName;
    use attn_kernels::cuda::{CudaDevice, CudaElement, DeviceTensor, device_count};
    use attn_ring::chunk_ring::{CudaChunks, DeviceRowStats, Metered, NcclDeviceTransport};

    impl<T: CudaElement> RankCompute<T> for CudaChunks {
        fn upload(&self, host: Vec<T>, shape: Shape4) -> Result<Metered<DeviceTensor<T>>> {
            let view = TensorView::contiguous(TensorName::Query, &host, shape)?;
            Ok(self.adopt(DeviceTensor::from_view(&self.dev, &view)?))
        }
        fn download(&self, rows: &Metered<DeviceTensor<T>>) -> Result<Vec<f32>> {
            Ok(rows.to_host_contiguous(&self.dev)?.iter().map(|v| v.to_f32()).collect())
        }
        fn download_stats(&self, stats: &Metered<DeviceRowStats>) -> Result<Vec<f32>> {
            let host = self.dev.stream().clone_dtoh(&stats.data).map_err(|e| AttnError::backend("cuda", e))?;
            self.dev.synchronize()?;
            Ok(host)
        }
        fn peak_bytes(&self) -> Option<u64> {
            Some(self.meter.peak())
        }
        fn reset_peak(&self) {
            self.meter.reset_peak();
        }
    }

    /// The node-local rank the launcher gives this process, if it names one.
    fn local_rank() -> Option<usize> {
        ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"]
            .iter()
            .find_map(|v| std::env::var(v).ok()?.parse().ok())
    }

    /// [`run`] on the GPU of this process's node-local rank (modulo the GPUs it sees: a
    /// launcher that gives each rank its own GPU leaves it one), data moving by NCCL.
    pub fn run_cuda<T: CudaElement>(a: &Args, control: MpiComm) -> Result<bool> {
        let gpu = local_rank().unwrap_or(control.rank()) % device_count()?.max(1);
        let x = CudaChunks::new(CudaDevice::new(gpu)?);
        let mut t = NcclDeviceTransport::bootstrap(control, x.dev.context())?;
        run::<T, _, _>(a, &x, &mut t, &format!("GPU {gpu}"))
    }
}

/// Rank `rank`'s pieces of global tensor `tensor` in `x`.
fn upload<T: Element, X: RankCompute<T>>(
    x: &X,
    problem: &RingProblem,
    rank: usize,
    tensor: u64,
    s: Shape4,
) -> Result<Vec<X::Rows>> {
    rank_pieces(problem, rank)
        .iter()
        .map(|r| x.upload(rows::<T>(tensor, s, r), Shape4::new(s.batch, r.len(), s.heads, s.head_dim)?))
        .collect()
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Appends `vals` with their count.
fn put(bytes: &mut Vec<u8>, vals: &[f32]) {
    bytes.extend((vals.len() as u64).to_le_bytes());
    vals.iter().for_each(|v| bytes.extend(v.to_le_bytes()));
}

/// Global tensors (out, lse, dq, dk, dv) assembled from every rank's results (each
/// tensor's pieces in order, as [`put`] wrote them).
fn assemble(problem: &RingProblem, s: Shape4, all: &[Vec<u8>]) -> Result<[Vec<f32>; 5]> {
    let bad = |r: usize| AttnError::InvalidArgument(format!("rank {r}'s results are cut short"));
    let row = s.heads * s.head_dim;
    let mut res: [Vec<f32>; 5] = std::array::from_fn(|t| vec![0.0; if t == 1 { s.lse_len() } else { s.numel() }]);
    for (r, bytes) in all.iter().enumerate() {
        let mut at = 0usize;
        let mut take = || -> Result<Vec<f32>> {
            let n = u64::from_le_bytes(bytes.get(at..at + 8).ok_or_else(|| bad(r))?.try_into().unwrap_or([0; 8]));
            let body = bytes.get(at + 8..at + 8 + 4 * n as usize).ok_or_else(|| bad(r))?;
            at += 8 + 4 * n as usize;
            Ok(body.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        };
        for (t, global) in res.iter_mut().enumerate() {
            let width = if t == 1 { s.heads } else { row };
            for range in rank_pieces(problem, r) {
                place_piece(global, s.seq, &range, width, &take()?)?;
            }
        }
    }
    Ok(res)
}

/// Rank 0's check of the gathered results against the float64 reference.
fn judge<T: Element>(cfg: &DilatedConfig, s: Shape4, results: [Vec<f32>; 5]) -> Result<bool> {
    let all = 0..s.seq;
    let [q, k, v, go] = TENSORS.map(|t| rows::<T>(t, s, &all));
    let want = Expected::of(cfg, s.into(), [&q, &k, &v], Some(&go))?;
    let [out, lse, dq, dk, dv] = results;
    let typed = |x: &[f32]| x.iter().map(|&v| T::from_f32(v)).collect::<Vec<T>>();
    let mut checks = judge_forward(&want, &typed(&out), &lse, T::DTYPE);
    checks.extend(judge_backward(&want, [&typed(&dq), &typed(&dk), &typed(&dv)], T::DTYPE));
    let line = checks.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
    let passed = verdict(&checks).is_ok();
    println!("check {}: {line}", if passed { "passed, every row within its bound" } else { "FAILED" });
    Ok(passed)
}

/// This rank's forward and backward (the first of each compiles or warms up, the second
/// is timed); with `--check`, every rank's results judged on rank 0.
fn run<T, X, Tr>(a: &Args, x: &X, t: &mut Tr, place: &str) -> Result<bool>
where
    T: Element,
    X: RankCompute<T>,
    Tr: ChunkTransport<T, X, Control = MpiComm>,
{
    let (rank, world) = (t.control().rank(), t.control().world_size());
    let cfg =
        DilatedConfig::builder().segments(&a.segments).dilations(&a.dilations).causality(a.causal.into()).build()?;
    let s = Shape4::new(1, a.seq, a.heads, a.head_dim)?;
    let problem = RingProblem::new(&cfg, s.into(), a.layout, Strategy::Auto, world);
    let opts = ChunkOptions::with_rounds(a.rounds)?;
    let [q, k, v, go] = TENSORS.map(|tensor| upload::<T, X>(x, &problem, rank, tensor, s));
    let (q, k, v, go) = (q?, k?, v?, go?);

    drop(chunk_forward(t, x, &problem, opts, [&q, &k, &v])?);
    x.sync()?;
    x.reset_peak();
    let t0 = Instant::now();
    let fwd = chunk_forward(t, x, &problem, opts, [&q, &k, &v])?;
    x.sync()?;
    let fwd_ms = ms(t0);
    drop(chunk_backward(t, x, &problem, opts, [&q, &k, &v], &go, None)?);
    let t0 = Instant::now();
    let grads = chunk_backward(t, x, &problem, opts, [&q, &k, &v], &go, None)?;
    x.sync()?;
    let bwd_ms = ms(t0);
    let peak = x.peak_bytes().map(|b| format!(", peak device memory {:.1} MiB", b as f64 / (1u64 << 20) as f64));
    println!(
        "rank {rank}/{world} on {place}: forward {fwd_ms:.2} ms, backward {bwd_ms:.2} ms{}",
        peak.unwrap_or_default()
    );
    if !a.check {
        return Ok(true);
    }
    let mut mine = Vec::new();
    for o in &fwd.out {
        put(&mut mine, &x.download(o)?);
    }
    for l in &fwd.lse {
        put(&mut mine, &x.download_stats(l)?);
    }
    for g in [&grads.dq, &grads.dk, &grads.dv] {
        for piece in g {
            put(&mut mine, &x.download(piece)?);
        }
    }
    let all = t.control().all_gather(mine)?;
    if rank != 0 {
        return Ok(true);
    }
    judge::<T>(&cfg, s, assemble(&problem, s, &all)?)
}

/// [`run`] on the CPU kernels, rows staged over MPI.
fn run_cpu<T: Element>(a: &Args, mut control: MpiComm) -> Result<bool> {
    let x = CpuChunks { threads: a.threads };
    run::<T, _, _>(a, &x, &mut HostTransport::new(&mut control), &format!("{} CPU thread(s)", a.threads.max(1)))
}

fn dispatch(a: &Args, control: MpiComm) -> Result<bool> {
    match (a.compute, a.dtype) {
        (Compute::Cpu, DType::BF16) => run_cpu::<bf16>(a, control),
        (Compute::Cpu, DType::F16) => run_cpu::<f16>(a, control),
        (Compute::Cpu, _) => run_cpu::<f32>(a, control),
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        (Compute::Cuda, DType::BF16) => gpu::run_cuda::<bf16>(a, control),
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        (Compute::Cuda, DType::F16) => gpu::run_cuda::<f16>(a, control),
        #[cfg(all(feature = "nccl", feature = "cuda"))]
        (Compute::Cuda, _) => gpu::run_cuda::<f32>(a, control),
        #[cfg(not(all(feature = "nccl", feature = "cuda")))]
        (Compute::Cuda, _) => Err(AttnError::NotCompiled { backend: "--compute cuda", feature: "nccl` and `cuda" }),
    }
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ring_mpi: {e}");
            return ExitCode::from(2);
        }
    };
    let Some(universe) = mpi::initialize() else {
        eprintln!("ring_mpi: MPI could not be initialised");
        return ExitCode::FAILURE;
    };
    let control = MpiComm::with_timeout(universe.world(), Duration::from_secs(120));
    match dispatch(&args, control) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        // A peer that stopped answering would hold MPI_Finalize (a barrier of every rank)
        // for ever: end the whole job instead.
        Err(e @ AttnError::Timeout { .. }) => {
            eprintln!("ring_mpi: {e}");
            universe.world().abort(1)
        }
        Err(e) => {
            eprintln!("ring_mpi: {e}");
            ExitCode::FAILURE
        }
    }
}
