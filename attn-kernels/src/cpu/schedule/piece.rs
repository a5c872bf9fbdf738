//! Block calls split into pieces: the selected rows of each segment (of each packed
//! sequence), found from global positions (sorted if the caller's were not), padded keys
//! left out, handed to the tile kernels and scattered back (forward: LSE merge;
//! backward: `+=`). Every list and buffer lives in a per-thread [`BlockScratch`], so a
//! warm thread's block calls allocate nothing.

use std::cell::RefCell;

use std::ops::Range;

use attn_core::{Element, LseMerge, PackedSequences, SegmentPattern};

use crate::cpu::isa::rows::{Piece, PieceRows, PieceSpec};
use crate::cpu::schedule::block_split::{HeadBlocks, Outer, block_runs, kept_ranges};
use crate::cpu::tiles::forward_scratch::ForwardScratch;
use crate::cpu::tiles::piece_forward::forward_piece;
use crate::cpu::tiles::tile_backward::{BackwardScratch, QueryGrads, dkv_piece};

thread_local! {
    /// Buffers reused across block calls on one thread (the ring calls often).
    static SCRATCH: RefCell<BlockScratch> = RefCell::new(BlockScratch::default());
}

/// A block's rows as `(data, stride, positions)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Strided<'a, T> {
    pub data: &'a [T],
    pub stride: usize,
    pub pos: &'a [usize],
}

/// Where a block's rows sit: the pattern (on positions relative to a row's packed
/// sequence), the packing, and the key padding (by global position).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowRule<'a> {
    pub pattern: SegmentPattern,
    pub packing: Option<PackedSequences<'a>>,
    pub key_padding: Option<&'a [bool]>,
    /// The block mask of the block's batch row and query head (positions from the start
    /// of the row or packed sequence).
    pub blocks: Option<HeadBlocks<'a>>,
}

/// Which rows a group list holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Queries,
    /// Keys: padded ones are left out.
    Keys,
}

impl RowRule<'_> {
    /// The global position where sequence `seq` starts (0 without packing).
    fn sequence_start(&self, seq: usize) -> usize {
        self.packing.map_or(0, |pk| pk.bounds(seq).start)
    }

    /// The (sequence, segment) of global position `p` if the pattern selects it.
    #[inline]
    fn place(&self, p: usize) -> Option<(usize, usize)> {
        let (seq, start) = match self.packing {
            Some(pk) => {
                let s = pk.sequence_of(p);
                (s, pk.bounds(s).start)
            }
            None => (0, 0),
        };
        let rel = p - start;
        self.pattern.is_selected(rel).then(|| (seq, self.pattern.segment_of(rel)))
    }
}

/// The selected rows of one segment: block row indices, offsets, positions (ascending).
#[derive(Debug, Default)]
struct Group {
    segment: (usize, usize),
    rows: Vec<usize>,
    offsets: Vec<usize>,
    pos: Vec<usize>,
}

impl Group {
    /// This group holds `src`'s rows in `ranges` (of its indices), in order.
    fn fill_from(&mut self, src: &Group, ranges: impl Iterator<Item = Range<usize>>) {
        self.segment = src.segment;
        self.rows.clear();
        self.offsets.clear();
        self.pos.clear();
        for r in ranges {
            self.rows.extend_from_slice(&src.rows[r.clone()]);
            self.offsets.extend_from_slice(&src.offsets[r.clone()]);
            self.pos.extend_from_slice(&src.pos[r]);
        }
    }
}

/// The scratch of cutting a matched pair of groups by a block mask.
#[derive(Debug, Default)]
struct SubSplit {
    qrel: Vec<usize>,
    krel: Vec<usize>,
    runs: Vec<Range<usize>>,
    kept: Vec<Range<usize>>,
    q: Group,
    k: Group,
}

