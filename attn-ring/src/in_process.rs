//! Run a whole problem over `p` in-process ranks (one thread each): split the
//! global tensors by the layout, call the ring functions, and reassemble.

use std::time::Duration;

use attn_core::error::TensorName;
use attn_core::{AttnError, AttnShape, DilatedConfig, Element, Result, Shape4, TensorView, TensorViewMut};

use crate::comm::{Communicator, DEFAULT_TIMEOUT, ThreadComm};
use crate::compute::backward::{BackwardOutputs, ring_backward_with};
use crate::compute::forward::ring_forward_with;
use crate::plan::layout::Layout;
use crate::plan::{RingProblem, Strategy};
use crate::protocol::call::{RingOptions, RingStats};

/// Global output `[batch, seq, heads, head_dim]`, lse `[batch, seq, heads]`, and per-rank stats.
#[derive(Debug, Clone)]
pub struct ForwardResult<T> {
    pub out: Vec<T>,
    pub lse: Vec<f32>,
    pub stats: Vec<RingStats>,
}

/// Global gradients and per-rank stats.
#[derive(Debug, Clone)]
pub struct BackwardResult<T> {
    pub dq: Vec<T>,
    pub dk: Vec<T>,
    pub dv: Vec<T>,
    pub stats: Vec<RingStats>,
}

/// This rank's rows of a global tensor, contiguous (`[batch, positions, heads, head_dim]`).
/// A position outside the tensor's sequence is an `InvalidArgument`.
pub fn local_rows<T: Element>(x: &TensorView<'_, T>, positions: &[usize]) -> Result<Vec<T>> {
    let s = x.shape();
    if let Some(&p) = positions.iter().find(|&&p| p >= s.seq) {
        return Err(AttnError::InvalidArgument(format!("position {p} is outside a sequence of {}", s.seq)));
    }
    // Within the tensor's own size when positions are distinct; checked when they repeat.
    let len = s.with_seq(positions.len().max(1))?.numel();
    let mut out = Vec::with_capacity(if positions.is_empty() { 0 } else { len });
    for b in 0..s.batch {
        for &p in positions {
            for h in 0..s.heads {
                out.extend_from_slice(x.row(b, p, h));
            }
        }
    }
    Ok(out)
}

/// Write a rank's contiguous rows back into a global `[batch, seq, heads, inner]` buffer.
fn put_rows<T: Copy>(global: &mut [T], local: &[T], positions: &[usize], batch: usize, seq: usize, row: usize) {
    let nl = positions.len();
    for b in 0..batch {
        for (i, &p) in positions.iter().enumerate() {
            let src = &local[(b * nl + i) * row..(b * nl + i + 1) * row];
            global[(b * seq + p) * row..(b * seq + p + 1) * row].copy_from_slice(src);
        }
    }
}

/// The problem for global tensors of shape `shape` (self-attention shapes, no masks).
pub fn problem_for(
    cfg: &DilatedConfig,
    shape: Shape4,
    layout: Layout,
    strategy: Strategy,
    world: usize,
) -> RingProblem {
    RingProblem::new(cfg, AttnShape::self_attn(shape), layout, strategy, world)
}

/// The global shapes of q and k (k and v may have fewer heads).
fn global_shape<T: Element>(q: &TensorView<'_, T>, k: &TensorView<'_, T>) -> AttnShape {
    AttnShape { q: q.shape(), kv: k.shape() }
}

/// One rank's forward result.
pub type RankForward<T> = Result<(Vec<T>, Vec<f32>, RingStats)>;

/// Run the forward on the given communicators (one thread per rank) and return
/// each rank's own result, errors included (for fault tests).
pub fn forward_on<C: Communicator + Send, T: Element>(
    comms: Vec<C>,
    problem: &RingProblem,
    q: TensorView<'_, T>,
    k: TensorView<'_, T>,
    v: TensorView<'_, T>,
) -> Vec<RankForward<T>> {
    forward_on_with(comms, problem, &RingOptions::default(), [q, k, v])
}

