//! Ulysses and the hybrid on the chunk ring (`Strategy::Ulysses`, `Strategy::Hybrid`):
//! within each group of `U` ranks an all-to-all over the transport
//! ([`ChunkTransport::all_to_all`]) turns every member's pieces of all heads into the
//! group's pieces of this rank's slot of heads (with the key/value heads they read; the
//! split is the host path's [`HeadSplit`]); each rank attends its own group's keys, then
//! the ranks of one slot pass their groups' k/v around the ring of the groups (a travel of
//! `U` ranks, `G - 1` steps; in the backward each block carries its dk/dv and a last step
//! takes them home); a second all-to-all returns out and lse (or dq, dk, dv) to the rows'
//! owners. The handshake and completion are the chunk ring's (in [`super::protocol`]).

use std::ops::Range;
use std::sync::Arc;

use attn_core::{Element, Result, Shape4};

use super::reach::may_attend;
use super::{
    ChunkBlock, ChunkCompute, ChunkGrads, ChunkTransport, ChunkUpstream, Exchange, HeadSlot, Parcel, ParcelShapes,
    Travel, TravelKind, piece_shapes, rank_pieces,
};
use crate::plan::RingProblem;
use crate::plan::heads_place::HeadPlace;
use crate::plan::heads_split::HeadSplit;

/// Out and lse per piece.
type OutLse<R, S> = (Vec<R>, Vec<S>);

/// Key pieces of a block row: k, v and their first global positions.
type Keys<'k, R> = (&'k [Arc<R>], &'k [Arc<R>], &'k [usize]);

/// The backward's grad_out pieces and gradient into the LSE (head_dim-1 accumulators).
type GradIn<'g, R, A> = Option<(&'g [R], &'g [A])>;

/// The slot of heads `j` of `split` as blocks read it.
fn head_slot(split: &HeadSplit, j: usize) -> HeadSlot {
    HeadSlot::Slot { first: split.slot_heads(j).start, kv_first: split.slot_kv(j).start }
}

/// Shapes of `rank`'s pieces with `heads` heads and head_dim `d`.
fn shapes(problem: &RingProblem, rank: usize, heads: usize, d: usize) -> Result<Vec<Shape4>> {
    Ok(piece_shapes(problem, rank, heads)?.into_iter().map(|s| Shape4 { head_dim: d, ..s }).collect())
}

/// Shapes of group `g`'s pieces (its members' pieces, in slot order) with `heads` heads.
fn group_shapes(problem: &RingProblem, split: &HeadSplit, g: usize, heads: usize) -> Result<Vec<Shape4>> {
    let mut out = Vec::new();
    for m in split.members(g) {
        out.extend(piece_shapes(problem, m, heads)?);
    }
    Ok(out)
}

/// First global positions of group `g`'s pieces, in the order of [`group_shapes`].
fn group_starts(problem: &RingProblem, split: &HeadSplit, g: usize) -> Vec<usize> {
    split.members(g).flat_map(|m| rank_pieces(problem, m)).map(|r| r.start).collect()
}

/// `xs` cut into consecutive runs of `counts`.
fn runs<A>(xs: Vec<A>, counts: &[usize]) -> Vec<Vec<A>> {
    let mut it = xs.into_iter();
    counts.iter().map(|&n| it.by_ref().take(n).collect()).collect()
}

/// A rank's slot after the first all-to-all: the group's pieces of the slot's query heads
/// (`q`, and the backward's `go` and gradient into the LSE) and of the key/value heads
/// they read, with their first global positions; `counts[j]` pieces came from member `j`.
struct SlotPieces<R, A> {
    q: Vec<Arc<R>>,
    k: Vec<Arc<R>>,
    v: Vec<Arc<R>>,
    go: Vec<Arc<R>>,
    glse: Vec<A>,
    starts: Vec<usize>,
    counts: Vec<usize>,
}

/// Where a call stands and what it computes with.
pub(super) struct HeadCall<'a, T: Element, X: ChunkCompute<T>> {
    pub compute: &'a X,
    pub problem: &'a RingProblem,
    pub masks: &'a X::Masks,
    at: HeadPlace,
    slot: HeadSlot,
    _t: std::marker::PhantomData<T>,
}

