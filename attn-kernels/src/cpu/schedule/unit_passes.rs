//! What one work unit computes into its worker's f32 accumulators: the forward (all
//! patterns of the head, LSE-merged), the two-kernel backward (query chunks for dq, key
//! chunks for dk/dv over every query head reading the key/value head) and the fused
//! one-pass backward over whole segments. Pieces hold only the keys a query may see:
//! the segment's selected keys inside the band of the piece's queries, padded keys
//! left out; under a block mask each piece is cut into the sub-pieces of its kept
//! blocks (`block_split`).

use std::ops::Range;

use attn_core::{Element, LseMerge, SegmentPattern, TensorView};

use crate::cpu::isa::rows::{Piece, PieceRows, PieceSpec};
use crate::cpu::schedule::block_split::{HeadBlocks, Outer, block_runs, kept_rows};
use crate::cpu::schedule::units::{Lane, Plan, Unit};
use crate::cpu::tiles::forward_scratch::ForwardScratch;
use crate::cpu::tiles::piece_forward::forward_piece;
use crate::cpu::tiles::tile_backward::{BackwardScratch, QueryGrads, dkv_piece, dq_piece};

/// One piece's rows: lane-relative positions, element offsets, and the per-query
/// upstream inputs of the backward.
#[derive(Debug, Default)]
struct PieceIndex {
    qpos: Vec<usize>,
    kpos: Vec<usize>,
    qoff: Vec<usize>,
    koff: Vec<usize>,
    voff: Vec<usize>,
    goff: Vec<usize>,
    lse: Vec<f32>,
    delta: Vec<f32>,
}

impl PieceIndex {
    /// The piece's query, key and value rows.
    fn rows<'s, 'a, T: Element>(&'s self, plan: &Plan<'a, T>) -> [PieceRows<'s, T>; 3]
    where
        'a: 's,
    {
        [
            PieceRows { data: plan.q.data(), offsets: &self.qoff, pos: &self.qpos },
            PieceRows { data: plan.k.data(), offsets: &self.koff, pos: &self.kpos },
            PieceRows { data: plan.v.data(), offsets: &self.voff, pos: &self.kpos },
        ]
    }

    /// The backward's per-query inputs (after [`PieceIndex::fill_query_grads`]).
    fn query_grads<'s, 'a, T: Element>(&'s self, g: &Grads<'a, T>, go_scale: f64) -> QueryGrads<'s, T>
    where
        'a: 's,
    {
        QueryGrads {
            go: PieceRows { data: g.grad_out.data(), offsets: &self.goff, pos: &self.qpos },
            go_scale: go_scale as f32,
            lse: &self.lse,
            delta: &self.delta,
        }
    }
}

/// Per-worker buffers.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    fwd: ForwardScratch,
    bwd: BackwardScratch,
    idx: PieceIndex,
    split: Split,
    pub acc_a: Vec<f32>,
    pub acc_b: Vec<f32>,
    pub acc_c: Vec<f32>,
    pub acc_l: Vec<f32>,
    pa: Vec<f32>,
    pb: Vec<f32>,
    pc: Vec<f32>,
    pl: Vec<f32>,
}

/// A block-masked piece's rows before the split, and its runs of blocks.
#[derive(Debug, Default)]
struct Split {
    q: Vec<usize>,
    k: Vec<usize>,
    runs: Vec<Range<usize>>,
}

/// Runs `piece` on the rows in `idx` (queries `qpos`, keys `kpos`) or, under a block
/// mask, once on each sub-piece of its kept blocks (runs of `outer` blocks; a sub-piece
/// with no inner row is left out: its rows keep `o = 0`, `lse = -inf` there).
fn each_piece(
    blocks: Option<HeadBlocks<'_>>,
    outer: Outer,
    idx: &mut PieceIndex,
    split: &mut Split,
    mut piece: impl FnMut(&mut PieceIndex),
) {
    let Some(hb) = blocks else { return piece(idx) };
    let Split { q, k, runs } = split;
    std::mem::swap(&mut idx.qpos, q);
    std::mem::swap(&mut idx.kpos, k);
    let (all_outer, all_inner) = match outer {
        Outer::Queries => (&*q, &*k),
        Outer::Keys => (&*k, &*q),
    };
    block_runs(&hb, outer, all_outer, runs);
    for r in runs.iter() {
        let (o, i) = match outer {
            Outer::Queries => (&mut idx.qpos, &mut idx.kpos),
            Outer::Keys => (&mut idx.kpos, &mut idx.qpos),
        };
        kept_rows(&hb, outer, all_outer[r.start] / hb.block_size(), all_inner, i);
        if i.is_empty() {
            continue;
        }
        o.clear();
        o.extend_from_slice(&all_outer[r.clone()]);
        piece(idx);
    }
}