/// [`forward_on`] with [`RingOptions`] on every rank.
pub fn forward_on_with<C: Communicator + Send, T: Element>(
    comms: Vec<C>,
    problem: &RingProblem,
    opts: &RingOptions,
    qkv: [TensorView<'_, T>; 3],
) -> Vec<RankForward<T>> {
    let [q, k, v] = qkv;
    let p = comms.len();
    if let Some(errs) = refuse(p, || check_world(&comms, problem, &[q, k, v])) {
        return errs;
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                scope.spawn(move || -> RankForward<T> {
                    let rank = comm.rank();
                    let pos = problem.layout.positions(problem.seq, p, rank);
                    let shape = q.shape().with_seq(pos.len().max(1))?;
                    let kv_shape = k.shape().with_seq(pos.len().max(1))?;
                    let (lq, lk, lv) = (local_rows(&q, &pos)?, local_rows(&k, &pos)?, local_rows(&v, &pos)?);
                    let mut out = vec![T::default(); shape.numel()];
                    let mut lse = vec![0.0f32; shape.lse_len()];
                    let mut ov = TensorViewMut::contiguous(TensorName::Output, &mut out, shape)?;
                    let qv = TensorView::contiguous(TensorName::Query, &lq, shape)?;
                    let kv = TensorView::contiguous(TensorName::Key, &lk, kv_shape)?;
                    let vv = TensorView::contiguous(TensorName::Value, &lv, kv_shape)?;
                    let stats = ring_forward_with(&mut comm, problem, opts, [qv, kv, vv], &mut ov, &mut lse)?;
                    Ok((out, lse, stats))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(panicked()))).collect()
    })
}