impl<'a, T: Element, X: ChunkCompute<T>> HeadCall<'a, T, X> {
    pub(super) fn new(compute: &'a X, problem: &'a RingProblem, masks: &'a X::Masks, rank: usize) -> Result<Self> {
        let at = HeadPlace::new(problem, rank)?;
        let slot = head_slot(&at.split, at.slot);
        Ok(HeadCall { compute, problem, masks, at, slot, _t: std::marker::PhantomData })
    }

    fn split(&self) -> &HeadSplit {
        &self.at.split
    }

    /// The first all-to-all: to each member its slot's heads of this rank's pieces (q, k,
    /// v, and in the backward grad_out and the gradient into the LSE as head_dim-1
    /// accumulators).
    fn heads_in<Tr: ChunkTransport<T, X> + ?Sized>(
        &self,
        transport: &mut Tr,
        [q, k, v]: [&[X::Rows]; 3],
        grad: GradIn<'_, X::Rows, X::Acc>,
    ) -> Result<SlotPieces<X::Rows, X::Acc>> {
        let (x, split, d) = (self.compute, self.split(), self.problem.head_dim);
        let take = |xs: &[X::Rows], heads: Range<usize>| -> Result<Vec<Arc<X::Rows>>> {
            xs.iter().map(|p| x.take_heads(p, heads.clone()).map(Arc::new)).collect()
        };
        let (mut parcels, mut expect) = (Vec::new(), Vec::new());
        for (j, &m) in self.at.members.iter().enumerate() {
            let (hs, ks) = (split.slot_heads(j), split.slot_kv(j));
            let mut rows = take(q, hs.clone())?;
            rows.extend(take(k, ks.clone())?);
            rows.extend(take(v, ks)?);
            let mut accs = Vec::new();
            if let Some((go, glse)) = grad {
                rows.extend(take(go, hs.clone())?);
                accs = glse.iter().map(|a| x.take_acc_heads(a, hs.clone())).collect::<Result<_>>()?;
            }
            parcels.push(Parcel { rows, accs });
            // What member `m` sends this rank: its pieces of this rank's slot.
            let (mh, mk) = (split.slot_heads(self.at.slot).len(), split.slot_kv(self.at.slot).len());
            let mut want = ParcelShapes::default();
            for (heads, dim) in [(mh, d), (mk, d), (mk, d)] {
                want.rows.extend(shapes(self.problem, m, heads, dim)?);
            }
            if grad.is_some() {
                want.rows.extend(shapes(self.problem, m, mh, d)?);
                want.accs.extend(shapes(self.problem, m, mh, 1)?);
            }
            expect.push(want);
        }
        let got = transport.all_to_all(x, Exchange::HeadsIn, &self.at.members, parcels, &expect)?;
        let counts: Vec<usize> = self.at.members.iter().map(|&m| rank_pieces(self.problem, m).len()).collect();
        let mut slot = SlotPieces {
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            go: Vec::new(),
            glse: Vec::new(),
            starts: group_starts(self.problem, split, self.at.group),
            counts: counts.clone(),
        };
        for (p, &n) in got.into_iter().zip(&counts) {
            let mut rows = p.rows.into_iter();
            slot.q.extend(rows.by_ref().take(n));
            slot.k.extend(rows.by_ref().take(n));
            slot.v.extend(rows.by_ref().take(n));
            slot.go.extend(rows);
            slot.glse.extend(p.accs);
        }
        Ok(slot)
    }

    /// Merge the blocks of the slot's query pieces onto keys `(k, v, starts)` into `partials`.
    fn attend(
        &self,
        sp: &SlotPieces<X::Rows, X::Acc>,
        (k, v, k_starts): Keys<'_, X::Rows>,
        partials: &mut [X::Partial],
    ) -> Result<()> {
        let (x, problem) = (self.compute, self.problem);
        for ((qt, &q_start), partial) in sp.q.iter().zip(&sp.starts).zip(partials.iter_mut()) {
            let qr = q_start..q_start + x.shape_of(qt).seq;
            for ((kt, vt), &k_start) in k.iter().zip(v).zip(k_starts) {
                if !may_attend(problem, &qr, &(k_start..k_start + x.shape_of(kt).seq)) {
                    continue;
                }
                let (q, k, v, masks, heads) = (&**qt, &**kt, &**vt, self.masks, self.slot);
                x.forward_block(&ChunkBlock { problem, masks, q, q_start, k, v, k_start, heads }, partial)?;
            }
        }
        Ok(())
    }

