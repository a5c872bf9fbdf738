//! Ulysses and the hybrid (`Strategy::Ulysses`, `Strategy::Hybrid`): within each group
//! of `U` ranks an all-to-all turns every rank's rows of all heads into the group's rows
//! of one slot of heads (with the key/value heads they read); across groups the ranks of
//! one slot exchange their keys and values, so each holds the whole sequence's keys;
//! each rank attends ([`crate::compute::ulysses_attend`]); a second all-to-all returns
//! out and lse (or dq, dk, dv, the key gradients first summed back across groups) to the
//! rows' owners. Outputs are written only after the completion step.

use attn_core::error::TensorName;
use attn_core::{AttnError, Element, Result, TensorView, TensorViewMut};

use crate::comm::Communicator;
use crate::comm::all_to_all::all_to_all;
use crate::compute::ulysses_attend::{SlotForward, SlotGrads, SlotRows};
use crate::plan::RingProblem;
use crate::plan::heads_split::HeadSplit;
use crate::protocol::call::{Prepared, RingOptions, RingStats, finish, finish_with, prepare};
use crate::protocol::wire::{Expected, MsgKind, Reader, begin, put_elems, put_f32s};

/// Where a call stands: the split, this rank, its group's ranks and rows.
struct Place {
    split: HeadSplit,
    rank: usize,
    group: usize,
    slot: usize,
    /// The group's ranks, in slot order.
    members: Vec<usize>,
    /// Each member's global positions (its rows, ascending).
    member_pos: Vec<Vec<usize>>,
    /// Each member's rows as indices into `qpos`.
    member_idx: Vec<Vec<usize>>,
    /// The group's positions, ascending.
    qpos: Vec<usize>,
}

impl Place {
    fn new(problem: &RingProblem, rank: usize) -> Result<Self> {
        let u = problem.strategy.ulysses_degree(problem.world).unwrap_or(problem.world);
        let split = HeadSplit::new(problem.heads, problem.kv_heads, u, problem.world)?;
        let (n, p, layout) = (problem.seq, problem.world, problem.layout);
        let group = split.group_of(rank);
        let members: Vec<usize> = split.members(group).collect();
        let member_pos: Vec<Vec<usize>> = members.iter().map(|&m| layout.positions(n, p, m)).collect();
        let qpos = split.group_positions(layout, n, group);
        let member_idx =
            member_pos.iter().map(|pos| pos.iter().map(|&x| qpos.partition_point(|&y| y < x)).collect()).collect();
        Ok(Place { split, rank, group, slot: split.slot_of(rank), members, member_pos, member_idx, qpos })
    }

    /// The ranks of this slot in the other groups.
    fn across(&self) -> Vec<usize> {
        (0..self.split.groups).filter(|&g| g != self.group).map(|g| self.split.rank_of(g, self.slot)).collect()
    }

    fn expected(&self, kind: MsgKind, owner: usize) -> Expected {
        Expected { kind, owner, step: 0, rank: self.rank }
    }
}

