//! Ulysses and the hybrid (`Strategy::Ulysses`, `Strategy::Hybrid`): within each group
//! of `U` ranks an all-to-all turns every rank's rows of all heads into the group's rows
//! of one slot of heads (with the key/value heads they read); each rank attends its own
//! group's keys, then the ranks of one slot pass their groups' keys and values around a
//! ring of the groups (`G - 1` steps, one block held at a time; in the backward each block
//! carries its dk/dv and a last step takes them home), attending each block on arrival
//! ([`crate::compute::ulysses_attend`]); a second all-to-all returns out and lse (or dq,
//! dk, dv) to the rows' owners. Outputs are written only after the completion step.

use attn_core::error::TensorName;
use attn_core::{AttnError, Element, Result, TensorView, TensorViewMut};

use crate::comm::Communicator;
use crate::comm::all_to_all::all_to_all;
use crate::compute::ulysses_attend::{KeyGrads, KeyRows, SlotDelta, SlotForward, SlotRows};
use crate::plan::RingProblem;
use crate::plan::heads_place::HeadPlace as Place;
use crate::protocol::call::{Prepared, RingOptions, RingStats, finish, finish_with, prepare};
use crate::protocol::wire::{Expected, MsgKind, Reader, begin, put_elems, put_f32s};

/// The header a member's message of `kind` carries in an all-to-all.
fn expected(at: &Place, kind: MsgKind, owner: usize) -> Expected {
    Expected { kind, owner, step: 0, rank: at.rank }
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
    let (batch, d) = (problem.batch, problem.head_dim);
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
        q: vec![vec![zero; nq * d]; batch * m],
        k: vec![vec![zero; nq * d]; batch * mk],
        v: vec![vec![zero; nq * d]; batch * mk],
        go: if backward { vec![vec![zero; nq * d]; batch * m] } else { Vec::new() },
        glse: if backward { vec![vec![0.0; nq]; batch * m] } else { Vec::new() },
    };
    for (j, bytes) in got.iter().enumerate() {
        let mut rd = Reader::open(bytes, expected(at, MsgKind::HeadsIn, at.members[j]))?;
        let idx = &at.member_idx[j];
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
        take(&mut slot.k, mk, &|i| idx[i])?;
        take(&mut slot.v, mk, &|i| idx[i])?;
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

/// A block of group `group` at ring step `step` as a message of `kind`: k, v (as `T`),
/// then dk, dv (f32) where given.
fn encode_block<T: Element>(
    kind: MsgKind,
    (group, step): (usize, usize),
    kv: [&[Vec<T>]; 2],
    grads: Option<&KeyGrads>,
) -> Vec<u8> {
    // Sized up front: a message grown by pushing holds up to twice its bytes.
    let elems: usize = kv.iter().flat_map(|bufs| bufs.iter()).map(Vec::len).sum();
    let f32s: usize = grads.map_or(0, |g| g.dk.iter().chain(&g.dv).map(Vec::len).sum());
    let mut msg = begin(kind, group, step, elems * T::DTYPE.size() + f32s * 4);
    for bufs in kv {
        bufs.iter().for_each(|b| put_elems(&mut msg, b));
    }
    if let Some(g) = grads {
        for bufs in [&g.dk, &g.dv] {
            bufs.iter().for_each(|b| put_f32s(&mut msg, b));
        }
    }
    msg
}

/// One group's block of the slot's keys and values as it travels the ring over the
/// groups (with its dk/dv so far in the backward).
struct Held<T> {
    group: usize,
    pos: Vec<usize>,
    k: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
    grads: Option<KeyGrads>,
}

impl<T: Element> Held<T> {
    fn keys(&self) -> KeyRows<'_, T> {
        KeyRows { pos: &self.pos, k: &self.k, v: &self.v }
    }

    /// The block as a message of `kind` at ring step `step`.
    fn encode(&self, kind: MsgKind, step: usize) -> Vec<u8> {
        encode_block(kind, (self.group, step), [&self.k, &self.v], self.grads.as_ref())
    }

    /// Read a block of `kbh` (batch, key/value head) buffers at `pos` (with dk/dv if `grads`).
    fn decode(bytes: &[u8], want: Expected, kbh: usize, d: usize, pos: Vec<usize>, grads: bool) -> Result<Self> {
        let mut rd = Reader::open(bytes, want)?;
        let rows = pos.len() * d;
        let mut kv = [Vec::with_capacity(kbh), Vec::with_capacity(kbh)];
        for bufs in &mut kv {
            for _ in 0..kbh {
                let mut x = Vec::new();
                rd.elems::<T>(rows, &mut x)?;
                bufs.push(x);
            }
        }
        let grads = if grads {
            let mut g = KeyGrads { dk: Vec::with_capacity(kbh), dv: Vec::with_capacity(kbh) };
            for bufs in [&mut g.dk, &mut g.dv] {
                for _ in 0..kbh {
                    let mut x = Vec::new();
                    rd.f32s(rows, &mut x)?;
                    bufs.push(x);
                }
            }
            Some(g)
        } else {
            None
        };
        rd.finish()?;
        let [k, v] = kv;
        Ok(Held { group: want.owner, pos, k, v, grads })
    }
}

