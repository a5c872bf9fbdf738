//! Distributed exact backward: k/v blocks travel as in the forward, each rank adds
//! its share of dk/dv to the visiting block, and the dk/dv partials travel on and
//! then home to the owner (ring) or straight back (all-gather).

use attn_core::error::TensorName;
use attn_core::{AttnError, Element, Result, Shape4, TensorView, TensorViewMut};

use crate::comm::Communicator;
use crate::compute::forward::{Partial, all_pairs, forward_core, restep};
use crate::compute::head_work::for_each_item;
use crate::compute::kernel_bridge::{GradRows, attend_backward};
use crate::compute::rank_rows::{Block, Local, head_rows, mask_of};
use crate::compute::ulysses::heads_backward;
use crate::plan::ring_route::Way;
use crate::plan::{PatternHead, Plan, RingProblem};
use crate::protocol::call::{Prepared, RingOptions, RingStats, check_out, finish_with, global_index, prepare};
use crate::protocol::wire::{Expected, MsgKind, Reader, begin, put_f32s};

/// dq per (batch, query head), dk and dv per (batch, key/value head), `[rows, d]` each.
#[derive(Debug)]
pub(crate) struct Grads {
    pub dq: Vec<Vec<f32>>,
    pub dk: Vec<Vec<f32>>,
    pub dv: Vec<Vec<f32>>,
}

/// dk/dv of one block, per (batch, pair) like [`Block`].
#[derive(Debug)]
struct BlockGrads {
    dk: Vec<Vec<f32>>,
    dv: Vec<Vec<f32>>,
}

impl BlockGrads {
    fn zeros<T>(blk: &Block<T>, d: usize, batch: usize) -> Self {
        let sizes: Vec<usize> = (0..batch).flat_map(|_| blk.pos.iter().map(|p| p.len() * d)).collect();
        BlockGrads {
            dk: sizes.iter().map(|&n| vec![0.0; n]).collect(),
            dv: sizes.iter().map(|&n| vec![0.0; n]).collect(),
        }
    }

    fn encode(&self, kind: MsgKind, owner: usize, step: usize) -> Vec<u8> {
        let n = self.dk.iter().map(Vec::len).sum::<usize>() * 8;
        let mut out = begin(kind, owner, step, n);
        for (k, v) in self.dk.iter().zip(&self.dv) {
            put_f32s(&mut out, k);
            put_f32s(&mut out, v);
        }
        out
    }

    /// Add a received message's dk/dv into these.
    fn add_from(&mut self, bytes: &[u8], kind: MsgKind, owner: usize, step: usize, rank: usize) -> Result<()> {
        let mut rd = Reader::open(bytes, Expected { kind, owner, step, rank })?;
        let mut buf = Vec::new();
        for (k, v) in self.dk.iter_mut().zip(self.dv.iter_mut()) {
            for dst in [k, v] {
                buf.clear();
                rd.f32s(dst.len(), &mut buf)?;
                dst.iter_mut().zip(&buf).for_each(|(a, b)| *a += b);
            }
        }
        rd.finish()
    }
}

/// One pair's dk/dv of a block: (pair index, dk, dv).
type PairGrads<'a> = (usize, &'a mut Vec<f32>, &'a mut Vec<f32>);

fn scatter_add(dst: &mut [f32], idx: &[usize], src: &[f32], d: usize) {
    for (n, &j) in idx.iter().enumerate() {
        dst[j * d..(j + 1) * d].iter_mut().zip(&src[n * d..(n + 1) * d]).for_each(|(a, b)| *a += b);
    }
}

struct Ctx<'a, T> {
    plan: &'a Plan,
    local: &'a Local<'a, T>,
    lse: &'a [Vec<f32>],
    grad_out: &'a TensorView<'a, T>,
    /// `out_scale` per head.
    scales: Vec<f32>,
    delta: Vec<Vec<f32>>,
    threads: usize,
}

