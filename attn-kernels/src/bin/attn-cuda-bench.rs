//! `attn-cuda-bench`: time the CUDA forward (or forward+backward) on the benchmark shapes
//! (head groups, segments 2048..32768 with rates 1..16, heads 16, head_dim 128) with CUDA
//! events after a warm-up call, and print one JSON line per case with milliseconds,
//! TFLOP/s and how the kernels were loaded (cubin or PTX). Build here with `--features
//! cuda`, carry the binary to a GPU machine, run it there (a typed error without a GPU).
//!
//! `--fwd-mma mma-sync,wgmma` times the f16/bf16 forward with the `mma.sync` kernels and
//! with the sm_90a forward (TMA, wgmma; an sm_90 device only), `--paths direct,partial` times both ways the forward reaches its output (straight from
//! the kernel, or through the f32 partial and its epilogue), `--rows 64,128,128w4` each
//! block shape of the tensor-core forward, `--launch per-pattern,fused,persistent` each
//! way its patterns launch, `--fwd-stages 2,3` both K/V pipelines of the tensor-core forward,
//! `--bwd-loads sync,pipelined` both ways the backward loads its query
//! tiles, `--bwd-keys 64,128` both keys a block of the backward and `--bwd-dq
//! atomic,deterministic` both ways it sums dq, `--bwd-writes accumulated,direct` both
//! ways a whole call writes dk and dv and `--bwd-queries 32,64` both query tiles of the
//! backward, in one process.
//!
//! Usage: attn-cuda-bench [--seq 65536,262144] [--heads 16] [--dtype bf16|f16|f32] [--warmups 1] [--iters 10]
//!        [--causal] [--backward] [--paths direct|partial|direct,partial] [--rows 64,128,128w4]
//!        [--launch per-pattern,fused,persistent] [--fwd-stages 2,3] [--bwd-loads sync,pipelined]
//!        [--bwd-keys 64,128] [--bwd-dq atomic,deterministic] [--bwd-writes accumulated,direct]
//!        [--bwd-queries 32,64] [--fwd-mma mma-sync,wgmma] [--sync-between]
//!        (each list: one or more of its values)
//!
//! `--sync-between` synchronises the device after each timed call, as a framework's step
//! does, so the time includes allocating scratch the memory pool handed back.
//!
//! `--heads` (at least 5, one a pattern) shrinks the work, e.g. for a run under
//! compute-sanitizer, where `--warmups 0` skips the untimed call.

use std::process::ExitCode;

use attn_core::{DilatedConfig, Pass, Shape4};
use attn_kernels::cuda::plan::{
    BackwardDq, BackwardKeys, BackwardLoads, BackwardOptions, BackwardQueries, BackwardWrites, ForwardMma,
    ForwardOptions, ForwardRows, ForwardStages, PatternFusion,
};
use attn_kernels::cuda::{BenchRun, Between, CudaDevice, CudaElement, ForwardPath, GpuTiming, bench_pass};
use half::{bf16, f16};

struct Args {
    seqs: Vec<usize>,
    heads: usize,
    dtype: String,
    warmups: usize,
    iters: usize,
    between: Between,
    causal: bool,
    pass: Pass,
    paths: Vec<ForwardPath>,
    /// `None`: the device's own choice (`ATTN_CUDA_FWD_ROWS`).
    rows: Option<Vec<ForwardRows>>,
    /// `None`: the device's own choice (`ATTN_CUDA_FWD_LAUNCH`).
    launches: Option<Vec<PatternFusion>>,
    /// `None`: the device's own choice (`ATTN_CUDA_FWD_STAGES`).
    fwd_stages: Option<Vec<ForwardStages>>,
    /// `None`: the device's own choice (`ATTN_CUDA_FWD_MMA`).
    fwd_mma: Option<Vec<ForwardMma>>,
    /// `None`: the device's own choice (`ATTN_CUDA_BWD_LOADS`).
    bwd_loads: Option<Vec<BackwardLoads>>,
    /// `None`: the device's own choice (`ATTN_CUDA_BWD_KEYS`).
    bwd_keys: Option<Vec<BackwardKeys>>,
    bwd_dq: Option<Vec<BackwardDq>>,
    /// `None`: the device's own choice (`ATTN_CUDA_BWD_WRITES`).
    bwd_writes: Option<Vec<BackwardWrites>>,
    /// `None`: the device's own choice (`ATTN_CUDA_BWD_QUERIES`).
    bwd_queries: Option<Vec<BackwardQueries>>,
}