/// `f` on a matched pair of groups, or, under a block mask, on each run of its query
/// blocks with equal mask rows and the key rows of the blocks that run keeps (a removed
/// tile's rows are never passed on; a run keeping no key is left out, its rows keep
/// `o = 0`, `lse = -inf` there).
fn each_sub_pair(rule: &RowRule<'_>, g: &Group, h: &Group, split: &mut SubSplit, mut f: impl FnMut(&Group, &Group)) {
    let Some(hb) = rule.blocks else { return f(g, h) };
    let start = rule.sequence_start(g.segment.0);
    let SubSplit { qrel, krel, runs, kept, q, k } = split;
    qrel.clear();
    qrel.extend(g.pos.iter().map(|&p| p - start));
    krel.clear();
    krel.extend(h.pos.iter().map(|&p| p - start));
    block_runs(&hb, Outer::Queries, qrel, runs);
    for r in runs.iter() {
        kept_ranges(&hb, Outer::Queries, qrel[r.start] / hb.block_size(), krel, kept);
        if kept.is_empty() {
            continue;
        }
        q.fill_from(g, std::iter::once(r.clone()));
        k.fill_from(h, kept.iter().cloned());
        f(q, k);
    }
}

/// Selected rows of a block grouped by segment, ascending by position; the groups (and
/// their vectors) of earlier calls are kept and refilled.
#[derive(Debug, Default)]
struct GroupList {
    groups: Vec<Group>,
    len: usize,
}

impl GroupList {
    fn fill(&mut self, rule: &RowRule<'_>, role: Role, (pos, stride): (&[usize], usize), idx: &mut Vec<usize>) {
        let padded = |p: usize| role == Role::Keys && rule.key_padding.is_some_and(|m| m[p]);
        idx.clear();
        idx.extend((0..pos.len()).filter(|&i| rule.place(pos[i]).is_some() && !padded(pos[i])));
        if !idx.windows(2).all(|w| pos[w[0]] <= pos[w[1]]) {
            // Unstable sort (no buffer); ties keep the caller's order through the index.
            idx.sort_unstable_by_key(|&i| (pos[i], i));
        }
        self.len = 0;
        for &i in idx.iter() {
            let Some(seg) = rule.place(pos[i]) else { continue };
            if self.len == 0 || self.groups[self.len - 1].segment != seg {
                if self.len == self.groups.len() {
                    self.groups.push(Group::default());
                }
                let g = &mut self.groups[self.len];
                g.segment = seg;
                g.rows.clear();
                g.offsets.clear();
                g.pos.clear();
                self.len += 1;
            }
            let g = &mut self.groups[self.len - 1];
            g.rows.push(i);
            g.offsets.push(i * stride);
            g.pos.push(pos[i]);
        }
    }

    fn as_slice(&self) -> &[Group] {
        &self.groups[..self.len]
    }
}

/// Everything a block call needs besides the caller's buffers.
#[derive(Debug, Default)]
struct BlockScratch {
    idx: Vec<usize>,
    qg: GroupList,
    kg: GroupList,
    /// One piece's output, lse, gradients and gathered per-row inputs.
    o: Vec<f32>,
    l: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    go_offsets: Vec<usize>,
    lse: Vec<f32>,
    delta: Vec<f32>,
    forward: ForwardScratch,
    backward: BackwardScratch,
    split: SubSplit,
}

impl BlockScratch {
    fn group(&mut self, rule: &RowRule<'_>, q: (&[usize], usize), k: (&[usize], usize)) {
        self.qg.fill(rule, Role::Queries, q, &mut self.idx);
        self.kg.fill(rule, Role::Keys, k, &mut self.idx);
    }
}

/// Pairs of (query group, key group) of the same segment.
fn matched<'g>(qg: &'g [Group], kg: &'g [Group]) -> impl Iterator<Item = (&'g Group, &'g Group)> {
    qg.iter().filter_map(move |g| kg.binary_search_by_key(&g.segment, |h| h.segment).ok().map(|j| (g, &kg[j])))
}