impl<T: Element> Ctx<'_, T> {
    fn grad_rows(&self, bh: usize) -> GradRows<'_, T> {
        let (b, h) = (bh / self.local.heads, bh % self.local.heads);
        let (go, go_stride) = head_rows(self.grad_out, b, h);
        GradRows { lse: &self.lse[bh], go, go_stride, go_scale: self.scales[h], delta: &self.delta[bh] }
    }

    /// This rank's share of the gradients of `blk` (wire pairs `pairs`); dq accumulates
    /// in place. Work items are (batch, key/value head)s: dk/dv of its pairs in the block
    /// and dq of the query heads reading them.
    fn block_backward(&self, pairs: &[PatternHead], blk: &Block<T>, dq: &mut [Vec<f32>]) -> Result<BlockGrads> {
        let local = self.local;
        let (group, d) = (local.group(), local.d);
        let mut bg = BlockGrads::zeros(blk, d, local.batch);
        let mut slots: Vec<Vec<PairGrads<'_>>> = (0..local.batch * local.kv_heads).map(|_| Vec::new()).collect();
        for (j, (dk, dv)) in bg.dk.iter_mut().zip(bg.dv.iter_mut()).enumerate() {
            let (b, i) = (j / pairs.len(), j % pairs.len());
            slots[local.kv_bh(b, pairs[i].head)].push((i, dk, dv));
        }
        let items = dq.chunks_mut(group).zip(slots).enumerate().filter(|(_, (_, s))| !s.is_empty()).collect();
        for_each_item(self.threads, items, |(kbh, (dqs, slots))| {
            let (b, kvh) = (kbh / local.kv_heads, kbh % local.kv_heads);
            for (i, dk, dv) in slots {
                for (g, dq) in dqs.iter_mut().enumerate().filter(|(g, _)| self.plan.reads(kvh * group + g, &pairs[i])) {
                    let bh = local.bh(b, kvh * group + g);
                    let m = mask_of(self.plan, &pairs[i], b, kvh * group + g);
                    attend_backward(local.q_rows(bh), blk.keys(b, i, d), m, self.grad_rows(bh), dq, dk, dv)?;
                }
            }
            Ok(())
        })?;
        Ok(bg)
    }

    /// Add a block's dk/dv into this rank's own rows at the block's positions.
    fn scatter_home(&self, pairs: &[PatternHead], pos: &[Vec<usize>], bg: &BlockGrads, grads: &mut Grads) {
        let local = self.local;
        for (i, ph) in pairs.iter().enumerate() {
            let idx = local.indices(&pos[i]);
            for b in 0..local.batch {
                let (kbh, j) = (local.kv_bh(b, ph.head), b * pairs.len() + i);
                scatter_add(&mut grads.dk[kbh], &idx, &bg.dk[j], local.d);
                scatter_add(&mut grads.dv[kbh], &idx, &bg.dv[j], local.d);
            }
        }
    }
}