/// This rank's tensors to send in the first all-to-all: q, k, v and (backward) grad_out
/// with the gradient into the LSE (`[batch, rows, heads]`, zeros when none is given).
struct Inputs<'a, T> {
    qkv: [TensorView<'a, T>; 3],
    grad: Option<(TensorView<'a, T>, Vec<f32>)>,
}

/// The first all-to-all: every member's rows of this rank's slot, in the group's order.
fn heads_in<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    problem: &RingProblem,
    at: &Place,
    inputs: &Inputs<'_, T>,
) -> Result<SlotRows<T>> {
    let (batch, d, n) = (problem.batch, problem.head_dim, problem.seq);
    let [q, k, v] = inputs.qkv;
    let rows = q.shape().seq;
    let payloads = (0..at.members.len())
        .map(|j| {
            let (hs, kvs) = (at.split.slot_heads(j), at.split.slot_kv(j));
            let mut msg = begin(MsgKind::HeadsIn, at.rank, 0, batch * rows * (2 * hs.len() + 2 * kvs.len()) * d);
            let mut put = |x: &TensorView<'_, T>, heads: std::ops::Range<usize>| {
                for b in 0..batch {
                    for i in 0..rows {
                        heads.clone().for_each(|h| put_elems(&mut msg, x.row(b, i, h)));
                    }
                }
            };
            put(&q, hs.clone());
            put(&k, kvs.clone());
            put(&v, kvs);
            if let Some((go, glse)) = &inputs.grad {
                put(go, hs.clone());
                for b in 0..batch {
                    for i in 0..rows {
                        put_f32s(&mut msg, &glse[(b * rows + i) * problem.heads..][hs.clone()]);
                    }
                }
            }
            msg
        })
        .collect();
    let got = all_to_all(comm, &at.members, payloads)?;
    let (m, mk) = (at.split.slot_heads(at.slot).len(), at.split.slot_kv(at.slot).len());
    let nq = at.qpos.len();
    let zero = T::from_f32(0.0);
    let backward = inputs.grad.is_some();
    let mut slot = SlotRows {
        split: at.split,
        slot: at.slot,
        qpos: at.qpos.clone(),
        kpos: (0..n).collect(),
        q: vec![vec![zero; nq * d]; batch * m],
        k: vec![vec![zero; n * d]; batch * mk],
        v: vec![vec![zero; n * d]; batch * mk],
        go: if backward { vec![vec![zero; nq * d]; batch * m] } else { Vec::new() },
        glse: if backward { vec![vec![0.0; nq]; batch * m] } else { Vec::new() },
    };
    for (j, bytes) in got.iter().enumerate() {
        let mut rd = Reader::open(bytes, at.expected(MsgKind::HeadsIn, at.members[j]))?;
        let (idx, pos) = (&at.member_idx[j], &at.member_pos[j]);
        let mut take = |bufs: &mut [Vec<T>], heads: usize, dest: &dyn Fn(usize) -> usize| -> Result<()> {
            let mut buf = Vec::new();
            rd.elems::<T>(batch * idx.len() * heads * d, &mut buf)?;
            for (r, row) in buf.chunks_exact(d).enumerate() {
                let (hl, i, b) = (r % heads, (r / heads) % idx.len(), r / (heads * idx.len()));
                bufs[b * heads + hl][dest(i) * d..][..d].copy_from_slice(row);
            }
            Ok(())
        };
        take(&mut slot.q, m, &|i| idx[i])?;
        take(&mut slot.k, mk, &|i| pos[i])?;
        take(&mut slot.v, mk, &|i| pos[i])?;
        if backward {
            take(&mut slot.go, m, &|i| idx[i])?;
            let mut g = Vec::new();
            rd.f32s(batch * idx.len() * m, &mut g)?;
            for (r, &x) in g.iter().enumerate() {
                let (hl, i, b) = (r % m, (r / m) % idx.len(), r / (m * idx.len()));
                slot.glse[b * m + hl][idx[i]] = x;
            }
        }
        rd.finish()?;
    }
    Ok(slot)
}

/// Across groups: this slot's keys and values of the group's rows to the same slot of
/// every other group, theirs into `slot.k`/`slot.v` at their positions.
fn keys_across<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    problem: &RingProblem,
    at: &Place,
    slot: &mut SlotRows<T>,
) -> Result<()> {
    let across = at.across();
    if across.is_empty() {
        return Ok(());
    }
    let d = problem.head_dim;
    let mut msg = begin(MsgKind::HeadsAcross, at.rank, 0, 2 * slot.k.len() * at.qpos.len() * d);
    for bufs in [&slot.k, &slot.v] {
        for buf in bufs {
            at.qpos.iter().for_each(|&p| put_elems(&mut msg, &buf[p * d..(p + 1) * d]));
        }
    }
    let got = comm.exchange(across.iter().map(|&x| (x, msg.clone())).collect(), &across)?;
    drop(msg);
    for (&src, bytes) in across.iter().zip(got) {
        let pos = at.split.group_positions(problem.layout, problem.seq, at.split.group_of(src));
        let mut rd = Reader::open(&bytes, at.expected(MsgKind::HeadsAcross, src))?;
        for bufs in [&mut slot.k, &mut slot.v] {
            for buf in bufs.iter_mut() {
                let mut rows = Vec::new();
                rd.elems::<T>(pos.len() * d, &mut rows)?;
                for (&p, row) in pos.iter().zip(rows.chunks_exact(d)) {
                    buf[p * d..(p + 1) * d].copy_from_slice(row);
                }
            }
        }
        rd.finish()?;
    }
    Ok(())
}