/// The forward over the groups: the own group's keys, then `G - 1` ring steps, each
/// passing the held block to the next group's rank of this slot and attending the one
/// arriving from the previous; the final (scaled) output and lse.
fn forward_over_groups<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    problem: &RingProblem,
    at: &Place,
    slot: &SlotRows<T>,
    threads: usize,
) -> Result<SlotForward> {
    let mut acc = slot.forward_start(problem);
    slot.attend(problem, slot.own_keys(), &mut acc, threads)?;
    let kbh = slot.k.len();
    let mut held: Option<Held<T>> = None;
    for t in 1..at.split.groups {
        let msg = match &held {
            Some(h) => h.encode(MsgKind::HeadsAcross, t),
            None => encode_block(MsgKind::HeadsAcross, (at.group, t), [&slot.k, &slot.v], None),
        };
        let got = comm.exchange(vec![(at.next_across(), msg)], &[at.prev_across()])?;
        let src = at.arriving(t);
        let pos = at.split.group_positions(problem.layout, problem.seq, src);
        let want = Expected { kind: MsgKind::HeadsAcross, owner: src, step: t, rank: at.rank };
        let bytes = got.into_iter().next().unwrap_or_default();
        let h = Held::<T>::decode(&bytes, want, kbh, problem.head_dim, pos, false)?;
        slot.attend(problem, h.keys(), &mut acc, threads)?;
        held = Some(h);
    }
    slot.forward_finish(problem, &mut acc);
    Ok(acc)
}