fn zeroed(v: &mut Vec<f32>, len: usize, x: f32) -> &mut [f32] {
    v.clear();
    v.resize(len, x);
    v
}

/// Inputs of the backward besides q, k, v.
pub(crate) struct Grads<'a, T> {
    pub out: TensorView<'a, T>,
    pub lse: &'a [f32],
    pub grad_out: TensorView<'a, T>,
    /// The gradient into the LSE (laid out like it), subtracted from `delta`.
    pub grad_lse: Option<&'a [f32]>,
}

fn fill_positions(dst: &mut Vec<usize>, it: impl Iterator<Item = usize>) {
    dst.clear();
    dst.extend(it);
}

/// Element offsets of lane-relative rows `pos` of head `h`.
fn fill_offsets<T: Element>(dst: &mut Vec<usize>, view: &TensorView<'_, T>, lane: Lane, h: usize, pos: &[usize]) {
    dst.clear();
    dst.extend(pos.iter().map(|&p| view.offset(lane.b, lane.base + p, h)));
}

impl<T: Element> Plan<'_, T> {
    fn spec(&self) -> PieceSpec {
        PieceSpec { isa: self.isa, scale: self.scale, d: self.d, band: self.band }
    }

    /// The selected, unpadded keys of segment `seg` of `p` in `lane` that some query in
    /// `first_q..=last_q` may see, into `dst`.
    fn keys_for(&self, dst: &mut Vec<usize>, lane: Lane, p: &SegmentPattern, seg: usize, qs: (usize, usize)) {
        let bounds = p.segment_bounds(seg, lane.kv_len);
        let reach = self.band.keys_of_queries(qs.0, qs.1);
        let (lo, hi) = (bounds.start.max(reach.start), bounds.end.min(reach.end));
        dst.clear();
        if lo < hi {
            dst.extend(p.selected_in_range(lo..hi).filter(|&k| !self.is_padding(lane, k)));
        }
    }

    /// The selected queries of segment `seg` of `p` in `lane` that may see some key in
    /// `first_k..=last_k`, into `dst`.
    fn queries_for(&self, dst: &mut Vec<usize>, lane: Lane, p: &SegmentPattern, seg: usize, ks: (usize, usize)) {
        let bounds = p.segment_bounds(seg, lane.q_len);
        let reach = self.band.queries_of_keys(ks.0, ks.1);
        let (lo, hi) = (bounds.start.max(reach.start), bounds.end.min(reach.end));
        dst.clear();
        if lo < hi {
            dst.extend(p.selected_in_range(lo..hi));
        }
    }
}

impl PieceIndex {
    /// Offsets of the query rows (query head `h`) and key/value rows (head `hk`) of a lane.
    fn fill_offsets<T: Element>(&mut self, plan: &Plan<'_, T>, lane: Lane, h: usize, hk: usize) {
        fill_offsets(&mut self.qoff, &plan.q, lane, h, &self.qpos);
        fill_offsets(&mut self.koff, &plan.k, lane, hk, &self.kpos);
        fill_offsets(&mut self.voff, &plan.v, lane, hk, &self.kpos);
    }

    /// The grad_out offsets, final LSE and `delta = grad_out . out - grad_lse` of the query
    /// rows (query head `h`).
    fn fill_query_grads<T: Element>(&mut self, plan: &Plan<'_, T>, g: &Grads<'_, T>, lane: Lane, h: usize) {
        let s = plan.q.shape();
        fill_offsets(&mut self.goff, &g.grad_out, lane, h, &self.qpos);
        self.lse.clear();
        self.lse.extend(self.qpos.iter().map(|&p| g.lse[(lane.b * s.seq + lane.base + p) * s.heads + h]));
        self.delta.clear();
        self.delta.extend(self.qpos.iter().map(|&p| {
            let (go, o) = (g.grad_out.row(lane.b, lane.base + p, h), g.out.row(lane.b, lane.base + p, h));
            let dot = go.iter().zip(o).map(|(a, b)| a.to_f32() * b.to_f32()).sum::<f32>();
            // d(lse)/d(score) is the softmax weight: a gradient into the LSE lowers delta.
            dot - g.grad_lse.map_or(0.0, |gl| gl[(lane.b * s.seq + lane.base + p) * s.heads + h])
        }));
    }