/// The second all-to-all of the forward: each member's rows of this slot's out (as `T`)
/// and lse; returns this rank's rows of every head, `[batch, rows, heads, d]` and
/// `[batch, rows, heads]`.
fn heads_out<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    problem: &RingProblem,
    at: &Place,
    fwd: &SlotForward,
) -> Result<(Vec<T>, Vec<f32>)> {
    let (batch, d, heads) = (problem.batch, problem.head_dim, problem.heads);
    let m = at.split.slot_heads(at.slot).len();
    let payloads = at
        .member_idx
        .iter()
        .map(|idx| {
            let mut msg = begin(MsgKind::HeadsOut, at.rank, 0, batch * idx.len() * m * (d + 1) * 4);
            let mut row = Vec::with_capacity(d);
            for b in 0..batch {
                for &i in idx {
                    for hl in 0..m {
                        row.clear();
                        row.extend(fwd.o[b * m + hl][i * d..(i + 1) * d].iter().map(|&x| T::from_f32(x)));
                        put_elems(&mut msg, &row);
                    }
                }
            }
            for b in 0..batch {
                for &i in idx {
                    (0..m).for_each(|hl| put_f32s(&mut msg, &[fwd.lse[b * m + hl][i]]));
                }
            }
            msg
        })
        .collect();
    let got = all_to_all(comm, &at.members, payloads)?;
    let rows = at.member_pos[at.slot].len();
    let mut out = vec![T::from_f32(0.0); batch * rows * heads * d];
    let mut lse = vec![0.0f32; batch * rows * heads];
    for (j, bytes) in got.iter().enumerate() {
        let hs = at.split.slot_heads(j);
        let mut rd = Reader::open(bytes, at.expected(MsgKind::HeadsOut, at.members[j]))?;
        let mut o = Vec::new();
        rd.elems::<T>(batch * rows * hs.len() * d, &mut o)?;
        let mut l = Vec::new();
        rd.f32s(batch * rows * hs.len(), &mut l)?;
        rd.finish()?;
        for (r, row) in o.chunks_exact(d).enumerate() {
            let (hl, bi) = (r % hs.len(), r / hs.len());
            out[(bi * heads + hs.start + hl) * d..][..d].copy_from_slice(row);
            lse[bi * heads + hs.start + hl] = l[r];
        }
    }
    Ok((out, lse))
}

/// Across groups, backward: the key gradients of every other group's rows go to the same
/// slot there, and theirs for this group's rows are added here.
fn key_grads_across<C: Communicator + ?Sized>(
    comm: &mut C,
    problem: &RingProblem,
    at: &Place,
    g: &mut SlotGrads,
) -> Result<()> {
    let across = at.across();
    if across.is_empty() {
        return Ok(());
    }
    let d = problem.head_dim;
    let sends = across
        .iter()
        .map(|&x| {
            let pos = at.split.group_positions(problem.layout, problem.seq, at.split.group_of(x));
            let mut msg = begin(MsgKind::HeadsGradAcross, at.rank, 0, 2 * g.dk.len() * pos.len() * d * 4);
            for bufs in [&g.dk, &g.dv] {
                for buf in bufs {
                    pos.iter().for_each(|&p| put_f32s(&mut msg, &buf[p * d..(p + 1) * d]));
                }
            }
            (x, msg)
        })
        .collect();
    let got = comm.exchange(sends, &across)?;
    for (&src, bytes) in across.iter().zip(got) {
        let mut rd = Reader::open(&bytes, at.expected(MsgKind::HeadsGradAcross, src))?;
        for bufs in [&mut g.dk, &mut g.dv] {
            for buf in bufs.iter_mut() {
                let mut rows = Vec::new();
                rd.f32s(at.qpos.len() * d, &mut rows)?;
                for (&p, row) in at.qpos.iter().zip(rows.chunks_exact(d)) {
                    buf[p * d..(p + 1) * d].iter_mut().zip(row).for_each(|(a, &b)| *a += b);
                }
            }
        }
        rd.finish()?;
    }
    Ok(())
}