/// The backward over the groups: dq accumulates here while each group's block travels
/// the ring with its dk/dv (the owner's share first); after `G - 1` steps a last step
/// takes every block's dk/dv home. Returns dq and this group's dk/dv.
fn backward_over_groups<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    problem: &RingProblem,
    at: &Place,
    slot: &mut SlotRows<T>,
    sd: &SlotDelta,
    threads: usize,
) -> Result<(Vec<Vec<f32>>, KeyGrads)> {
    let d = problem.head_dim;
    let (nq, kbh) = (at.qpos.len(), slot.k.len());
    let mut dq = vec![vec![0.0f32; nq * d]; slot.q.len()];
    let mut own = KeyGrads::zeros(kbh, nq, d);
    slot.attend_backward(problem, sd, slot.own_keys(), &mut dq, &mut own, threads)?;
    let groups = at.split.groups;
    if groups == 1 {
        return Ok((dq, own));
    }
    let (k, v) = (std::mem::take(&mut slot.k), std::mem::take(&mut slot.v));
    let mut held = Held { group: at.group, pos: at.qpos.clone(), k, v, grads: Some(own) };
    for t in 1..groups {
        let msg = held.encode(MsgKind::HeadsKvGradAcross, t);
        let got = comm.exchange(vec![(at.next_across(), msg)], &[at.prev_across()])?;
        drop(held);
        let src = at.arriving(t);
        let pos = at.split.group_positions(problem.layout, problem.seq, src);
        let want = Expected { kind: MsgKind::HeadsKvGradAcross, owner: src, step: t, rank: at.rank };
        let bytes = got.into_iter().next().unwrap_or_default();
        held = Held::<T>::decode(&bytes, want, kbh, d, pos, true)?;
        let mut kg = held.grads.take().unwrap_or_else(|| KeyGrads::zeros(kbh, held.pos.len(), d));
        slot.attend_backward(problem, sd, held.keys(), &mut dq, &mut kg, threads)?;
        held.grads = Some(kg);
    }
    // Home: the held block belongs to the next group; this group's comes from the previous.
    let no_rows: [&[Vec<T>]; 2] = [&[], &[]];
    let msg = encode_block(MsgKind::HeadsGradAcross, (held.group, groups), no_rows, held.grads.as_ref());
    let got = comm.exchange(vec![(at.next_across(), msg)], &[at.prev_across()])?;
    let bytes = got.into_iter().next().unwrap_or_default();
    let want = Expected { kind: MsgKind::HeadsGradAcross, owner: at.group, step: groups, rank: at.rank };
    let mut rd = Reader::open(&bytes, want)?;
    let mut g = KeyGrads { dk: Vec::with_capacity(kbh), dv: Vec::with_capacity(kbh) };
    for bufs in [&mut g.dk, &mut g.dv] {
        for _ in 0..kbh {
            let mut x = Vec::new();
            rd.f32s(nq * d, &mut x)?;
            bufs.push(x);
        }
    }
    rd.finish()?;
    Ok((dq, g))
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
        let mut rd = Reader::open(bytes, expected(at, MsgKind::HeadsOut, at.members[j]))?;
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

/// This rank's f32 gradients, `[batch, rows, heads or kv_heads, d]`.
struct RankGrads {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// The second all-to-all of the backward: dq of this slot's heads and dk/dv of its
/// key/value heads to each member for its rows; dk/dv of a key/value head read by
/// several slots are summed at the owner (dq and dk/dv over the group's rows).
fn grads_out<C: Communicator + ?Sized>(
    comm: &mut C,
    problem: &RingProblem,
    at: &Place,
    (dq, g): (&[Vec<f32>], &KeyGrads),
) -> Result<RankGrads> {
    let (batch, d) = (problem.batch, problem.head_dim);
    let (m, mk) = (at.split.slot_heads(at.slot).len(), at.split.slot_kv(at.slot).len());
    let payloads = at
        .member_idx
        .iter()
        .map(|idx| {
            let mut msg = begin(MsgKind::HeadsGradOut, at.rank, 0, batch * idx.len() * (m + 2 * mk) * d * 4);
            for b in 0..batch {
                for &i in idx {
                    (0..m).for_each(|hl| put_f32s(&mut msg, &dq[b * m + hl][i * d..(i + 1) * d]));
                }
            }
            for bufs in [&g.dk, &g.dv] {
                for b in 0..batch {
                    for &i in idx {
                        (0..mk).for_each(|kl| put_f32s(&mut msg, &bufs[b * mk + kl][i * d..(i + 1) * d]));
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
        let mut rd = Reader::open(bytes, expected(at, MsgKind::HeadsGradOut, at.members[j]))?;
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
    let slot = heads_in(comm, problem, &at, &Inputs { qkv, grad: None })?;
    let fwd = forward_over_groups(comm, problem, &at, &slot, opts.threads)?;
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
    let fwd = forward_over_groups(comm, problem, &at, &slot, opts.threads)?;
    let verdict = if opts.check_finite && grad_lse.is_some() { finite_lse_grad(problem, &slot, &fwd) } else { Ok(()) };
    let sd = slot.delta(problem, fwd);
    let (slot_dq, kg) = backward_over_groups(comm, problem, &at, &mut slot, &sd, opts.threads)?;
    drop((slot, sd));
    let r = grads_out(comm, problem, &at, (&slot_dq, &kg))?;
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