    /// The forward over the groups: the own group's keys, then `G - 1` travels of `U` ranks
    /// (to this slot's rank in the next group), each block attended while the next moves;
    /// the final out and lse of every group piece.
    fn forward_over_groups<Tr: ChunkTransport<T, X> + ?Sized>(
        &self,
        transport: &mut Tr,
        sp: &SlotPieces<X::Rows, X::Acc>,
    ) -> Result<OutLse<X::Rows, X::RowStats>> {
        let (x, problem, split) = (self.compute, self.problem, self.split());
        let mut partials = sp.q.iter().map(|t| x.empty_partial(x.shape_of(t))).collect::<Result<Vec<_>>>()?;
        let (u, world, groups) = (split.u, problem.world, split.groups);
        let mk = split.slot_kv(self.at.slot).len();
        let (mut k, mut v, mut owner) = (sp.k.clone(), sp.v.clone(), self.at.rank);
        let mut pending = Some((sp.k.clone(), sp.v.clone(), sp.starts.clone()));
        for step in 1..groups {
            let src = self.at.arriving(step);
            let arriving = group_shapes(problem, split, src, mk)?;
            let (kind, hop, dk, dv) = (TravelKind::Kv, u, Vec::new(), Vec::new());
            transport.start(x, problem, Travel { kind, owner, hop, step, k, v, dk, dv, arriving })?;
            let done = pending.take().map_or(Ok(()), |(k, v, s)| self.attend(sp, (&k, &v, &s), &mut partials));
            // Finished even after a failed block, so nothing is in flight when the error returns.
            let arrived = transport.finish(x, problem);
            done?;
            let a = arrived?;
            (k, v, owner) = (a.k.clone(), a.v.clone(), (owner + world - hop) % world);
            pending = Some((a.k, a.v, group_starts(problem, split, src)));
        }
        if let Some((k, v, s)) = pending {
            self.attend(sp, (&k, &v, &s), &mut partials)?;
        }
        let done: Vec<_> =
            partials.iter().map(|p| x.finish_forward_slot(problem, p, self.slot)).collect::<Result<_>>()?;
        Ok(done.into_iter().unzip())
    }

