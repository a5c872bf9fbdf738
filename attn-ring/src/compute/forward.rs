//! Distributed forward: local patterns, all-gathered blocks and ring blocks are
//! LSE-merged into per-row accumulators; `ring_forward` is the public entry.

use attn_core::error::TensorName;
use attn_core::{Element, Result, TensorView, TensorViewMut};

use crate::comm::Communicator;
use crate::compute::allgather_forward::{forward_direct, gather_partials};
use crate::compute::head_work::for_each_item;
use crate::compute::kernel_bridge::{KeyBlock, attend_forward};
use crate::compute::rank_rows::{Block, Local, RawBlock, mask_of};
use crate::compute::ulysses::heads_forward;
use crate::plan::ring_route::Way;
use crate::plan::{PatternHead, Plan, RingProblem};
use crate::protocol::call::{Prepared, RingOptions, RingStats, check_out, finish, prepare};
use crate::protocol::wire::{Expected, MsgKind, Reader};

/// Final output (already scaled by the head's `out_scale`) and lse per (batch, head).
#[derive(Debug)]
pub(crate) struct Partial {
    pub o: Vec<Vec<f32>>,
    pub lse: Vec<Vec<f32>>,
}

/// Every (pattern, head) pair each head runs, with the head's out_scale.
pub(crate) fn all_pairs(plan: &Plan) -> Vec<(PatternHead, f32)> {
    let pr = &plan.problem;
    (0..pr.heads)
        .flat_map(|head| {
            let hp = pr.cfg.head_patterns(pr.heads, head);
            let s = hp.out_scale as f32;
            hp.patterns.into_iter().map(move |(pattern, pat)| (PatternHead { pattern, head, pat }, s))
        })
        .collect()
}

/// Replace the step field of a data message header (for forwarding a block).
pub(crate) fn restep(mut bytes: Vec<u8>, step: usize) -> Vec<u8> {
    if bytes.len() >= 9 {
        bytes[5..9].copy_from_slice(&(step as u32).to_le_bytes());
    }
    bytes
}

/// All-gather patterns: one direct exchange with the ranks sharing segments; the
/// blocks received, checked, kept as bytes until used.
fn gather_blocks<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    plan: &Plan,
    local: &Local<'_, T>,
) -> Result<Vec<RawBlock>> {
    let (r, p) = (comm.rank(), plan.problem.world);
    let gh = &plan.gather_heads;
    let sends = (0..p)
        .filter(|&x| plan.gather_need(r, x))
        .map(|x| {
            let pos: Vec<Vec<usize>> = gh.iter().map(|ph| plan.gather_positions(r, x, ph)).collect();
            (x, local.encode_rows(gh, &pos, MsgKind::GatherKv, r, 0))
        })
        .collect();
    let srcs: Vec<usize> = (0..p).filter(|&x| plan.gather_need(x, r)).collect();
    let gathered = comm.exchange(sends, &srcs)?;
    let mut blocks = Vec::with_capacity(srcs.len());
    for (&src, bytes) in srcs.iter().zip(gathered) {
        let pos = gh.iter().map(|ph| plan.gather_positions(src, r, ph)).collect();
        blocks.push(RawBlock::new::<T>(
            bytes,
            Expected { kind: MsgKind::GatherKv, owner: src, step: 0, rank: r },
            local.batch,
            local.d,
            pos,
        )?);
    }
    Ok(blocks)
}