fn rows<'a, T>(s: &Strided<'a, T>, g: &'a Group) -> PieceRows<'a, T> {
    PieceRows { data: s.data, offsets: &g.offsets, pos: &g.pos }
}

/// Forward of a block under `rule`, LSE-merged into `(out, lse)`.
pub(crate) fn forward_block<T: Element>(
    spec: PieceSpec,
    rule: &RowRule<'_>,
    [q, k, v]: [&Strided<'_, T>; 3],
    out: &mut [f32],
    lse: &mut [f32],
) {
    let d = spec.d;
    SCRATCH.with_borrow_mut(|ws| {
        ws.group(rule, (q.pos, q.stride), (k.pos, k.stride));
        let BlockScratch { qg, kg, o, l, forward, split, .. } = ws;
        for (g, h) in matched(qg.as_slice(), kg.as_slice()) {
            each_sub_pair(rule, g, h, split, |g, h| {
                let vr = PieceRows { data: v.data, offsets: &h.offsets, pos: &h.pos };
                o.resize(g.rows.len() * d, 0.0);
                l.resize(g.rows.len(), 0.0);
                forward_piece(spec, &Piece { q: &rows(q, g), k: &rows(k, h), v: &vr }, forward, o, l);
                for (i, &r) in g.rows.iter().enumerate() {
                    LseMerge::merge_into(&mut out[r * d..(r + 1) * d], &mut lse[r], &o[i * d..(i + 1) * d], l[i]);
                }
            });
        }
    });
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

/// Backward of a block under `rule`, accumulated into `dq`, `dk`, `dv`.
pub(crate) fn backward_block<T: Element, G: Element>(
    spec: PieceSpec,
    rule: &RowRule<'_>,
    [q, k, v]: [&Strided<'_, T>; 3],
    mut grads: BlockGrads<'_, G>,
) {
    let d = spec.d;
    SCRATCH.with_borrow_mut(|ws| {
        ws.group(rule, (q.pos, q.stride), (k.pos, k.stride));
        let BlockScratch { qg, kg, dq, dk, dv, go_offsets, lse, delta, backward, split, .. } = ws;
        let grads = &mut grads;
        for (g, h) in matched(qg.as_slice(), kg.as_slice()) {
            each_sub_pair(rule, g, h, split, |g, h| {
                go_offsets.clear();
                go_offsets.extend(g.rows.iter().map(|&r| r * grads.grad_out.stride));
                lse.clear();
                lse.extend(g.rows.iter().map(|&r| grads.lse[r]));
                delta.clear();
                delta.extend(g.rows.iter().map(|&r| grads.delta[r]));
                let qgrads = QueryGrads {
                    go: PieceRows { data: grads.grad_out.data, offsets: go_offsets, pos: &g.pos },
                    go_scale: grads.grad_scale,
                    lse,
                    delta,
                };
                let vr = PieceRows { data: v.data, offsets: &h.offsets, pos: &h.pos };
                let (qr, kr) = (rows(q, g), rows(k, h));
                for (buf, n) in [(&mut *dq, g.rows.len()), (&mut *dk, h.rows.len()), (&mut *dv, h.rows.len())] {
                    buf.clear();
                    buf.resize(n * d, 0.0);
                }
                // The piece owns all its rows here, so dq, dk and dv come from one fused pass.
                dkv_piece(spec, &Piece { q: &qr, k: &kr, v: &vr }, &qgrads, backward, dk, dv, Some(dq));
                for (i, &r) in g.rows.iter().enumerate() {
                    grads.dq[r * d..(r + 1) * d].iter_mut().zip(&dq[i * d..]).for_each(|(a, b)| *a += b);
                }
                for (j, &r) in h.rows.iter().enumerate() {
                    grads.dk[r * d..(r + 1) * d].iter_mut().zip(&dk[j * d..]).for_each(|(a, b)| *a += b);
                    grads.dv[r * d..(r + 1) * d].iter_mut().zip(&dv[j * d..]).for_each(|(a, b)| *a += b);
                }
            });
        }
    });
}