/// The backward on this rank, given the forward's output and lse. The forward's f32
/// output is needed only for `delta = grad_out . out - grad_lse`: it is dropped before the f32
/// dq, dk and dv accumulators exist. grad_out is read in place from the caller's view
/// (the kernels apply the head's `out_scale`). Blocks' compute is split by (batch,
/// head) over `threads`.
pub(crate) fn backward_core<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    plan: &Plan,
    local: &Local<'_, T>,
    fwd: Partial,
    grad_out: &TensorView<'_, T>,
    grad_lse: Option<&[f32]>,
    threads: usize,
) -> Result<Grads> {
    let (r, p) = (comm.rank(), plan.problem.world);
    let (nl, d, batch) = (local.rows(), local.d, local.batch);
    let Partial { o, lse } = fwd;
    let mut delta = Vec::with_capacity(o.len());
    for b in 0..batch {
        for head in 0..local.heads {
            let bh = local.bh(b, head);
            let row_delta = |i: usize| {
                let (go, o) = (grad_out.row(b, i, head), &o[bh][i * d..(i + 1) * d]);
                let dot = go.iter().zip(o).map(|(x, y)| x.to_f32() * y).sum::<f32>();
                // A gradient into the LSE lowers delta, on rows that attend something.
                match grad_lse {
                    Some(g) if lse[bh][i].is_finite() => dot - g[(b * nl + i) * local.heads + head],
                    _ => dot,
                }
            };
            delta.push((0..nl).map(row_delta).collect::<Vec<f32>>());
        }
    }
    drop(o);
    let scales = plan.out_scales();
    let ctx = Ctx { plan, local, lse: &lse, grad_out, scales, delta, threads };
    let zeros = |heads: usize| vec![vec![0.0f32; nl * d]; batch * heads];
    let mut grads = Grads { dq: zeros(local.heads), dk: zeros(local.kv_heads), dv: zeros(local.kv_heads) };

    // All-gather patterns: k/v out, dk/dv back.
    let gh = &plan.gather_heads;
    let dests: Vec<usize> = (0..p).filter(|&x| plan.gather_need(r, x)).collect();
    let sends = dests
        .iter()
        .map(|&x| {
            let pos: Vec<Vec<usize>> = gh.iter().map(|ph| plan.gather_positions(r, x, ph)).collect();
            (x, local.encode_rows(gh, &pos, MsgKind::GatherKv, r, 0))
        })
        .collect();
    let srcs: Vec<usize> = (0..p).filter(|&x| plan.gather_need(x, r)).collect();
    let gathered = comm.exchange(sends, &srcs)?;
    let mut back = Vec::with_capacity(srcs.len());
    for (&src, bytes) in srcs.iter().zip(gathered) {
        let pos = gh.iter().map(|ph| plan.gather_positions(src, r, ph)).collect();
        let blk = Block::<T>::decode(
            &bytes,
            Expected { kind: MsgKind::GatherKv, owner: src, step: 0, rank: r },
            batch,
            d,
            pos,
        )?;
        let bg = ctx.block_backward(gh, &blk, &mut grads.dq)?;
        back.push((src, bg.encode(MsgKind::GatherGrad, src, 0)));
    }
    let returned = comm.exchange(back, &dests)?;
    for (&x, bytes) in dests.iter().zip(returned) {
        let pos: Vec<Vec<usize>> = gh.iter().map(|ph| plan.gather_positions(r, x, ph)).collect();
        let shape = Block::<T> { pos: pos.clone(), k: Vec::new(), v: Vec::new() };
        let mut bg = BlockGrads::zeros(&shape, d, batch);
        bg.add_from(&bytes, MsgKind::GatherGrad, r, 0, r)?;
        ctx.scatter_home(gh, &pos, &bg, &mut grads);
    }

    // Ring: post this rank's block before computing. Levels as in `forward_core`: what
    // this rank posts at step t-1 (the block passed on, then its partial gradients) the
    // next rank receives at step t in one exchange, which this rank's exchange (or flush)
    // at step t carries; gradients going home travel at one extra level after the loop.
    let rh = &plan.ring_heads;
    let mut posted = false;
    for way in Way::BOTH.into_iter().filter(|&w| plan.hops_of(w, r) >= 1) {
        let pos: Vec<Vec<usize>> = rh.iter().map(|ph| plan.ring_positions(way, r, ph)).collect();
        let blk = local.encode_rows(rh, &pos, MsgKind::RingKv, r, 1);
        comm.post(vec![(way.step(r, 1, p), blk)])?;
        posted = true;
    }

    // Own rows, every pattern of every head, one (batch, key/value head) per work item:
    // its dk/dv and the dq of the query heads reading it.
    let pairs = all_pairs(plan);
    let group = local.group();
    let Grads { dq, dk, dv } = &mut grads;
    let items = dq.chunks_mut(group).zip(dk.iter_mut()).zip(dv.iter_mut()).enumerate().collect();
    for_each_item(threads, items, |(kbh, ((dqs, dk), dv))| {
        let (b, kvh) = (kbh / local.kv_heads, kbh % local.kv_heads);
        for (g, dq) in dqs.iter_mut().enumerate() {
            let (h, bh) = (kvh * group + g, local.bh(b, kvh * group + g));
            for (ph, _) in pairs.iter().filter(|(ph, _)| ph.head == h) {
                let m = mask_of(plan, ph, b, h);
                attend_backward(local.q_rows(bh), local.own_keys(bh), m, ctx.grad_rows(bh), dq, dk, dv)?;
            }
        }
        Ok(())
    })?;

    let mut home = Vec::new();
    for t in 1..=plan.ring_steps() {
        let arriving = plan.ring_arrivals(r, t);
        if arriving.is_empty() {
            if std::mem::take(&mut posted) {
                comm.flush()?;
            }
            continue;
        }
        posted = false;
        // Each block, and from step 2 on the partial gradients of the ranks it has passed.
        let frames = if t >= 2 { 2 } else { 1 };
        let from: Vec<usize> =
            arriving.iter().flat_map(|&(way, _)| std::iter::repeat_n(way.owner_at(r, 1, p), frames)).collect();
        let mut got = comm.exchange(Vec::new(), &from)?.into_iter();
        for &(way, owner) in &arriving {
            let hops = plan.hops_of(way, owner);
            let bytes = got.next().unwrap_or_default();
            let pos = rh.iter().map(|ph| plan.ring_positions(way, owner, ph)).collect();
            let expected = Expected { kind: MsgKind::RingKv, owner, step: t, rank: r };
            let blk = Block::<T>::decode(&bytes, expected, batch, d, pos)?;
            let onward = way.step(r, 1, p);
            if t < hops {
                comm.post(vec![(onward, restep(bytes, t + 1))])?;
                posted = true;
            } else {
                drop(bytes);
            }
            let mut bg = if plan.ring_need(owner, r) {
                ctx.block_backward(rh, &blk, &mut grads.dq)?
            } else {
                BlockGrads::zeros(&blk, d, batch)
            };
            if t >= 2 {
                bg.add_from(&got.next().unwrap_or_default(), MsgKind::RingGrad, owner, t, r)?;
            }
            if t < hops {
                comm.post(vec![(onward, bg.encode(MsgKind::RingGrad, owner, t + 1))])?;
            } else {
                home.push((owner, bg.encode(MsgKind::RingGradHome, owner, t)));
            }
        }
    }
    // Gradients come home from the last holder of each way's block.
    let ways: Vec<Way> = Way::BOTH.into_iter().filter(|&w| plan.hops_of(w, r) >= 1).collect();
    let from: Vec<usize> = ways.iter().map(|&w| w.step(r, plan.hops_of(w, r), p)).collect();
    let got = comm.exchange(home, &from)?;
    for (&way, bytes) in ways.iter().zip(got) {
        let pos: Vec<Vec<usize>> = rh.iter().map(|ph| plan.ring_positions(way, r, ph)).collect();
        let shape = Block::<T> { pos: pos.clone(), k: Vec::new(), v: Vec::new() };
        let mut bg = BlockGrads::zeros(&shape, d, batch);
        bg.add_from(&bytes, MsgKind::RingGradHome, r, plan.hops_of(way, r), r)?;
        ctx.scatter_home(rh, &pos, &bg, &mut grads);
    }
    Ok(grads)
}