/// This rank's f32 gradients, `[batch, rows, heads or kv_heads, d]`.
struct RankGrads {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// The second all-to-all of the backward: dq of this slot's heads and dk/dv of its
/// key/value heads to each member for its rows; dk/dv of a key/value head read by
/// several slots are summed at the owner.
fn grads_out<C: Communicator + ?Sized>(
    comm: &mut C,
    problem: &RingProblem,
    at: &Place,
    g: &SlotGrads,
) -> Result<RankGrads> {
    let (batch, d) = (problem.batch, problem.head_dim);
    let (m, mk) = (at.split.slot_heads(at.slot).len(), at.split.slot_kv(at.slot).len());
    let payloads = at
        .member_idx
        .iter()
        .zip(&at.member_pos)
        .map(|(idx, pos)| {
            let mut msg = begin(MsgKind::HeadsGradOut, at.rank, 0, batch * idx.len() * (m + 2 * mk) * d * 4);
            for b in 0..batch {
                for &i in idx {
                    (0..m).for_each(|hl| put_f32s(&mut msg, &g.dq[b * m + hl][i * d..(i + 1) * d]));
                }
            }
            for bufs in [&g.dk, &g.dv] {
                for b in 0..batch {
                    for &p in pos {
                        (0..mk).for_each(|kl| put_f32s(&mut msg, &bufs[b * mk + kl][p * d..(p + 1) * d]));
                    }
                }
            }
            msg
        })
        .collect();
    let got = all_to_all(comm, &at.members, payloads)?;
    let rows = at.member_pos[at.slot].len();
    let (heads, kvh) = (problem.heads, problem.kv_heads);
    let mut out = RankGrads {
        dq: vec![0.0; batch * rows * heads * d],
        dk: vec![0.0; batch * rows * kvh * d],
        dv: vec![0.0; batch * rows * kvh * d],
    };
    for (j, bytes) in got.iter().enumerate() {
        let (hs, ks) = (at.split.slot_heads(j), at.split.slot_kv(j));
        let mut rd = Reader::open(bytes, at.expected(MsgKind::HeadsGradOut, at.members[j]))?;
        let mut add = |dst: &mut [f32], all: usize, part: std::ops::Range<usize>| -> Result<()> {
            let mut x = Vec::new();
            rd.f32s(batch * rows * part.len() * d, &mut x)?;
            for (r, row) in x.chunks_exact(d).enumerate() {
                let (hl, bi) = (r % part.len(), r / part.len());
                let at = &mut dst[(bi * all + part.start + hl) * d..][..d];
                at.iter_mut().zip(row).for_each(|(a, &b)| *a += b);
            }
            Ok(())
        };
        add(&mut out.dq, heads, hs)?;
        add(&mut out.dk, kvh, ks.clone())?;
        add(&mut out.dv, kvh, ks)?;
        rd.finish()?;
    }
    Ok(out)
}

/// [`crate::ring_forward_with`] for the head strategies (after its output checks, `extra`).
pub(crate) fn heads_forward<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    problem: &RingProblem,
    opts: &RingOptions,
    qkv: [TensorView<'_, T>; 3],
    (out, lse): (&mut TensorViewMut<'_, T>, &mut [f32]),
    extra: Option<String>,
) -> Result<RingStats> {
    let Prepared { start, .. } = prepare(comm, "forward", problem, opts, qkv, None, extra)?;
    let at = Place::new(problem, comm.rank())?;
    let mut slot = heads_in(comm, problem, &at, &Inputs { qkv, grad: None })?;
    keys_across(comm, problem, &at, &mut slot)?;
    let fwd = slot.forward(problem, opts.threads)?;
    drop(slot);
    let (o, l) = heads_out(comm, problem, &at, &fwd)?;
    let stats = finish(comm, start)?;
    let (rows, heads, d) = (at.member_pos[at.slot].len(), problem.heads, problem.head_dim);
    for b in 0..problem.batch {
        for i in 0..rows {
            for h in 0..heads {
                let src = ((b * rows + i) * heads + h) * d;
                out.row_mut(b, i, h).copy_from_slice(&o[src..src + d]);
            }
        }
    }
    lse.copy_from_slice(&l);
    Ok(stats)
}

/// [`crate::ring_backward_with`] for the head strategies (after its output checks, `extra`).
pub(crate) fn heads_backward<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    problem: &RingProblem,
    opts: &RingOptions,
    (qkv, grad_out, grad_lse): ([TensorView<'_, T>; 3], TensorView<'_, T>, Option<&[f32]>),
    [dq, dk, dv]: [&mut TensorViewMut<'_, T>; 3],
    extra: Option<String>,
) -> Result<RingStats> {
    let Prepared { start, .. } = prepare(comm, "backward", problem, opts, qkv, Some(grad_out), extra)?;
    let at = Place::new(problem, comm.rank())?;
    let glse = grad_lse.map_or_else(|| vec![0.0; grad_out.shape().numel() / problem.head_dim], <[f32]>::to_vec);
    let mut slot = heads_in(comm, problem, &at, &Inputs { qkv, grad: Some((grad_out, glse)) })?;
    keys_across(comm, problem, &at, &mut slot)?;
    let fwd = slot.forward(problem, opts.threads)?;
    let verdict = if opts.check_finite && grad_lse.is_some() { finite_lse_grad(problem, &slot, &fwd) } else { Ok(()) };
    let mut g = slot.backward(problem, &fwd, opts.threads)?;
    drop((slot, fwd));
    key_grads_across(comm, problem, &at, &mut g)?;
    let r = grads_out(comm, problem, &at, &g)?;
    let stats = finish_with(comm, start, verdict)?;
    let rows = at.member_pos[at.slot].len();
    let d = problem.head_dim;
    for (dst, src, heads) in [(dq, &r.dq, problem.heads), (dk, &r.dk, problem.kv_heads), (dv, &r.dv, problem.kv_heads)]
    {
        for b in 0..problem.batch {
            for i in 0..rows {
                for h in 0..heads {
                    let at = ((b * rows + i) * heads + h) * d;
                    dst.row_mut(b, i, h).iter_mut().zip(&src[at..at + d]).for_each(|(x, &y)| *x = T::from_f32(y));
                }
            }
        }
    }
    Ok(stats)
}

/// `NonFinite` (index into the global `[batch, seq, heads]`) for the first gradient into
/// the LSE of this slot that is not finite on a row that attends something.
fn finite_lse_grad<T: Element>(problem: &RingProblem, slot: &SlotRows<T>, fwd: &SlotForward) -> Result<()> {
    let m = slot.heads().len();
    let bad = (0..slot.glse.len())
        .flat_map(|bh| (0..slot.qpos.len()).map(move |i| (bh, i)))
        .find(|&(bh, i)| !slot.glse[bh][i].is_finite() && fwd.lse[bh][i].is_finite());
    match bad {
        Some((bh, i)) => {
            let (b, h) = (bh / m, slot.heads().start + bh % m);
            let index = (b * problem.seq + slot.qpos[i]) * problem.heads + h;
            Err(AttnError::NonFinite { tensor: TensorName::GradLse, index })
        }
        None => Ok(()),
    }
}