    /// The second all-to-all of the forward: each member's pieces of this slot's out and
    /// lse; returns this rank's pieces of every head.
    fn heads_out<Tr: ChunkTransport<T, X> + ?Sized>(
        &self,
        transport: &mut Tr,
        sp: &SlotPieces<X::Rows, X::Acc>,
        (out, lse): OutLse<X::Rows, X::RowStats>,
    ) -> Result<OutLse<X::Rows, X::RowStats>> {
        let (x, split, d, heads) = (self.compute, self.split(), self.problem.head_dim, self.problem.heads);
        let lse = lse.iter().map(|l| x.stats_as_acc(l)).collect::<Result<Vec<_>>>()?;
        let parcels = runs(out, &sp.counts)
            .into_iter()
            .zip(runs(lse, &sp.counts))
            .map(|(o, l)| Parcel { rows: o.into_iter().map(Arc::new).collect(), accs: l })
            .collect();
        let expect = (0..self.at.members.len())
            .map(|j| {
                let h = split.slot_heads(j).len();
                Ok(ParcelShapes {
                    rows: shapes(self.problem, self.at.rank, h, d)?,
                    accs: shapes(self.problem, self.at.rank, h, 1)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let got = transport.all_to_all(x, Exchange::HeadsOut, &self.at.members, parcels, &expect)?;
        let mut outs = shapes(self.problem, self.at.rank, heads, d)?
            .into_iter()
            .map(|s| x.zero_rows(s))
            .collect::<Result<Vec<_>>>()?;
        let mut lses = shapes(self.problem, self.at.rank, heads, 1)?
            .into_iter()
            .map(|s| x.zero_acc(s))
            .collect::<Result<Vec<_>>>()?;
        for (j, p) in got.into_iter().enumerate() {
            let first = split.slot_heads(j).start;
            for (dst, src) in outs.iter_mut().zip(&p.rows) {
                x.put_heads(dst, first, src)?;
            }
            for (dst, src) in lses.iter_mut().zip(&p.accs) {
                x.add_acc_heads(dst, first, src)?;
            }
        }
        let lses = lses.iter().map(|a| x.acc_as_stats(a)).collect::<Result<_>>()?;
        Ok((outs, lses))
    }

    /// This rank's forward: out and lse per piece.
    pub(super) fn forward<Tr: ChunkTransport<T, X> + ?Sized>(
        &self,
        transport: &mut Tr,
        qkv: [&[X::Rows]; 3],
    ) -> Result<OutLse<X::Rows, X::RowStats>> {
        let sp = self.heads_in(transport, qkv, None)?;
        let fwd = self.forward_over_groups(transport, &sp)?;
        self.heads_out(transport, &sp, fwd)
    }

    /// Add the blocks of the slot's query pieces onto keys `(k, v, starts)` to dq (per
    /// query piece) and to `dk`/`dv` (per key piece).
    fn attend_backward(
        &self,
        sp: &SlotPieces<X::Rows, X::Acc>,
        ups: &[ChunkUpstream<'_, X::Rows, X::RowStats>],
        (k, v, k_starts): Keys<'_, X::Rows>,
        dq: &mut [X::Acc],
        (dk, dv): (&mut [X::Acc], &mut [X::Acc]),
    ) -> Result<()> {
        let (x, problem) = (self.compute, self.problem);
        for (qi, (qt, &q_start)) in sp.q.iter().zip(&sp.starts).enumerate() {
            let qr = q_start..q_start + x.shape_of(qt).seq;
            for (j, ((kt, vt), &k_start)) in k.iter().zip(v).zip(k_starts).enumerate() {
                if !may_attend(problem, &qr, &(k_start..k_start + x.shape_of(kt).seq)) {
                    continue;
                }
                let (q, k, v, masks, heads) = (&**qt, &**kt, &**vt, self.masks, self.slot);
                let blk = ChunkBlock { problem, masks, q, q_start, k, v, k_start, heads };
                let grads = ChunkGrads { dq: &mut dq[qi], dk: &mut dk[j], dv: &mut dv[j] };
                x.backward_block(&blk, &ups[qi], grads)?;
            }
        }
        Ok(())
    }

    /// This rank's backward: the slot's forward recomputed over the groups for the final
    /// lse and delta, then the blocks again, each group's k/v travelling with their dk/dv
    /// and a last travel taking them home; the second all-to-all returns dq, dk, dv (dk/dv
    /// of a key/value head read by several slots summed at the owner).
    pub(super) fn backward<Tr: ChunkTransport<T, X> + ?Sized>(
        &self,
        transport: &mut Tr,
        qkv: [&[X::Rows]; 3],
        grad_out: &[X::Rows],
        grad_lse: Option<&[X::RowStats]>,
    ) -> Result<[Vec<X::Rows>; 3]> {
        let (x, problem, split) = (self.compute, self.problem, self.split());
        let heads = problem.heads;
        // The LSE's gradient travels whether given or not (zeros), as the host path sends it.
        let glse = match grad_lse {
            Some(g) => g.iter().map(|s| x.stats_as_acc(s)).collect::<Result<Vec<_>>>()?,
            None => {
                shapes(problem, self.at.rank, heads, 1)?.into_iter().map(|s| x.zero_acc(s)).collect::<Result<_>>()?
            }
        };
        let sp = self.heads_in(transport, qkv, Some((grad_out, &glse)))?;
        drop(glse);
        let (out, lse) = self.forward_over_groups(transport, &sp)?;
        let mut delta = Vec::with_capacity(out.len());
        for ((go, o), (l, g)) in sp.go.iter().zip(&out).zip(lse.iter().zip(&sp.glse)) {
            delta.push(x.delta(go, o, Some((&x.acc_as_stats(g)?, l)))?);
        }
        drop(out);
        let ups: Vec<_> = sp
            .go
            .iter()
            .zip(lse.iter().zip(&delta))
            .map(|(go, (lse, delta))| ChunkUpstream { grad_out: &**go, lse, delta })
            .collect();
        let mut dq = sp.q.iter().map(|t| x.zero_acc(x.shape_of(t))).collect::<Result<Vec<_>>>()?;
        let zeros = |ks: &[Arc<X::Rows>]| ks.iter().map(|t| x.zero_acc(x.shape_of(t))).collect::<Result<Vec<_>>>();
        let (mut dk, mut dv) = (zeros(&sp.k)?, zeros(&sp.k)?);
        self.attend_backward(&sp, &ups, (&sp.k, &sp.v, &sp.starts), &mut dq, (&mut dk, &mut dv))?;
        let (u, world, groups) = (split.u, problem.world, split.groups);
        let mk = split.slot_kv(self.at.slot).len();
        if groups > 1 {
            let (mut k, mut v, mut owner) = (sp.k.clone(), sp.v.clone(), self.at.rank);
            for step in 1..groups {
                let src = self.at.arriving(step);
                let arriving = group_shapes(problem, split, src, mk)?;
                let (kind, hop) = (TravelKind::KvGrad, u);
                let mut a = transport.shift(x, problem, Travel { kind, owner, hop, step, k, v, dk, dv, arriving })?;
                let starts = group_starts(problem, split, src);
                self.attend_backward(&sp, &ups, (&a.k, &a.v, &starts), &mut dq, (&mut a.dk, &mut a.dv))?;
                (k, v, dk, dv, owner) = (a.k, a.v, a.dk, a.dv, (owner + world - hop) % world);
            }
            // Home: the held block belongs to the next group; this group's comes from the previous.
            let arriving = group_shapes(problem, split, self.at.group, mk)?;
            let (kind, step, k, v) = (TravelKind::GradHome, groups, Vec::new(), Vec::new());
            let a = transport.shift(x, problem, Travel { kind, owner, hop: u, step, k, v, dk, dv, arriving })?;
            (dk, dv) = (a.dk, a.dv);
        }
        drop(ups);
        drop((delta, lse));
        self.grads_out(transport, &sp.counts, [dq, dk, dv])
    }

    /// The second all-to-all of the backward: each member's pieces of this slot's dq and of
    /// its key/value heads' dk/dv; returns this rank's pieces of every head, in `T`.
    fn grads_out<Tr: ChunkTransport<T, X> + ?Sized>(
        &self,
        transport: &mut Tr,
        counts: &[usize],
        [dq, dk, dv]: [Vec<X::Acc>; 3],
    ) -> Result<[Vec<X::Rows>; 3]> {
        let (x, problem, split) = (self.compute, self.problem, self.split());
        let (heads, kvh, d, me) = (problem.heads, problem.kv_heads, problem.head_dim, self.at.rank);
        let parcels = runs(dq, counts)
            .into_iter()
            .zip(runs(dk, counts).into_iter().zip(runs(dv, counts)))
            .map(|(q, (k, v))| Parcel { rows: Vec::new(), accs: q.into_iter().chain(k).chain(v).collect() })
            .collect();
        let expect = (0..self.at.members.len())
            .map(|j| {
                let (h, kv) = (split.slot_heads(j).len(), split.slot_kv(j).len());
                let mut accs = shapes(problem, me, h, d)?;
                accs.extend(shapes(problem, me, kv, d)?);
                accs.extend(shapes(problem, me, kv, d)?);
                Ok(ParcelShapes { rows: Vec::new(), accs })
            })
            .collect::<Result<Vec<_>>>()?;
        let got = transport.all_to_all(x, Exchange::GradsOut, &self.at.members, parcels, &expect)?;
        let zeros =
            |h| -> Result<Vec<X::Acc>> { shapes(problem, me, h, d)?.into_iter().map(|s| x.zero_acc(s)).collect() };
        let (mut gq, mut gk, mut gv) = (zeros(heads)?, zeros(kvh)?, zeros(kvh)?);
        let n = rank_pieces(problem, me).len();
        for (j, p) in got.into_iter().enumerate() {
            let (hs, ks) = (split.slot_heads(j).start, split.slot_kv(j).start);
            for (i, a) in p.accs.iter().enumerate() {
                let (dst, first) = match i / n {
                    0 => (&mut gq[i % n], hs),
                    1 => (&mut gk[i % n], ks),
                    _ => (&mut gv[i % n], ks),
                };
                x.add_acc_heads(dst, first, a)?;
            }
        }
        let store = |xs: Vec<X::Acc>| xs.iter().map(|a| x.store_acc(a)).collect::<Result<Vec<_>>>();
        Ok([store(gq)?, store(gk)?, store(gv)?])
    }
}
