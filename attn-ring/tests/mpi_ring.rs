//! MPI integration test (feature `mpi`, `harness = false`): every golden file in
//! `conformance/dilated` and `conformance/features` (grouped k/v heads, key padding,
//! packed sequences, windows), every layout and strategy (Ulysses and the hybrid with groups
//! of 2 included), forward and gradients,
//! with this process as one rank; and the chunk ring (CPU compute, host transport) on
//! every file and layout. Run under
//! `mpirun --allow-run-as-root --oversubscribe -np N target/.../mpi_ring-*`.
//! Also checks that a mismatched config is the same typed error on every rank, and that
//! the error aggregation rejects planted errors (a wrong value, a rank with no rows, a
//! feature file run without its masks).

use std::process::ExitCode;

use attn_core::error::TensorName;
use attn_core::{AttnError, Shape4, TensorView, TensorViewMut};
use attn_ring::chunk_ring::{
    ChunkOptions, CpuChunks, HostRows, HostTransport, chunk_backward, chunk_forward, rank_pieces,
};
use attn_ring::comm::MpiComm;
use attn_ring::{
    BackwardOutputs, Communicator, Layout, RingProblem, Strategy, local_rows, problem_for, ring_backward, ring_forward,
};
use attn_testkit::golden::{GoldenCase, golden_dir, load_dir};
use attn_testkit::split_error;
use attn_testkit::tolerance::Tolerance;

/// The golden directories and their file counts: a file missing or added fails the run.
const DIRS: [(&str, usize); 2] = [("dilated", 9), ("features", 9)];

/// The feature files whose masks the planted-error check drops: key padding, packed
/// sequences.
const MASKED: [&str; 2] = ["pad_hg", "varlen_ln_ragged"];

/// Global relative L2 error of `tensor` from every rank's local sums
/// (`attn_testkit::split_error`): every rank sends its part, refused or not, so a rank
/// whose rows are missing or mis-sized fails the comparison on every rank instead of
/// leaving the others waiting.
fn global_rel_l2(comm: &mut MpiComm, tensor: &str, got: &[f32], want: &[f32]) -> Result<f64, AttnError> {
    let all = comm.all_gather(split_error::encode(&split_error::error_sums(tensor, got, want)))?;
    split_error::combine(tensor, &all).map_err(AttnError::InvalidArgument)
}

/// The aggregator on planted errors, through the real exchange: exact rows pass the
/// golden bound, one value off on the last rank fails it, and the last rank returning no
/// rows is an error on every rank. The failures found, one line each.
fn planted_errors(comm: &mut MpiComm, bound: f64) -> Vec<String> {
    let (rank, p) = (comm.rank(), comm.world_size());
    let want: Vec<f32> = (0..512).map(|i| ((rank * 512 + i) as f32 * 0.37).sin()).collect();
    let mut wrong = want.clone();
    if rank + 1 == p {
        wrong[100] += 0.01;
    }
    let none: &[f32] = if rank + 1 == p { &[] } else { &want };
    let mut problems = Vec::new();
    match global_rel_l2(comm, "out", &want, &want) {
        Ok(e) if e <= bound => {}
        other => problems.push(format!("exact rows gave {other:?}")),
    }
    match global_rel_l2(comm, "dq", &wrong, &want) {
        Ok(e) if e > bound => {}
        other => problems.push(format!("one planted value gave {other:?}, not above {bound}")),
    }
    match global_rel_l2(comm, "dk", none, none) {
        Err(AttnError::InvalidArgument(m)) if m.contains("dk") => {}
        other => problems.push(format!("no rows on rank {} gave {other:?}, not a refusal naming dk", p - 1)),
    }
    match global_rel_l2(comm, "dv", &want[..want.len() - rank.min(1)], &want) {
        Err(_) if p > 1 => {}
        Ok(_) if p == 1 => {}
        other => problems.push(format!("a length mismatch on ranks 1.. gave {other:?}")),
    }
    problems
}

/// The ring problem of `case` on this world, with the file's masks (key padding, packed
/// sequences) unless `drop_masks` (the planted error: the same run without them).
fn case_problem(
    case: &GoldenCase,
    layout: Layout,
    strategy: Strategy,
    world: usize,
    drop_masks: bool,
) -> Result<RingProblem, AttnError> {
    let problem = RingProblem::new(&case.config()?, case.attn_shape()?, layout, strategy, world);
    Ok(if drop_masks { problem } else { problem.with_masks(case.masks.clone()) })
}