/// The forward on this rank: every message of the plan, every block merged; the
/// blocks' compute split by (batch, head) over `threads`.
pub(crate) fn forward_core<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    plan: &Plan,
    local: &Local<'_, T>,
    threads: usize,
) -> Result<Partial> {
    let (r, p) = (comm.rank(), plan.problem.world);
    let (nl, d, batch) = (local.rows(), local.d, local.batch);
    let mut o = vec![vec![0.0f32; nl * d]; batch * local.heads];
    let mut lse = vec![vec![f32::NEG_INFINITY; nl]; batch * local.heads];

    let gh = &plan.gather_heads;
    let gathered: Vec<Block<T>> =
        gather_blocks(comm, plan, local)?.into_iter().map(|raw| Block::from_raw(&raw, local.batch, local.d)).collect();

    // Ring: post this rank's blocks (one per way it travels) before computing anything.
    // Every frame posted before step t is received by its neighbour at step t, and this
    // rank's exchange (or flush) at step t carries it: one level per step (see
    // `comm::grouped`).
    let mut posted = false;
    for way in Way::BOTH.into_iter().filter(|&w| plan.hops_of(w, r) >= 1) {
        let pos: Vec<Vec<usize>> = plan.ring_heads.iter().map(|ph| plan.ring_positions(way, r, ph)).collect();
        let blk = local.encode_rows(&plan.ring_heads, &pos, MsgKind::RingKv, r, 1);
        comm.post(vec![(way.step(r, 1, p), blk)])?;
        posted = true;
    }
    // Own rows, every pattern of every head.
    let own: Vec<PatternHead> = all_pairs(plan).into_iter().map(|(ph, _)| ph).collect();
    let accs = (&mut o[..], &mut lse[..]);
    merge_pairs(plan, local, (&own, Pairs::Query), accs, threads, |bh, _| local.own_keys(bh))?;

    for blk in &gathered {
        let keys = |bh: usize, i| blk.keys(bh / local.heads, i, d);
        merge_pairs(plan, local, (gh, Pairs::Wire), (&mut o, &mut lse), threads, keys)?;
    }
    drop(gathered);

    for t in 1..=plan.ring_steps() {
        let arriving = plan.ring_arrivals(r, t);
        if arriving.is_empty() {
            if std::mem::take(&mut posted) {
                comm.flush()?;
            }
            continue;
        }
        posted = false;
        let from: Vec<usize> = arriving.iter().map(|&(way, _)| way.owner_at(r, 1, p)).collect();
        let received = comm.exchange(Vec::new(), &from)?;
        for (&(way, owner), bytes) in arriving.iter().zip(received) {
            let hops = plan.hops_of(way, owner);
            let expected = Expected { kind: MsgKind::RingKv, owner, step: t, rank: r };
            let pos = || plan.ring_heads.iter().map(|ph| plan.ring_positions(way, owner, ph)).collect();
            if t == hops && plan.ring_need(owner, r) {
                // Last hop: no copy, one (batch, pair) of the message decoded at a time.
                let raw = RawBlock::new::<T>(bytes, expected, batch, d, pos())?;
                merge_raw(plan, local, &raw, &mut o, &mut lse, threads)?;
                continue;
            }
            // Decode, pass the bytes on at once (the neighbour's transfer overlaps this
            // compute), then compute.
            let blk = if plan.ring_need(owner, r) {
                Some(Block::<T>::decode(&bytes, expected, batch, d, pos())?)
            } else {
                Reader::open(&bytes, expected)?;
                None
            };
            if t < hops {
                comm.post(vec![(way.step(r, 1, p), restep(bytes, t + 1))])?;
                posted = true;
            } else {
                drop(bytes);
            }
            if let Some(blk) = blk {
                let keys = |bh: usize, i| blk.keys(bh / local.heads, i, d);
                merge_pairs(plan, local, (&plan.ring_heads, Pairs::Wire), (&mut o, &mut lse), threads, keys)?;
            }
        }
    }

    // out = out_scale * merged o.
    for (head, scale) in plan.out_scales().into_iter().enumerate() {
        for b in 0..batch {
            o[local.bh(b, head)].iter_mut().for_each(|x| *x *= scale);
        }
    }
    Ok(Partial { o, lse })
}

/// Each (batch, head)'s accumulators `(bh, o, lse)`, one work item each.
fn head_accs<'a>(o: &'a mut [Vec<f32>], lse: &'a mut [Vec<f32>]) -> Vec<(usize, &'a mut [f32], &'a mut [f32])> {
    o.iter_mut().zip(lse.iter_mut()).enumerate().map(|(bh, (o, l))| (bh, o.as_mut_slice(), l.as_mut_slice())).collect()
}

/// [`merge_pairs`] straight from a ring message, decoding one (batch, pair) at a time
/// (per thread).
fn merge_raw<T: Element>(
    plan: &Plan,
    local: &Local<'_, T>,
    raw: &RawBlock,
    o: &mut [Vec<f32>],
    lse: &mut [Vec<f32>],
    threads: usize,
) -> Result<()> {
    let b_of = |bh: usize| bh / local.heads;
    for_each_item(threads, head_accs(o, lse), |(bh, o, lse)| {
        let (mut k, mut v) = (Vec::<T>::new(), Vec::<T>::new());
        let h = bh % local.heads;
        for (i, ph) in plan.ring_heads.iter().enumerate().filter(|(_, ph)| plan.reads(h, ph)) {
            raw.part_rows::<T>(b_of(bh), i, local.d, 0..raw.pos[i].len(), &mut k, &mut v);
            let keys = KeyBlock { pos: &raw.pos[i], k: &k, v: &v, stride: local.d };
            attend_forward(local.q_rows(bh), keys, mask_of(plan, ph, b_of(bh), h), o, lse)?;
        }
        Ok(())
    })
}