/// What the rank threads rely on, checked before any is spawned: the layout gives
/// each of the `p` ranks a row, the communicators are ranks `0..p` of one world of `p`
/// in rank order (results are returned, and reassembled, by index), and every global
/// tensor (q, k, v, then grad_out) has the problem's shape.
fn check_world<C: Communicator, T: Element>(
    comms: &[C],
    problem: &RingProblem,
    tensors: &[TensorView<'_, T>],
) -> Result<()> {
    let p = comms.len();
    problem.layout.check(problem.seq, p)?;
    if let Some((i, c)) = comms.iter().enumerate().find(|(i, c)| c.rank() != *i || c.world_size() != p) {
        return Err(AttnError::InvalidArgument(format!(
            "communicator {i} of {p} is rank {} of a world of {}: pass one communicator per rank, in rank order",
            c.rank(),
            c.world_size()
        )));
    }
    // Keys and values of one length other than the queries' are cross-attention, which the
    // ring does not split (anything else unlike the problem is a shape mismatch).
    if let [q, k, v, ..] = tensors
        && k.shape() == v.shape()
        && k.shape().seq != q.shape().seq
        && q.shape().seq == problem.seq
        && k.shape().with_seq(q.shape().seq).ok() == Some(Shape4 { heads: problem.kv_heads, ..q.shape() })
    {
        return Err(crate::backend::cross_attention_refused());
    }
    let names = [TensorName::Query, TensorName::Key, TensorName::Value, TensorName::GradOutput];
    for (t, tensor) in tensors.iter().zip(names) {
        let heads =
            if matches!(tensor, TensorName::Key | TensorName::Value) { problem.kv_heads } else { problem.heads };
        let expected = vec![problem.batch, problem.seq, heads, problem.head_dim];
        let got = t.shape().dims().to_vec();
        if got != expected {
            return Err(AttnError::ShapeMismatch { tensor, expected, got });
        }
    }
    Ok(())
}

/// The same error for each of `p` ranks when `check` fails (it is deterministic).
fn refuse<R>(p: usize, check: impl Fn() -> Result<()>) -> Option<Vec<Result<R>>> {
    check().err()?;
    Some((0..p).filter_map(|_| check().err()).map(Err).collect())
}

fn panicked() -> AttnError {
    AttnError::Comm { rank: usize::MAX, message: "a rank thread panicked".into() }
}

/// Forward over `world` in-process ranks; equals the single-device result.
pub fn run_in_process<T: Element>(
    world: usize,
    cfg: &DilatedConfig,
    layout: Layout,
    strategy: Strategy,
    q: TensorView<'_, T>,
    k: TensorView<'_, T>,
    v: TensorView<'_, T>,
) -> Result<ForwardResult<T>> {
    run_in_process_with_timeout(world, cfg, layout, strategy, [q, k, v], DEFAULT_TIMEOUT)
}

/// [`run_in_process`] with an explicit per-message timeout.
pub fn run_in_process_with_timeout<T: Element>(
    world: usize,
    cfg: &DilatedConfig,
    layout: Layout,
    strategy: Strategy,
    qkv: [TensorView<'_, T>; 3],
    timeout: Duration,
) -> Result<ForwardResult<T>> {
    layout.check(qkv[0].shape().seq, world)?;
    run_on(ThreadComm::world_with_timeout(world, timeout)?, cfg, layout, strategy, qkv)
}

/// Forward over the given communicators (one thread per rank, any transport),
/// reassembled into global tensors; the first rank's error if any rank fails.
pub fn run_on<C: Communicator + Send, T: Element>(
    comms: Vec<C>,
    cfg: &DilatedConfig,
    layout: Layout,
    strategy: Strategy,
    qkv: [TensorView<'_, T>; 3],
) -> Result<ForwardResult<T>> {
    let problem = RingProblem::new(cfg, global_shape(&qkv[0], &qkv[1]), layout, strategy, comms.len());
    run_problem_on(comms, &problem, qkv)
}

/// [`run_on`] for a whole [`RingProblem`] (masks included).
pub fn run_problem_on<C: Communicator + Send, T: Element>(
    comms: Vec<C>,
    problem: &RingProblem,
    qkv: [TensorView<'_, T>; 3],
) -> Result<ForwardResult<T>> {
    let [q, k, v] = qkv;
    let (shape, world, layout) = (q.shape(), comms.len(), problem.layout);
    let results = forward_on(comms, problem, q, k, v);
    let mut out = vec![T::default(); shape.numel()];
    let mut lse = vec![0.0f32; shape.lse_len()];
    let mut stats = Vec::with_capacity(world);
    for (rank, res) in results.into_iter().enumerate() {
        let (lo, ll, st) = res?;
        let pos = layout.positions(shape.seq, world, rank);
        put_rows(&mut out, &lo, &pos, shape.batch, shape.seq, shape.heads * shape.head_dim);
        put_rows(&mut lse, &ll, &pos, shape.batch, shape.seq, shape.heads);
        stats.push(st);
    }
    Ok(ForwardResult { out, lse, stats })
}

/// One rank's backward result: its rows of dq, dk, dv.
pub type RankBackward<T> = Result<([Vec<T>; 3], RingStats)>;

/// Run the backward on the given communicators (one thread per rank) and return
/// each rank's own result, errors included (for fault tests).
pub fn backward_on<C: Communicator + Send, T: Element>(
    comms: Vec<C>,
    problem: &RingProblem,
    qkv: [TensorView<'_, T>; 3],
    grad_out: TensorView<'_, T>,
) -> Vec<RankBackward<T>> {
    backward_on_with(comms, problem, &RingOptions::default(), qkv, grad_out)
}

/// [`backward_on`] with [`RingOptions`] on every rank.
pub fn backward_on_with<C: Communicator + Send, T: Element>(
    comms: Vec<C>,
    problem: &RingProblem,
    opts: &RingOptions,
    qkv: [TensorView<'_, T>; 3],
    grad_out: TensorView<'_, T>,
) -> Vec<RankBackward<T>> {
    let p = comms.len();
    let [q, k, v] = qkv;
    if let Some(errs) = refuse(p, || check_world(&comms, problem, &[q, k, v, grad_out])) {
        return errs;
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                scope.spawn(move || -> RankBackward<T> {
                    let pos = problem.layout.positions(problem.seq, p, comm.rank());
                    let ls = q.shape().with_seq(pos.len().max(1))?;
                    let lkv = k.shape().with_seq(pos.len().max(1))?;
                    let bufs =
                        [&q, &k, &v, &grad_out].iter().map(|x| local_rows(x, &pos)).collect::<Result<Vec<Vec<T>>>>()?;
                    let views = bufs
                        .iter()
                        .zip([ls, lkv, lkv, ls])
                        .map(|(b, s)| TensorView::contiguous(TensorName::Other("local"), b, s))
                        .collect::<Result<Vec<_>>>()?;
                    let mut g = [
                        vec![T::default(); ls.numel()],
                        vec![T::default(); lkv.numel()],
                        vec![T::default(); lkv.numel()],
                    ];
                    let [gq, gk, gv] = &mut g;
                    let mut dq = TensorViewMut::contiguous(TensorName::GradQuery, gq, ls)?;
                    let mut dk = TensorViewMut::contiguous(TensorName::GradKey, gk, lkv)?;
                    let mut dv = TensorViewMut::contiguous(TensorName::GradValue, gv, lkv)?;
                    let outs = BackwardOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv };
                    let stats = ring_backward_with(
                        &mut comm,
                        problem,
                        opts,
                        [views[0], views[1], views[2]],
                        views[3],
                        None,
                        outs,
                    )?;
                    Ok((g, stats))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(panicked()))).collect()
    })
}

/// Gradients over `world` in-process ranks.
pub fn run_in_process_backward<T: Element>(
    world: usize,
    cfg: &DilatedConfig,
    layout: Layout,
    strategy: Strategy,
    qkv: [TensorView<'_, T>; 3],
    grad_out: TensorView<'_, T>,
) -> Result<BackwardResult<T>> {
    layout.check(qkv[0].shape().seq, world)?;
    run_backward_on(ThreadComm::world_with_timeout(world, DEFAULT_TIMEOUT)?, cfg, layout, strategy, qkv, grad_out)
}

/// Gradients over the given communicators (one thread per rank, any transport),
/// reassembled into global tensors; the first rank's error if any rank fails.
pub fn run_backward_on<C: Communicator + Send, T: Element>(
    comms: Vec<C>,
    cfg: &DilatedConfig,
    layout: Layout,
    strategy: Strategy,
    qkv: [TensorView<'_, T>; 3],
    grad_out: TensorView<'_, T>,
) -> Result<BackwardResult<T>> {
    let problem = RingProblem::new(cfg, global_shape(&qkv[0], &qkv[1]), layout, strategy, comms.len());
    run_problem_backward_on(comms, &problem, qkv, grad_out)
}

/// [`run_backward_on`] for a whole [`RingProblem`] (masks included).
pub fn run_problem_backward_on<C: Communicator + Send, T: Element>(
    comms: Vec<C>,
    problem: &RingProblem,
    qkv: [TensorView<'_, T>; 3],
    grad_out: TensorView<'_, T>,
) -> Result<BackwardResult<T>> {
    let (shape, kv, world, layout) = (qkv[0].shape(), qkv[1].shape(), comms.len(), problem.layout);
    let results = backward_on(comms, problem, qkv, grad_out);
    let (row, kv_row) = (shape.heads * shape.head_dim, kv.heads * kv.head_dim);
    let mut res = BackwardResult {
        dq: vec![T::default(); shape.numel()],
        dk: vec![T::default(); kv.numel()],
        dv: vec![T::default(); kv.numel()],
        stats: Vec::with_capacity(world),
    };
    for (rank, r) in results.into_iter().enumerate() {
        let ([gq, gk, gv], st) = r?;
        let pos = layout.positions(shape.seq, world, rank);
        put_rows(&mut res.dq, &gq, &pos, shape.batch, shape.seq, row);
        put_rows(&mut res.dk, &gk, &pos, shape.batch, shape.seq, kv_row);
        put_rows(&mut res.dv, &gv, &pos, shape.batch, shape.seq, kv_row);
        res.stats.push(st);
    }
    Ok(res)
}