fn path_name(p: ForwardPath) -> &'static str {
    match p {
        ForwardPath::Direct => "direct",
        ForwardPath::Partial => "partial",
    }
}

/// A comma-separated list of kernel choices for `flag`, each spelled as `parse` reads it.
fn choices<T>(flag: &str, list: &str, parse: fn(&str) -> Option<T>, expected: &str) -> Result<Vec<T>, String> {
    list.split(',').map(|c| parse(c).ok_or_else(|| format!("{flag}: `{c}` is not {expected}"))).collect()
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        seqs: vec![65_536, 262_144],
        heads: 16,
        dtype: "bf16".into(),
        warmups: 1,
        iters: 10,
        between: Between::Queued,
        causal: false,
        pass: Pass::Forward,
        paths: vec![ForwardPath::Direct],
        rows: None,
        launches: None,
        fwd_stages: None,
        fwd_mma: None,
        bwd_loads: None,
        bwd_keys: None,
        bwd_dq: None,
        bwd_writes: None,
        bwd_queries: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--seq" => {
                a.seqs = val()?
                    .split(',')
                    .map(|s| s.trim().parse().map_err(|e| format!("--seq: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--heads" => a.heads = val()?.parse().map_err(|e| format!("--heads: {e}"))?,
            "--dtype" => a.dtype = val()?,
            "--sync-between" => a.between = Between::Synchronized,
            "--warmups" => a.warmups = val()?.parse().map_err(|e| format!("--warmups: {e}"))?,
            "--iters" => a.iters = val()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--causal" => a.causal = true,
            "--backward" => a.pass = Pass::Backward,
            "--paths" => {
                a.paths = val()?
                    .split(',')
                    .map(|p| match p.trim() {
                        "direct" => Ok(ForwardPath::Direct),
                        "partial" => Ok(ForwardPath::Partial),
                        other => Err(format!("--paths: unknown path `{other}` (direct, partial)")),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--rows" => a.rows = Some(choices(&flag, &val()?, ForwardRows::parse, "64, 128 or 128w4")?),
            "--launch" => {
                a.launches = Some(choices(&flag, &val()?, PatternFusion::parse, "per-pattern, fused or persistent")?)
            }
            "--fwd-stages" => a.fwd_stages = Some(choices(&flag, &val()?, ForwardStages::parse, "2 or 3")?),
            "--fwd-mma" => a.fwd_mma = Some(choices(&flag, &val()?, ForwardMma::parse, "mma-sync or wgmma")?),
            "--bwd-loads" => a.bwd_loads = Some(choices(&flag, &val()?, BackwardLoads::parse, "sync or pipelined")?),
            "--bwd-keys" => a.bwd_keys = Some(choices(&flag, &val()?, BackwardKeys::parse, "64 or 128")?),
            "--bwd-writes" => {
                a.bwd_writes = Some(choices(&flag, &val()?, BackwardWrites::parse, "accumulated or direct")?)
            }
            "--bwd-queries" => a.bwd_queries = Some(choices(&flag, &val()?, BackwardQueries::parse, "32 or 64")?),
            "--bwd-dq" => a.bwd_dq = Some(choices(&flag, &val()?, BackwardDq::parse, "atomic or deterministic")?),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(a)
}

fn run_one<T: CudaElement>(
    dev: &CudaDevice,
    cfg: &DilatedConfig,
    shape: Shape4,
    a: &Args,
    path: ForwardPath,
) -> Result<(GpuTiming, String), String> {
    // Deterministic pseudo-random inputs in [-1, 1).
    let fill = |i: usize| ((i.wrapping_mul(2_654_435_761) >> 7) % 2001) as f32 / 1000.0 - 1.0;
    let run = BenchRun { pass: a.pass, warmups: a.warmups, iters: a.iters, path, between: a.between };
    let t = bench_pass::<T>(dev, cfg, shape, run, fill).map_err(|e| e.to_string())?;
    Ok((t, dev.kernel_image(T::SUFFIX).map_err(|e| e.to_string())?))
}

fn run() -> Result<(), String> {
    let a = parse()?;
    let dev = CudaDevice::new(0).map_err(|e| e.to_string())?;
    let (major, minor) = dev.compute_capability();
    let cfg = DilatedConfig::builder()
        .segments(&[2048, 4096, 8192, 16384, 32768])
        .dilations(&[1, 2, 4, 8, 16])
        .causality(a.causal.into())
        .build()
        .map_err(|e| e.to_string())?;
    let own = (dev.forward_options(), dev.backward_options());
    let rows = a.rows.clone().unwrap_or_else(|| vec![own.0.rows]);
    let launches = a.launches.clone().unwrap_or_else(|| vec![own.0.fusion]);
    let stages = a.fwd_stages.clone().unwrap_or_else(|| vec![own.0.stages]);
    let mmas = a.fwd_mma.clone().unwrap_or_else(|| vec![own.0.mma]);
    let bwd_loads = a.bwd_loads.clone().unwrap_or_else(|| vec![own.1.loads]);
    let bwd_keys = a.bwd_keys.clone().unwrap_or_else(|| vec![own.1.keys]);
    let bwd_dq = a.bwd_dq.clone().unwrap_or_else(|| vec![own.1.dq]);
    let bwd_writes = a.bwd_writes.clone().unwrap_or_else(|| vec![own.1.writes]);
    let bwd_queries = a.bwd_queries.clone().unwrap_or_else(|| vec![own.1.queries]);
    let forwards: Vec<ForwardOptions> = rows
        .iter()
        .flat_map(|&rows| launches.iter().map(move |&fusion| (rows, fusion)))
        .flat_map(|(rows, fusion)| stages.iter().map(move |&stages| (rows, fusion, stages)))
        .flat_map(|(rows, fusion, stages)| mmas.iter().map(move |&mma| ForwardOptions { rows, fusion, stages, mma }))
        .collect();
    let backwards: Vec<BackwardOptions> = bwd_loads
        .iter()
        .flat_map(|&loads| bwd_keys.iter().map(move |&keys| (loads, keys)))
        .flat_map(|(loads, keys)| bwd_dq.iter().map(move |&dq| (loads, keys, dq)))
        .flat_map(|(loads, keys, dq)| bwd_writes.iter().map(move |&writes| (loads, keys, dq, writes)))
        .flat_map(|(loads, keys, dq, writes)| {
            bwd_queries.iter().map(move |&queries| BackwardOptions {
                loads,
                keys,
                dq,
                writes,
                queries,
                ..Default::default()
            })
        })
        .collect();
    let cases: Vec<(ForwardOptions, BackwardOptions, ForwardPath)> = forwards
        .iter()
        .flat_map(|&f| backwards.iter().map(move |&b| (f, b)))
        .flat_map(|(f, b)| a.paths.iter().map(move |&p| (f, b, p)))
        .collect();
    for &seq in &a.seqs {
        let shape = Shape4::new(1, seq, a.heads, 128).map_err(|e| e.to_string())?;
        for &(fwd, bwd, path) in &cases {
            let dev = dev
                .with_forward_mma(fwd.mma)
                .map_err(|e| e.to_string())?
                .with_forward_rows(fwd.rows)
                .with_pattern_fusion(fwd.fusion)
                .with_forward_stages(fwd.stages)
                .with_backward_loads(bwd.loads)
                .with_backward_keys(bwd.keys)
                .with_backward_dq(bwd.dq)
                .with_backward_writes(bwd.writes)
                .with_backward_queries(bwd.queries);
            let (t, image) = match a.dtype.as_str() {
                "bf16" => run_one::<bf16>(&dev, &cfg, shape, &a, path)?,
                "f16" => run_one::<f16>(&dev, &cfg, shape, &a, path)?,
                "f32" => run_one::<f32>(&dev, &cfg, shape, &a, path)?,
                other => return Err(format!("unknown dtype `{other}`")),
            };
            println!(
                "{{\"device\":\"sm_{major}{minor}\",\"kernels\":\"{image}\",\"dtype\":\"{}\",\"seq\":{seq},\"heads\":{},\"head_dim\":128,\"causal\":{},\"backward\":{},\"path\":\"{}\",\"fwd_rows\":\"{}\",\"launch\":\"{}\",\"fwd_stages\":\"{}\",\"fwd_mma\":\"{}\",\"bwd_loads\":\"{}\",\"bwd_keys\":\"{}\",\"bwd_dq\":\"{}\",\"bwd_writes\":\"{}\",\"bwd_queries\":\"{}\",\"between\":\"{}\",\"median_ms\":{:.4},\"tflops\":{:.2},\"scratch_allocations\":{}}}",
                a.dtype,
                a.heads,
                a.causal,
                a.pass == Pass::Backward,
                path_name(path),
                fwd.rows.name(),
                fwd.fusion.name(),
                fwd.stages.name(),
                fwd.mma.name(),
                bwd.loads.name(),
                bwd.keys.name(),
                bwd.dq.name(),
                bwd.writes.name(),
                bwd.queries.name(),
                a.between.name(),
                t.median_ms,
                t.tflops(),
                t.allocations
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("attn-cuda-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