/// `NonFinite` (global index) for the first value of `grad_lse` (`[batch, rows, heads]`)
/// that is not finite on a row whose LSE is finite; a row that attends nothing takes no
/// gradient from its LSE, whatever the value.
fn finite_where_attended<T: Element>(
    problem: &RingProblem,
    rank: usize,
    local: &Local<'_, T>,
    lse: &[Vec<f32>],
    grad_lse: &[f32],
) -> Result<()> {
    let (nl, heads) = (local.rows(), local.heads);
    // grad_lse is `[batch, rows, heads]`; lse one `[rows]` list per (batch, head).
    let attended = |at: usize| {
        let (head, i, b) = (at % heads, (at / heads) % nl, at / (heads * nl));
        lse[local.bh(b, head)][i].is_finite()
    };
    match grad_lse.iter().enumerate().find(|&(at, g)| !g.is_finite() && attended(at)) {
        Some((at, _)) => {
            let rows = Shape4 { batch: local.batch, seq: nl, heads, head_dim: 1 };
            Err(AttnError::NonFinite { tensor: TensorName::GradLse, index: global_index(problem, rank, rows, at) })
        }
        None => Ok(()),
    }
}

/// This rank's gradient views (its rows of dq, dk and dv), written only once every rank
/// has agreed in the completion step.
#[derive(Debug)]
pub struct BackwardOutputs<'a, 'b, T> {
    pub dq: &'a mut TensorViewMut<'b, T>,
    pub dk: &'a mut TensorViewMut<'b, T>,
    pub dv: &'a mut TensorViewMut<'b, T>,
}