/// This rank's rows of the golden tensor `name` (q's shape, or k's for k, v, dk, dv).
fn golden_rows(case: &GoldenCase, name: &str, pos: &[usize]) -> Result<Vec<f32>, AttnError> {
    let t = case.tensor(name)?;
    local_rows(&TensorView::contiguous(TensorName::Other("golden"), &t.data, tensor_shape(case, name)?)?, pos)
}

/// The global shape of golden tensor `name`: k/v and their gradients may have fewer heads.
fn tensor_shape(case: &GoldenCase, name: &str) -> Result<Shape4, AttnError> {
    let s = case.attn_shape()?;
    Ok(if matches!(name, "k" | "v" | "dk" | "dv") { s.kv } else { s.q })
}

/// The golden lse rows of this rank, where the file has an lse.
fn golden_lse(case: &GoldenCase, pos: &[usize]) -> Result<Option<Vec<f32>>, AttnError> {
    let Some(want) = case.tensors.get("lse") else { return Ok(None) };
    let q = case.attn_shape()?.q;
    let wv = TensorView::contiguous(TensorName::Lse, &want.data, Shape4::new(q.batch, q.seq, q.heads, 1)?)?;
    local_rows(&wv, pos).map(Some)
}

fn run_case(
    comm: &mut MpiComm,
    case: &GoldenCase,
    layout: Layout,
    strategy: Strategy,
    drop_masks: bool,
) -> Result<Vec<(String, f64)>, AttnError> {
    let shape = case.attn_shape()?;
    let p = comm.world_size();
    let problem = case_problem(case, layout, strategy, p, drop_masks)?;
    let pos = layout.positions(shape.q.seq, p, comm.rank());
    let ls = shape.q.with_seq(pos.len())?;
    let lk = shape.kv.with_seq(pos.len())?;
    let global = |name: &str| golden_rows(case, name, &pos);
    let (q, k, v) = (global("q")?, global("k")?, global("v")?);
    let qv = TensorView::contiguous(TensorName::Query, &q, ls)?;
    let kv = TensorView::contiguous(TensorName::Key, &k, lk)?;
    let vv = TensorView::contiguous(TensorName::Value, &v, lk)?;
    let mut out = vec![0.0f32; ls.numel()];
    let mut lse = vec![0.0f32; ls.lse_len()];
    ring_forward(
        comm,
        &problem,
        [qv, kv, vv],
        &mut TensorViewMut::contiguous(TensorName::Output, &mut out, ls)?,
        &mut lse,
    )?;
    let mut errs = vec![("out".to_string(), global_rel_l2(comm, "out", &out, &global("out")?)?)];
    if let Some(want) = golden_lse(case, &pos)? {
        errs.push(("lse".into(), global_rel_l2(comm, "lse", &lse, &want)?));
    }
    if case.tensors.contains_key("grad_out") {
        let go = global("grad_out")?;
        let gov = TensorView::contiguous(TensorName::GradOutput, &go, ls)?;
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; ls.numel()], vec![0.0f32; lk.numel()], vec![0.0f32; lk.numel()]);
        let mut dqv = TensorViewMut::contiguous(TensorName::GradQuery, &mut dq, ls)?;
        let mut dkv = TensorViewMut::contiguous(TensorName::GradKey, &mut dk, lk)?;
        let mut dvv = TensorViewMut::contiguous(TensorName::GradValue, &mut dv, lk)?;
        let outs = BackwardOutputs { dq: &mut dqv, dk: &mut dkv, dv: &mut dvv };
        ring_backward(comm, &problem, [qv, kv, vv], gov, outs)?;
        for (name, got) in [("dq", &dq), ("dk", &dk), ("dv", &dv)] {
            errs.push((name.into(), global_rel_l2(comm, name, got, &global(name)?)?));
        }
    }
    Ok(errs)
}

