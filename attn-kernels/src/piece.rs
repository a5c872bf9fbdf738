//! Block calls split into pieces: the selected rows of each segment, found from global
//! positions (sorted if the caller's were not), handed to the tile kernels and
//! scattered back (forward: LSE merge; backward: `+=`).

use std::cell::RefCell;

use attn_core::{Element, LseMerge, SegmentPattern};

use crate::isa::Isa;
use crate::pack::PieceRows;
use crate::tile_backward::{BackwardScratch, QueryGrads, dkv_piece};
use crate::tile_forward::{ForwardScratch, forward_piece};

thread_local! {
    /// Kernel buffers reused across block calls on one thread (the ring calls often).
    static FORWARD_SCRATCH: RefCell<ForwardScratch> = RefCell::new(ForwardScratch::default());
    static BACKWARD_SCRATCH: RefCell<BackwardScratch> = RefCell::new(BackwardScratch::default());
}

/// A block's rows as `(data, stride, positions)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Strided<'a, T> {
    pub data: &'a [T],
    pub stride: usize,
    pub pos: &'a [usize],
}

/// The selected rows of one segment: block row indices, offsets, positions (ascending).
#[derive(Debug, Default)]
struct Group {
    segment: usize,
    rows: Vec<usize>,
    offsets: Vec<usize>,
    pos: Vec<usize>,
}

/// Selected rows of the block grouped by segment, ascending by position.
fn groups(pattern: &SegmentPattern, pos: &[usize], stride: usize) -> Vec<Group> {
    let mut idx: Vec<usize> = (0..pos.len()).filter(|&i| pattern.is_selected(pos[i])).collect();
    if !idx.windows(2).all(|w| pos[w[0]] <= pos[w[1]]) {
        idx.sort_by_key(|&i| pos[i]);
    }
    let mut out: Vec<Group> = Vec::new();
    for i in idx {
        let seg = pattern.segment_of(pos[i]);
        if out.last().is_none_or(|g| g.segment != seg) {
            out.push(Group { segment: seg, ..Group::default() });
        }
        let g = out.last_mut().expect("just pushed");
        g.rows.push(i);
        g.offsets.push(i * stride);
        g.pos.push(pos[i]);
    }
    out
}

/// Pairs of (query group, key group) of the same segment.
fn matched<'g>(qg: &'g [Group], kg: &'g [Group]) -> impl Iterator<Item = (&'g Group, &'g Group)> {
    qg.iter().filter_map(move |g| kg.binary_search_by_key(&g.segment, |h| h.segment).ok().map(|j| (g, &kg[j])))
}

fn rows<'a, T>(s: &Strided<'a, T>, g: &'a Group) -> PieceRows<'a, T> {
    PieceRows { data: s.data, offsets: &g.offsets, pos: &g.pos }
}

/// Forward of a block, LSE-merged into `(out, lse)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_block<T: Element>(
    isa: Isa,
    pattern: &SegmentPattern,
    causal: bool,
    scale: f32,
    d: usize,
    q: &Strided<'_, T>,
    k: &Strided<'_, T>,
    v: &Strided<'_, T>,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let (qg, kg) = (groups(pattern, q.pos, q.stride), groups(pattern, k.pos, k.stride));
    FORWARD_SCRATCH.with_borrow_mut(|ws| forward_groups(isa, causal, scale, d, q, k, v, &qg, &kg, ws, out, lse));
}

#[allow(clippy::too_many_arguments)]
fn forward_groups<T: Element>(
    isa: Isa,
    causal: bool,
    scale: f32,
    d: usize,
    q: &Strided<'_, T>,
    k: &Strided<'_, T>,
    v: &Strided<'_, T>,
    qg: &[Group],
    kg: &[Group],
    ws: &mut ForwardScratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let (mut o, mut l) = (Vec::new(), Vec::new());
    for (g, h) in matched(qg, kg) {
        let vr = PieceRows { data: v.data, offsets: &h.offsets, pos: &h.pos };
        o.resize(g.rows.len() * d, 0.0);
        l.resize(g.rows.len(), 0.0);
        forward_piece(isa, scale, d, causal, &rows(q, g), &rows(k, h), &vr, ws, &mut o, &mut l);
        for (i, &r) in g.rows.iter().enumerate() {
            LseMerge::merge_into(&mut out[r * d..(r + 1) * d], &mut lse[r], &o[i * d..(i + 1) * d], l[i]);
        }
    }
}