/// Exact gradients of `sum(out * grad_out)` with the sequence split over `comm`'s ranks.
///
/// Recomputes the forward (with the same communication), then runs the backward.
/// Shapes and guarantees as in [`crate::ring_forward`]; `grad_out` has q's shape and
/// `dq`, `dk`, `dv` receive this rank's rows. [`ring_backward_with`] adds a memory
/// budget and a finite-input check.
pub fn ring_backward<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    problem: &RingProblem,
    qkv: [TensorView<'_, T>; 3],
    grad_out: TensorView<'_, T>,
    grads: BackwardOutputs<'_, '_, T>,
) -> Result<RingStats> {
    ring_backward_with(comm, problem, &RingOptions::default(), qkv, grad_out, None, grads)
}

/// [`ring_backward`] with the opt-in checks of [`crate::ring_forward_with`] (the
/// finite check covers grad_out too, and grad_lse on the rows that attend something,
/// judged after the exchanges and shared in the completion step) and a gradient into the
/// LSE: the gradients of
/// `sum(out * grad_out) + sum(lse * grad_lse)`, `grad_lse` this rank's `[batch, rows,
/// heads]` like the forward's lse (`None` for zeros; a wrong length is every rank's
/// error). On a refusal `dq`, `dk`, `dv` are untouched.
pub fn ring_backward_with<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    problem: &RingProblem,
    opts: &RingOptions,
    qkv: [TensorView<'_, T>; 3],
    grad_out: TensorView<'_, T>,
    grad_lse: Option<&[f32]>,
    grads: BackwardOutputs<'_, '_, T>,
) -> Result<RingStats> {
    let [q, k, v] = qkv;
    let BackwardOutputs { dq, dk, dv } = grads;
    let outs = [
        (TensorName::GradOutput, grad_out.shape()),
        (TensorName::GradQuery, dq.shape()),
        (TensorName::GradKey, dk.shape()),
        (TensorName::GradValue, dv.shape()),
    ];
    let extra = check_out(problem, comm.rank(), &outs, grad_lse.map(|g| (TensorName::GradLse, g.len())));
    let problem = &*crate::plan::choose::resolved(problem);
    if crate::plan::choose::runs_heads(problem) {
        return heads_backward(comm, problem, opts, ([q, k, v], grad_out, grad_lse), [dq, dk, dv], extra);
    }
    let Prepared { plan, local, start } = prepare(comm, "backward", problem, opts, [q, k, v], Some(grad_out), extra)?;
    let fwd = forward_core::<C, T>(comm, &plan, &local, opts.threads)?;
    // Which rows attend something is known only now: the finite check of grad_lse is this
    // rank's verdict in the completion step (the exchanges below run either way).
    let verdict = match grad_lse {
        Some(g) if opts.check_finite => finite_where_attended(problem, comm.rank(), &local, &fwd.lse, g),
        _ => Ok(()),
    };
    let g = backward_core::<C, T>(comm, &plan, &local, fwd, &grad_out, grad_lse, opts.threads)?;
    let stats = finish_with(comm, start, verdict)?;
    let d = local.d;
    for (dst, src, heads) in [(dq, &g.dq, local.heads), (dk, &g.dk, local.kv_heads), (dv, &g.dv, local.kv_heads)] {
        for b in 0..local.batch {
            for head in 0..heads {
                let bh = b * heads + head;
                for i in 0..local.rows() {
                    let row = dst.row_mut(b, i, head);
                    row.iter_mut().zip(&src[bh][i * d..(i + 1) * d]).for_each(|(x, &y)| *x = T::from_f32(y));
                }
            }
        }
    }
    Ok(stats)
}