/// The chunk ring (CPU compute, host transport over MPI) on `case`: errors of out, lse,
/// dq, dk, dv.
fn run_chunk_case(comm: &mut MpiComm, case: &GoldenCase, layout: Layout) -> Result<Vec<(String, f64)>, AttnError> {
    let shape = case.attn_shape()?;
    let problem = case_problem(case, layout, Strategy::Auto, comm.world_size(), false)?;
    let rank = comm.rank();
    let pos = layout.positions(shape.q.seq, problem.world, rank);
    let pieces = |name: &str| -> Result<Vec<HostRows<f32>>, AttnError> {
        let t = case.tensor(name)?;
        let v = TensorView::contiguous(TensorName::Other("golden"), &t.data, tensor_shape(case, name)?)?;
        rank_pieces(&problem, rank).into_iter().map(|r| HostRows::from_view_rows(&v, r)).collect()
    };
    let want = |name: &str| golden_rows(case, name, &pos);
    let (q, k, v) = (pieces("q")?, pieces("k")?, pieces("v")?);
    let x = CpuChunks::default();
    // One round under the contiguous layout, three (slices of a piece) under zigzag.
    let opts = ChunkOptions::with_rounds(if layout == Layout::Zigzag { 3 } else { 1 })?;
    let f = chunk_forward(&mut HostTransport::new(comm), &x, &problem, opts, [&q, &k, &v])?;
    let mut errs = vec![("out".to_string(), global_rel_l2(comm, "out", &HostRows::join(&f.out), &want("out")?)?)];
    if let Some(w) = golden_lse(case, &pos)? {
        let lse: Vec<HostRows<f32>> =
            f.lse.iter().map(|l| HostRows { shape: Shape4 { head_dim: 1, ..l.shape }, data: l.to_bsh() }).collect();
        errs.push(("lse".into(), global_rel_l2(comm, "lse", &HostRows::join(&lse), &w)?));
    }
    if case.tensors.contains_key("grad_out") {
        let go = pieces("grad_out")?;
        let g = chunk_backward(&mut HostTransport::new(comm), &x, &problem, opts, [&q, &k, &v], &go, None)?;
        for (name, got) in [("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv)] {
            errs.push((name.into(), global_rel_l2(comm, name, &HostRows::join(got), &want(name)?)?));
        }
    }
    Ok(errs)
}

/// The head strategies run over MPI at `world` ranks: Ulysses, and the hybrid with groups
/// of 2 where that differs from Ulysses.
fn head_strategies(world: usize) -> Vec<Strategy> {
    let mut s = vec![Strategy::Ulysses];
    if world > 2 && world.is_multiple_of(2) {
        s.push(Strategy::Hybrid { ulysses: 2 });
    }
    s
}

/// Every file of `conformance/<dir>` (`expected` of them) through the chunk ring, the
/// three row strategies and the head strategies, both layouts: (runs, failures), one line
/// per failure.
fn golden_runs(comm: &mut MpiComm, dir: &str, expected: usize) -> (usize, usize) {
    let (rank, p) = (comm.rank(), comm.world_size());
    let cases = match load_dir(&golden_dir().join(dir)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rank {rank}: {e}");
            return (0, 1);
        }
    };
    let (mut runs, mut failures) = (0, 0);
    if cases.len() != expected {
        eprintln!("rank {rank}: {} golden files in {dir}, expected {expected}", cases.len());
        failures += 1;
    }
    for (path, case) in cases {
        let Ok(case) = case else {
            eprintln!("rank {rank}: cannot load {}", path.display());
            failures += 1;
            continue;
        };
        let seq = case.attn_shape().map(|s| s.q.seq).unwrap_or(0);
        let bound = Tolerance::golden(attn_core::DType::F32, case.rel_tol().unwrap_or(0.0)).rel_l2;
        for layout in [Layout::Contiguous, Layout::Zigzag] {
            if layout.check(seq, p).is_err() {
                continue;
            }
            // One line per failed run; the count of failures.
            let mut tally = |label: String, res: Result<Vec<(String, f64)>, AttnError>| match res {
                Ok(errs) if errs.iter().all(|(_, e)| *e <= bound) => {}
                Ok(errs) => {
                    failures += 1;
                    eprintln!("rank {rank}: {label}: {errs:?} > {bound}");
                }
                Err(e) => {
                    failures += 1;
                    eprintln!("rank {rank}: {label}: {e}");
                }
            };
            runs += 1;
            tally(format!("chunk ring {dir}/{} {layout:?}", case.name), run_chunk_case(comm, &case, layout));
            for strategy in [Strategy::Auto, Strategy::Ring, Strategy::AllGather] {
                runs += 1;
                let res = run_case(comm, &case, layout, strategy, false);
                tally(format!("{dir}/{} {layout:?} {strategy:?}", case.name), res);
            }
            // The head strategies: a file with fewer heads than the Ulysses degree must be
            // refused as Unsupported (on every rank), any other answer is a failure.
            let heads = case.attn_shape().map(|s| s.q.heads).unwrap_or(0);
            for strategy in head_strategies(p) {
                runs += 1;
                let u = strategy.ulysses_degree(p).unwrap_or(p);
                let res = match (heads < u, run_case(comm, &case, layout, strategy, false)) {
                    (true, Err(AttnError::Unsupported { .. })) => Ok(Vec::new()),
                    (true, other) => Err(AttnError::InvalidArgument(format!(
                        "degree {u} over {heads} heads was not refused as Unsupported: {other:?}"
                    ))),
                    (false, res) => res,
                };
                tally(format!("{dir}/{} {layout:?} {strategy:?}", case.name), res);
            }
        }
    }
    (runs, failures)
}