/// Gradient buffers of one block call (see `attend_block_backward`).
#[derive(Debug)]
pub(crate) struct BlockGrads<'a, G> {
    /// grad_out rows (one per q row) and the factor that makes them effective.
    pub grad_out: Strided<'a, G>,
    pub grad_scale: f32,
    pub lse: &'a [f32],
    pub delta: &'a [f32],
    pub dq: &'a mut [f32],
    pub dk: &'a mut [f32],
    pub dv: &'a mut [f32],
}

/// Backward of a block, accumulated into `dq`, `dk`, `dv`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_block<T: Element, G: Element>(
    isa: Isa,
    pattern: &SegmentPattern,
    causal: bool,
    scale: f32,
    d: usize,
    q: &Strided<'_, T>,
    k: &Strided<'_, T>,
    v: &Strided<'_, T>,
    grads: BlockGrads<'_, G>,
) {
    let (qg, kg) = (groups(pattern, q.pos, q.stride), groups(pattern, k.pos, k.stride));
    BACKWARD_SCRATCH.with_borrow_mut(|ws| backward_groups(isa, causal, scale, d, q, k, v, &qg, &kg, ws, grads));
}

#[allow(clippy::too_many_arguments)]
fn backward_groups<T: Element, G: Element>(
    isa: Isa,
    causal: bool,
    scale: f32,
    d: usize,
    q: &Strided<'_, T>,
    k: &Strided<'_, T>,
    v: &Strided<'_, T>,
    qg: &[Group],
    kg: &[Group],
    ws: &mut BackwardScratch,
    grads: BlockGrads<'_, G>,
) {
    let (mut dq, mut dk, mut dv) = (Vec::new(), Vec::new(), Vec::new());
    for (g, h) in matched(qg, kg) {
        let go_offsets: Vec<usize> = g.rows.iter().map(|&r| r * grads.grad_out.stride).collect();
        let lse: Vec<f32> = g.rows.iter().map(|&r| grads.lse[r]).collect();
        let delta: Vec<f32> = g.rows.iter().map(|&r| grads.delta[r]).collect();
        let qg = QueryGrads {
            go: PieceRows { data: grads.grad_out.data, offsets: &go_offsets, pos: &g.pos },
            go_scale: grads.grad_scale,
            lse: &lse,
            delta: &delta,
        };
        let vr = PieceRows { data: v.data, offsets: &h.offsets, pos: &h.pos };
        let (qr, kr) = (rows(q, g), rows(k, h));
        dq.clear();
        dq.resize(g.rows.len() * d, 0.0);
        dk.clear();
        dk.resize(h.rows.len() * d, 0.0);
        dv.clear();
        dv.resize(h.rows.len() * d, 0.0);
        // The piece owns all its rows here, so dq, dk and dv come from one fused pass.
        dkv_piece(isa, scale, d, causal, &qr, &kr, &vr, &qg, ws, &mut dk, &mut dv, Some(&mut dq));
        for (i, &r) in g.rows.iter().enumerate() {
            grads.dq[r * d..(r + 1) * d].iter_mut().zip(&dq[i * d..]).for_each(|(a, b)| *a += b);
        }
        for (j, &r) in h.rows.iter().enumerate() {
            grads.dk[r * d..(r + 1) * d].iter_mut().zip(&dk[j * d..]).for_each(|(a, b)| *a += b);
            grads.dv[r * d..(r + 1) * d].iter_mut().zip(&dv[j * d..]).for_each(|(a, b)| *a += b);
        }
    }
}