    /// The selected queries of segment `seg` of `p` inside lane rows `c0..c1`.
    fn fill_queries_in(&mut self, p: &SegmentPattern, seg: usize, lane: Lane, (c0, c1): (usize, usize)) {
        let bounds = p.segment_bounds(seg, lane.q_len);
        fill_positions(&mut self.qpos, p.selected_in_range(bounds.start.max(c0)..bounds.end.min(c1)));
    }
}

/// `acc[t*d..] += src[i*d..]` for one row.
#[inline]
fn add_row(acc: &mut [f32], t: usize, src: &[f32], i: usize, d: usize) {
    acc[t * d..(t + 1) * d].iter_mut().zip(&src[i * d..(i + 1) * d]).for_each(|(a, b)| *a += b)
}

/// Forward of one unit (a query head) into `ws.acc_a` (`[c1-c0, d]`, merged, unscaled)
/// and `ws.acc_l`.
pub(crate) fn forward_unit<T: Element>(plan: &Plan<'_, T>, u: Unit, ws: &mut Scratch) {
    let (d, n, lane) = (plan.d, u.c1 - u.c0, u.lane);
    let Scratch { fwd, idx, split, acc_a, acc_l, pa, pl, .. } = ws;
    zeroed(acc_a, n * d, 0.0);
    zeroed(acc_l, n, f32::NEG_INFINITY);
    for (_, p) in &plan.heads[u.h].patterns {
        for seg in p.segment_of(u.c0)..=p.segment_of(u.c1 - 1) {
            idx.fill_queries_in(p, seg, lane, (u.c0, u.c1));
            let (Some(&first), Some(&last)) = (idx.qpos.first(), idx.qpos.last()) else { continue };
            plan.keys_for(&mut idx.kpos, lane, p, seg, (first, last));
            if idx.kpos.is_empty() {
                continue; // every query of the piece keeps o = 0, lse = -inf for this pattern
            }
            each_piece(plan.head_blocks(lane, u.h), Outer::Queries, idx, split, |idx| {
                idx.fill_offsets(plan, lane, u.h, u.h / plan.group);
                let nq = idx.qpos.len();
                let (po, pl) = (zeroed(pa, nq * d, 0.0), zeroed(pl, nq, f32::NEG_INFINITY));
                let [q, k, v] = idx.rows(plan);
                forward_piece(plan.spec(), &Piece { q: &q, k: &k, v: &v }, fwd, po, pl);
                for (i, &qp) in idx.qpos.iter().enumerate() {
                    let t = qp - u.c0;
                    let (acc, po) = (&mut acc_a[t * d..(t + 1) * d], &po[i * d..(i + 1) * d]);
                    LseMerge::merge_into(acc, &mut acc_l[t], po, pl[i]);
                }
            });
        }
    }
}

/// dq of one query chunk (a query head) into `ws.acc_a` (`[c1-c0, d]`).
pub(crate) fn dq_unit<T: Element>(plan: &Plan<'_, T>, g: &Grads<'_, T>, u: Unit, ws: &mut Scratch) {
    let (d, n, lane) = (plan.d, u.c1 - u.c0, u.lane);
    let Scratch { bwd, idx, split, acc_a, pa, .. } = ws;
    zeroed(acc_a, n * d, 0.0);
    let hp = &plan.heads[u.h];
    for (_, p) in &hp.patterns {
        for seg in p.segment_of(u.c0)..=p.segment_of(u.c1 - 1) {
            idx.fill_queries_in(p, seg, lane, (u.c0, u.c1));
            let (Some(&first), Some(&last)) = (idx.qpos.first(), idx.qpos.last()) else { continue };
            plan.keys_for(&mut idx.kpos, lane, p, seg, (first, last));
            if idx.kpos.is_empty() {
                continue;
            }
            each_piece(plan.head_blocks(lane, u.h), Outer::Queries, idx, split, |idx| {
                idx.fill_offsets(plan, lane, u.h, u.h / plan.group);
                idx.fill_query_grads(plan, g, lane, u.h);
                let pdq = zeroed(pa, idx.qpos.len() * d, 0.0);
                let [q, k, v] = idx.rows(plan);
                dq_piece(plan.spec(), &Piece { q: &q, k: &k, v: &v }, &idx.query_grads(g, hp.out_scale), bwd, pdq);
                for (i, &qp) in idx.qpos.iter().enumerate() {
                    add_row(acc_a, qp - u.c0, pdq, i, d);
                }
            });
        }
    }
}