/// The judge on planted errors in feature files: the ring run without the file's masks
/// must fail the golden bound on out and on a gradient. The failures found, one line each.
fn dropped_masks(comm: &mut MpiComm) -> Vec<String> {
    let mut problems = Vec::new();
    for name in MASKED {
        let path = golden_dir().join("features").join(format!("{name}.safetensors"));
        let case = match GoldenCase::load(&path) {
            Ok(c) => c,
            Err(e) => {
                problems.push(format!("{name}: {e}"));
                continue;
            }
        };
        let bound = Tolerance::golden(attn_core::DType::F32, case.rel_tol().unwrap_or(0.0)).rel_l2;
        match run_case(comm, &case, Layout::Contiguous, Strategy::Auto, true) {
            Ok(errs) => {
                let above = |t: &str| errs.iter().any(|(n, e)| n == t && *e > bound);
                if !(above("out") && above("dq")) {
                    problems.push(format!("{name} without its masks gave {errs:?}, not above {bound}"));
                } else if comm.rank() == 0 {
                    println!("planted: {name} without its masks rejected: {errs:?} > {bound}");
                }
            }
            Err(e) => problems.push(format!("{name} without its masks: {e}")),
        }
    }
    problems
}

fn main() -> ExitCode {
    let Some(universe) = mpi::initialize() else {
        eprintln!("MPI could not be initialised");
        return ExitCode::FAILURE;
    };
    let mut comm = MpiComm::new(universe.world());
    let (rank, p) = (comm.rank(), comm.world_size());
    let (mut runs, mut failures) = (0, 0);
    for problem in planted_errors(&mut comm, Tolerance::for_dtype(attn_core::DType::F32).rel_l2) {
        eprintln!("rank {rank}: planted errors: {problem}");
        failures += 1;
    }
    for (dir, expected) in DIRS {
        let (r, f) = golden_runs(&mut comm, dir, expected);
        runs += r;
        failures += f;
    }
    for problem in dropped_masks(&mut comm) {
        eprintln!("rank {rank}: planted errors: {problem}");
        failures += 1;
    }
    // A config that differs on the last rank is the same typed error everywhere.
    let shape = Shape4::new(1, 4 * p, 2, 4).unwrap_or(Shape4 { batch: 1, seq: 4, heads: 2, head_dim: 4 });
    let causal = rank + 1 == p && p > 1;
    let cfg = attn_core::DilatedConfig::builder().segments(&[8]).dilations(&[1]).causality(causal.into()).build();
    let mismatch = cfg.map(|cfg| {
        let problem = problem_for(&cfg, shape, Layout::Contiguous, Strategy::Auto, p);
        let ls = Shape4 { seq: 4, ..shape };
        let x = vec![0.5f32; ls.numel()];
        let xv = TensorView::contiguous(TensorName::Query, &x, ls);
        let mut out = vec![7.0f32; ls.numel()];
        let mut lse = vec![7.0f32; ls.lse_len()];
        let r = match (xv, TensorViewMut::contiguous(TensorName::Output, &mut out, ls)) {
            (Ok(xv), Ok(mut ov)) => ring_forward(&mut comm, &problem, [xv, xv, xv], &mut ov, &mut lse).map(|_| ()),
            _ => Ok(()),
        };
        (r, out.iter().chain(&lse).all(|&x| x == 7.0))
    });
    match mismatch {
        Ok((Err(AttnError::RankDisagreement(m)), untouched)) if p > 1 && untouched => {
            if rank == 0 {
                println!("mismatched config rejected on every rank: {m}");
            }
        }
        Ok((Ok(()), _)) if p == 1 => {}
        other => {
            failures += 1;
            eprintln!("rank {rank}: mismatched config gave {other:?}");
        }
    }
    // Every file, both layouts (any length splits), every strategy: nothing skipped.
    // Per file and layout: the chunk ring, the three row strategies and the head strategies.
    let expected_runs = DIRS.iter().map(|(_, n)| n).sum::<usize>() * 2 * (1 + 3 + head_strategies(p).len());
    if runs != expected_runs {
        eprintln!("rank {rank}: {runs} golden runs, expected {expected_runs}");
        failures += 1;
    }
    if rank == 0 {
        println!("mpi_ring: world {p}: {runs} golden runs, {failures} failures on rank 0");
    }
    if failures == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