/// Which heads a pair list names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pairs {
    /// Query heads ([`all_pairs`]).
    Query,
    /// Key/value heads (the plan's wire lists): every query head reading one attends it.
    Wire,
}

/// Merge the attention of each (batch, head)'s query rows onto `keys(bh, i)`, for every
/// pair `i` of `pairs` the head attends, into its accumulators; the (batch, head)s are
/// split over `threads`.
fn merge_pairs<'k, T: Element + 'k>(
    plan: &Plan,
    local: &Local<'_, T>,
    (pairs, side): (&[PatternHead], Pairs),
    (o, lse): (&mut [Vec<f32>], &mut [Vec<f32>]),
    threads: usize,
    keys: impl Fn(usize, usize) -> KeyBlock<'k, T> + Sync,
) -> Result<()> {
    for_each_item(threads, head_accs(o, lse), |(bh, o, lse)| {
        let h = bh % local.heads;
        let attends = |ph: &PatternHead| if side == Pairs::Query { ph.head == h } else { plan.reads(h, ph) };
        for (i, ph) in pairs.iter().enumerate().filter(|(_, ph)| attends(ph)) {
            attend_forward(local.q_rows(bh), keys(bh, i), mask_of(plan, ph, bh / local.heads, h), o, lse)?;
        }
        Ok(())
    })
}

/// Forward of dilated attention with the sequence split over the ranks of `comm`.
///
/// `q`, `k`, `v` are this rank's rows (`[batch, layout.rows(seq, world, rank), heads,
/// head_dim]`, in ascending global order); `out` has their shape and `lse` is
/// `[batch, rows, heads]`. Every rank must call this with the same `problem`; any
/// disagreement, bad shape, dead or stalled peer or corrupted message is an error on
/// every rank, and nothing is written to `out`/`lse` unless all ranks succeeded.
/// [`ring_forward_with`] adds a memory budget and a finite-input check.
pub fn ring_forward<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    problem: &RingProblem,
    qkv: [TensorView<'_, T>; 3],
    out: &mut TensorViewMut<'_, T>,
    lse: &mut [f32],
) -> Result<RingStats> {
    ring_forward_with(comm, problem, &RingOptions::default(), qkv, out, lse)
}

/// [`ring_forward`] with opt-in checks, decided by all ranks together in the handshake
/// before anything proportional to the problem is allocated or sent: a workspace
/// ([`crate::Plan::max_workspace_bytes`]) over `opts.budget` is `OverBudget` on every
/// rank, a NaN or infinity in q, k or v (with `opts.check_finite`) is `NonFinite` on
/// every rank; `out` and `lse` are then untouched.
pub fn ring_forward_with<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    problem: &RingProblem,
    opts: &RingOptions,
    qkv: [TensorView<'_, T>; 3],
    out: &mut TensorViewMut<'_, T>,
    lse: &mut [f32],
) -> Result<RingStats> {
    let extra =
        check_out(problem, comm.rank(), &[(TensorName::Output, out.shape())], Some((TensorName::Lse, lse.len())));
    let problem = &*crate::plan::choose::resolved(problem);
    if crate::plan::choose::runs_heads(problem) {
        return heads_forward(comm, problem, opts, qkv, (out, lse), extra);
    }
    let Prepared { plan, local, start } = prepare(comm, "forward", problem, opts, qkv, None, extra)?;
    if plan.ring_heads.is_empty() {
        let partials = gather_partials(comm, &plan, &local, opts.threads)?;
        let stats = finish(comm, start)?;
        forward_direct(&plan, &local, &partials, out, lse, opts.threads)?;
        return Ok(stats);
    }
    let part = forward_core::<C, T>(comm, &plan, &local, opts.threads)?;
    let stats = finish(comm, start)?;
    let (nl, h, d) = (local.rows(), local.heads, local.d);
    for b in 0..local.batch {
        for head in 0..h {
            let bh = local.bh(b, head);
            for i in 0..nl {
                let row = out.row_mut(b, i, head);
                for (x, &y) in row.iter_mut().zip(&part.o[bh][i * d..(i + 1) * d]) {
                    *x = T::from_f32(y);
                }
                lse[(b * nl + i) * h + head] = part.lse[bh][i];
            }
        }
    }
    Ok(stats)
}