/// dk, dv of one key chunk (a key/value head, summed over the query heads reading it)
/// into `ws.acc_a`, `ws.acc_b` (`[c1-c0, d]` each).
pub(crate) fn dkv_unit<T: Element>(plan: &Plan<'_, T>, g: &Grads<'_, T>, u: Unit, ws: &mut Scratch) {
    let (d, n, lane) = (plan.d, u.c1 - u.c0, u.lane);
    let Scratch { bwd, idx, split, acc_a, acc_b, pa, pb, .. } = ws;
    zeroed(acc_a, n * d, 0.0);
    zeroed(acc_b, n * d, 0.0);
    for h in u.h * plan.group..(u.h + 1) * plan.group {
        let hp = &plan.heads[h];
        for (_, p) in &hp.patterns {
            for seg in p.segment_of(u.c0)..=p.segment_of(u.c1 - 1) {
                let bounds = p.segment_bounds(seg, lane.kv_len);
                let keys = p.selected_in_range(bounds.start.max(u.c0)..bounds.end.min(u.c1));
                fill_positions(&mut idx.kpos, keys.filter(|&k| !plan.is_padding(lane, k)));
                let (Some(&first), Some(&last)) = (idx.kpos.first(), idx.kpos.last()) else { continue };
                plan.queries_for(&mut idx.qpos, lane, p, seg, (first, last));
                if idx.qpos.is_empty() {
                    continue;
                }
                each_piece(plan.head_blocks(lane, h), Outer::Keys, idx, split, |idx| {
                    idx.fill_offsets(plan, lane, h, u.h);
                    idx.fill_query_grads(plan, g, lane, h);
                    let nk = idx.kpos.len();
                    let (pdk, pdv) = (zeroed(pa, nk * d, 0.0), zeroed(pb, nk * d, 0.0));
                    let [q, k, v] = idx.rows(plan);
                    let qg = idx.query_grads(g, hp.out_scale);
                    dkv_piece(plan.spec(), &Piece { q: &q, k: &k, v: &v }, &qg, bwd, pdk, pdv, None);
                    for (j, &kp) in idx.kpos.iter().enumerate() {
                        add_row(acc_a, kp - u.c0, pdk, j, d);
                        add_row(acc_b, kp - u.c0, pdv, j, d);
                    }
                });
            }
        }
    }
}

/// dq, dk, dv of one fused unit (a key/value head and the `plan.group` query heads
/// reading it; whole segments of every pattern), one pass per segment: dk, dv into
/// `ws.acc_a`, `ws.acc_b` (`[c1-c0, d]`), dq of the group's `i`-th query head into
/// `ws.acc_c[i * (c1-c0) * d..]`.
pub(crate) fn fused_unit<T: Element>(plan: &Plan<'_, T>, g: &Grads<'_, T>, u: Unit, ws: &mut Scratch) {
    let (d, n, lane) = (plan.d, u.c1 - u.c0, u.lane);
    let Scratch { bwd, idx, split, acc_a, acc_b, acc_c, pa, pb, pc, .. } = ws;
    zeroed(acc_a, n * d, 0.0);
    zeroed(acc_b, n * d, 0.0);
    zeroed(acc_c, plan.group * n * d, 0.0);
    for (gi, h) in (u.h * plan.group..(u.h + 1) * plan.group).enumerate() {
        let hp = &plan.heads[h];
        for (_, p) in &hp.patterns {
            for seg in p.segment_of(u.c0)..=p.segment_of(u.c1 - 1) {
                fill_positions(&mut idx.qpos, p.selected_in_segment(seg, lane.q_len));
                fill_positions(&mut idx.kpos, idx.qpos.iter().copied().filter(|&k| !plan.is_padding(lane, k)));
                if idx.kpos.is_empty() {
                    continue;
                }
                each_piece(plan.head_blocks(lane, h), Outer::Queries, idx, split, |idx| {
                    idx.fill_offsets(plan, lane, h, u.h);
                    idx.fill_query_grads(plan, g, lane, h);
                    let (m, mk) = (idx.qpos.len(), idx.kpos.len());
                    let (pdk, pdv, pdq) = (zeroed(pa, mk * d, 0.0), zeroed(pb, mk * d, 0.0), zeroed(pc, m * d, 0.0));
                    let [q, k, v] = idx.rows(plan);
                    let qg = idx.query_grads(g, hp.out_scale);
                    dkv_piece(plan.spec(), &Piece { q: &q, k: &k, v: &v }, &qg, bwd, pdk, pdv, Some(pdq));
                    for (j, &kp) in idx.kpos.iter().enumerate() {
                        add_row(acc_a, kp - u.c0, pdk, j, d);
                        add_row(acc_b, kp - u.c0, pdv, j, d);
                    }
                    for (i, &qp) in idx.qpos.iter().enumerate() {
                        add_row(acc_c, gi * n + qp - u.c0, pdq, i, d);
                    }
                });
            }
        }
    }
}
