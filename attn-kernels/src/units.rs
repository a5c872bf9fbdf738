//! Work units of the CPU backend: the fixed decomposition of a call into `(batch, head,
//! position range)` units (chosen from the shape only, never the thread count) and what
//! one unit computes into its worker's f32 accumulators: the forward (all patterns of
//! the head, LSE-merged), the two-kernel backward (query chunks for dq, key chunks for
//! dk/dv) and the fused one-pass backward over whole segments.

use attn_core::{DilatedConfig, Element, HeadGroups, HeadPatterns, LseMerge, Mixing, TensorView};

use crate::isa::Isa;
use crate::ops::QUERY_CHUNK;
use crate::rows::{Piece, PieceRows, PieceSpec};
use crate::tile_backward::{BackwardScratch, QueryGrads, dkv_piece, dq_piece};
use crate::tile_forward::{ForwardScratch, forward_piece};

/// One work unit: rows `c0..c1` of head `h` of batch `b`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unit {
    pub b: usize,
    pub h: usize,
    pub c0: usize,
    pub c1: usize,
}

/// Everything a unit needs to read, shared by all units of a call.
pub(crate) struct Plan<'a, T> {
    pub isa: Isa,
    pub causal: bool,
    pub scale: f32,
    pub d: usize,
    pub heads: Vec<HeadPatterns>,
    pub q: TensorView<'a, T>,
    pub k: TensorView<'a, T>,
    pub v: TensorView<'a, T>,
}

/// Per-worker buffers.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    fwd: ForwardScratch,
    bwd: BackwardScratch,
    qpos: Vec<usize>,
    kpos: Vec<usize>,
    qoff: Vec<usize>,
    koff: Vec<usize>,
    voff: Vec<usize>,
    goff: Vec<usize>,
    lse: Vec<f32>,
    delta: Vec<f32>,
    pub acc_a: Vec<f32>,
    pub acc_b: Vec<f32>,
    pub acc_c: Vec<f32>,
    pub acc_l: Vec<f32>,
    pa: Vec<f32>,
    pb: Vec<f32>,
    pc: Vec<f32>,
    pl: Vec<f32>,
}

fn zeroed(v: &mut Vec<f32>, len: usize, x: f32) -> &mut [f32] {
    v.clear();
    v.resize(len, x);
    v
}

/// Rows per work unit of the split backward: about `8 * QUERY_CHUNK` selected rows per
/// pattern (each unit packs all keys, or all queries, of its segments once, so longer
/// units repack less: full causal attention at seq 16384, 8 heads, fwd + bwd on 2
/// threads went from 9.6-10.0 s with 256 rows to 8.7-9.1 s), smaller when that would
/// leave fewer than 16 units. Depends on the shape only (never the thread count).
pub(crate) fn chunk_len(cfg: &DilatedConfig, batch: usize, heads: usize, seq: usize) -> usize {
    let max_r = cfg.dilation_rates().iter().copied().max().unwrap_or(1);
    let mut ch = (8 * QUERY_CHUNK).saturating_mul(max_r).clamp(1, seq);
    while ch > 64 && batch * heads * seq.div_ceil(ch) < 16 {
        ch = ch.div_ceil(2);
    }
    ch
}

/// Selected rows per pattern a forward unit aims at: a unit packs the keys and values of
/// each of its segments once, so longer units pack less often (a whole segment of 2048
/// selected rows at the shapes).
const FORWARD_ROWS: usize = 2048;

/// Rows per forward work unit of each head: `FORWARD_ROWS` selected rows of the head's
/// sparsest pattern, halved while the call would have fewer than 16 units. Depends on
/// the shape only (never the thread count); per-row results do not depend on it either
/// (every row walks the same key tiles in the same order).
pub(crate) fn forward_chunk_lens(cfg: &DilatedConfig, batch: usize, heads: usize, seq: usize) -> Vec<usize> {
    let mut lens: Vec<usize> = (0..heads).map(|h| forward_len(cfg, heads, h, seq)).collect();
    let count = |lens: &[usize]| lens.iter().map(|&l| batch.saturating_mul(seq.div_ceil(l))).sum::<usize>();
    while count(&lens) < 16 && lens.iter().any(|&l| l > 64) {
        lens.iter_mut().filter(|l| **l > 64).for_each(|l| *l = l.div_ceil(2));
    }
    lens
}

/// Head `h`'s forward unit length before any halving.
fn forward_len(cfg: &DilatedConfig, heads: usize, h: usize, seq: usize) -> usize {
    let max_r = cfg.head_patterns(heads, h).patterns.iter().map(|(_, p)| p.r).max().unwrap_or(1);
    FORWARD_ROWS.saturating_mul(max_r).clamp(1, seq)
}

/// The longest of [`forward_chunk_lens`], in O(patterns) from 16 `(batch, head)` pairs
/// on (each gives at least one unit, so nothing is halved): for size queries, where
/// `heads` comes from the caller and may be absurd.
pub(crate) fn max_forward_chunk_len(cfg: &DilatedConfig, batch: usize, heads: usize, seq: usize) -> usize {
    if batch.saturating_mul(heads) < 16 {
        return forward_chunk_lens(cfg, batch, heads, seq).into_iter().max().unwrap_or(0);
    }
    head_kinds(cfg, heads).map(|h| forward_len(cfg, heads, h, seq)).max().unwrap_or(0)
}

/// The first head of each head group (LongNet: head 0, every head runs every pattern):
/// all heads of a group run patterns with the same segment lengths and rates, the only
/// things unit lengths depend on, so these heads stand for all `heads`.
fn head_kinds(cfg: &DilatedConfig, heads: usize) -> impl Iterator<Item = usize> {
    let groups = match cfg.mixing() {
        Mixing::LongNet | Mixing::Window => 1,
        Mixing::HeadGroups => cfg.num_patterns(),
    };
    let split = HeadGroups::new(heads, groups);
    (0..groups).map(move |g| split.range(g)).filter(|r| !r.is_empty()).map(|r| r.start)
}

/// Forward work units: rows `c0..c1` of each (batch, head) in runs of the head's length.
pub(crate) fn forward_units(batch: usize, seq: usize, lens: &[usize]) -> Vec<Unit> {
    let mut out = Vec::new();
    for b in 0..batch {
        for (h, &len) in lens.iter().enumerate() {
            for c0 in (0..seq).step_by(len) {
                out.push(Unit { b, h, c0, c1: (c0 + len).min(seq) });
            }
        }
    }
    out
}

/// Largest segment (selected rows) the fused backward takes; bigger ones use the
/// two-kernel backward (bounded per-worker memory either way; the fused one holds
/// three unit-sized f32 accumulators more). Fused computes the scores once instead of
/// twice: full causal attention at seq 16384, 8 heads, forward + backward on 2 threads
/// 8.7-9.1 s split, 7.0 s fused.
const FUSED_MAX_ROWS: usize = 16384;
/// Longest fused unit (positions): the LCM of a head's segment lengths must fit.
const FUSED_MAX_UNIT: usize = 16384;

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Units for the fused backward: per head, runs of `L = lcm(w_i)` positions (the head's
/// patterns' segment lengths), so every segment of every pattern of the head lies inside
/// one unit and the unit owns all rows its queries and keys touch. Used when segments
/// have at most `FUSED_MAX_ROWS` selected rows, `L <= FUSED_MAX_UNIT` and there are at
/// least 8 units: a shape-only rule, so the choice never depends on the thread count.
pub(crate) fn fused_units(plan: &Plan<'_, impl Element>, batch: usize, seq: usize) -> Option<Vec<Unit>> {
    let mut out = Vec::new();
    for (h, hp) in plan.heads.iter().enumerate() {
        let len = head_unit_len(hp, seq)?;
        for b in 0..batch {
            for c0 in (0..seq).step_by(len) {
                out.push(Unit { b, h, c0, c1: (c0 + len).min(seq) });
            }
        }
    }
    (out.len() >= 8).then_some(out)
}

/// `lcm` of the head's segment lengths, if the head qualifies for the fused backward.
fn head_unit_len(hp: &HeadPatterns, seq: usize) -> Option<usize> {
    let mut len = 1usize;
    for (_, p) in &hp.patterns {
        if p.w.min(seq).div_ceil(p.r) > FUSED_MAX_ROWS {
            return None;
        }
        len = (len / gcd(len, p.w)).checked_mul(p.w).filter(|&l| l <= FUSED_MAX_UNIT)?;
    }
    Some(len.min(seq))
}

/// The longest fused unit of any head (`None` if the fused backward is not used).
pub(crate) fn fused_unit_len(cfg: &DilatedConfig, heads: usize, seq: usize) -> Option<usize> {
    head_kinds(cfg, heads).map(|h| head_unit_len(&cfg.head_patterns(heads, h), seq)).try_fold(0, |m, l| Some(m.max(l?)))
}

pub(crate) fn units(batch: usize, heads: usize, seq: usize, ch: usize) -> Vec<Unit> {
    let mut out = Vec::with_capacity(batch * heads * seq.div_ceil(ch));
    for b in 0..batch {
        for h in 0..heads {
            for c0 in (0..seq).step_by(ch) {
                out.push(Unit { b, h, c0, c1: (c0 + ch).min(seq) });
            }
        }
    }
    out
}

/// Inputs of the backward besides q, k, v.
pub(crate) struct Grads<'a, T> {
    pub out: TensorView<'a, T>,
    pub lse: &'a [f32],
    pub grad_out: TensorView<'a, T>,
}

/// The selected rows of pattern segment `seg` inside `lo..hi`, as positions.
fn fill_positions(dst: &mut Vec<usize>, it: impl Iterator<Item = usize>) {
    dst.clear();
    dst.extend(it);
}

fn fill_offsets<T: Element>(dst: &mut Vec<usize>, view: &TensorView<'_, T>, b: usize, h: usize, pos: &[usize]) {
    dst.clear();
    dst.extend(pos.iter().map(|&p| view.offset(b, p, h)));
}

/// Forward of one unit into `ws.acc_a` (`[c1-c0, d]`, merged, unscaled) and `ws.acc_l`.
pub(crate) fn forward_unit<T: Element>(plan: &Plan<'_, T>, u: Unit, ws: &mut Scratch) {
    let (d, n) = (plan.d, u.c1 - u.c0);
    let (seq, kv_len) = (plan.q.shape().seq, plan.k.shape().seq);
    zeroed(&mut ws.acc_a, n * d, 0.0);
    zeroed(&mut ws.acc_l, n, f32::NEG_INFINITY);
    for (_, p) in &plan.heads[u.h].patterns {
        for seg in p.segment_of(u.c0)..=p.segment_of(u.c1 - 1) {
            let bounds = p.segment_bounds(seg, seq);
            fill_positions(&mut ws.qpos, p.selected_in_range(bounds.start.max(u.c0)..bounds.end.min(u.c1)));
            let Some(&last_q) = ws.qpos.last() else { continue };
            let upper = if plan.causal { last_q } else { usize::MAX };
            fill_positions(&mut ws.kpos, p.selected_in_segment(seg, kv_len).take_while(|&k| k <= upper));
            fill_offsets(&mut ws.qoff, &plan.q, u.b, u.h, &ws.qpos);
            fill_offsets(&mut ws.koff, &plan.k, u.b, u.h, &ws.kpos);
            fill_offsets(&mut ws.voff, &plan.v, u.b, u.h, &ws.kpos);
            let nq = ws.qpos.len();
            let po = zeroed(&mut ws.pa, nq * d, 0.0);
            let pl = zeroed(&mut ws.pl, nq, f32::NEG_INFINITY);
            let qr = PieceRows { data: plan.q.data(), offsets: &ws.qoff, pos: &ws.qpos };
            let kr = PieceRows { data: plan.k.data(), offsets: &ws.koff, pos: &ws.kpos };
            let vr = PieceRows { data: plan.v.data(), offsets: &ws.voff, pos: &ws.kpos };
            forward_piece(
                PieceSpec { isa: plan.isa, scale: plan.scale, d, causal: plan.causal },
                &Piece { q: &qr, k: &kr, v: &vr },
                &mut ws.fwd,
                po,
                pl,
            );
            for (i, &qp) in ws.qpos.iter().enumerate() {
                let t = qp - u.c0;
                LseMerge::merge_into(
                    &mut ws.acc_a[t * d..(t + 1) * d],
                    &mut ws.acc_l[t],
                    &po[i * d..(i + 1) * d],
                    pl[i],
                );
            }
        }
    }
}

/// Fill `ws.goff`, `ws.lse`, `ws.delta` for the query positions in `ws.qpos`.
fn query_grads<T: Element>(plan: &Plan<'_, T>, g: &Grads<'_, T>, u: Unit, ws: &mut Scratch) {
    let s = plan.q.shape();
    fill_offsets(&mut ws.goff, &g.grad_out, u.b, u.h, &ws.qpos);
    ws.lse.clear();
    ws.lse.extend(ws.qpos.iter().map(|&p| g.lse[(u.b * s.seq + p) * s.heads + u.h]));
    ws.delta.clear();
    ws.delta.extend(ws.qpos.iter().map(|&p| {
        let (go, o) = (g.grad_out.row(u.b, p, u.h), g.out.row(u.b, p, u.h));
        go.iter().zip(o).map(|(a, b)| a.to_f32() * b.to_f32()).sum::<f32>()
    }));
}

/// dq of one query chunk into `ws.acc_a` (`[c1-c0, d]`).
pub(crate) fn dq_unit<T: Element>(plan: &Plan<'_, T>, g: &Grads<'_, T>, u: Unit, ws: &mut Scratch) {
    let (d, n) = (plan.d, u.c1 - u.c0);
    let (seq, kv_len) = (plan.q.shape().seq, plan.k.shape().seq);
    zeroed(&mut ws.acc_a, n * d, 0.0);
    let hp = &plan.heads[u.h];
    for (_, p) in &hp.patterns {
        for seg in p.segment_of(u.c0)..=p.segment_of(u.c1 - 1) {
            let bounds = p.segment_bounds(seg, seq);
            fill_positions(&mut ws.qpos, p.selected_in_range(bounds.start.max(u.c0)..bounds.end.min(u.c1)));
            let Some(&last_q) = ws.qpos.last() else { continue };
            let upper = if plan.causal { last_q } else { usize::MAX };
            fill_positions(&mut ws.kpos, p.selected_in_segment(seg, kv_len).take_while(|&k| k <= upper));
            fill_offsets(&mut ws.qoff, &plan.q, u.b, u.h, &ws.qpos);
            fill_offsets(&mut ws.koff, &plan.k, u.b, u.h, &ws.kpos);
            fill_offsets(&mut ws.voff, &plan.v, u.b, u.h, &ws.kpos);
            query_grads(plan, g, u, ws);
            let nq = ws.qpos.len();
            let pdq = zeroed(&mut ws.pa, nq * d, 0.0);
            let qg = QueryGrads {
                go: PieceRows { data: g.grad_out.data(), offsets: &ws.goff, pos: &ws.qpos },
                go_scale: hp.out_scale as f32,
                lse: &ws.lse,
                delta: &ws.delta,
            };
            let qr = PieceRows { data: plan.q.data(), offsets: &ws.qoff, pos: &ws.qpos };
            let kr = PieceRows { data: plan.k.data(), offsets: &ws.koff, pos: &ws.kpos };
            let vr = PieceRows { data: plan.v.data(), offsets: &ws.voff, pos: &ws.kpos };
            dq_piece(
                PieceSpec { isa: plan.isa, scale: plan.scale, d, causal: plan.causal },
                &Piece { q: &qr, k: &kr, v: &vr },
                &qg,
                &mut ws.bwd,
                pdq,
            );
            for (i, &qp) in ws.qpos.iter().enumerate() {
                let t = qp - u.c0;
                ws.acc_a[t * d..(t + 1) * d].iter_mut().zip(&pdq[i * d..]).for_each(|(a, b)| *a += b);
            }
        }
    }
}

/// dk, dv of one key chunk into `ws.acc_a`, `ws.acc_b` (`[c1-c0, d]` each).
pub(crate) fn dkv_unit<T: Element>(plan: &Plan<'_, T>, g: &Grads<'_, T>, u: Unit, ws: &mut Scratch) {
    let (d, n) = (plan.d, u.c1 - u.c0);
    let (seq, kv_len) = (plan.q.shape().seq, plan.k.shape().seq);
    zeroed(&mut ws.acc_a, n * d, 0.0);
    zeroed(&mut ws.acc_b, n * d, 0.0);
    let hp = &plan.heads[u.h];
    for (_, p) in &hp.patterns {
        for seg in p.segment_of(u.c0)..=p.segment_of(u.c1 - 1) {
            let bounds = p.segment_bounds(seg, kv_len);
            fill_positions(&mut ws.kpos, p.selected_in_range(bounds.start.max(u.c0)..bounds.end.min(u.c1)));
            let Some(&first_k) = ws.kpos.first() else { continue };
            let lower = if plan.causal { first_k } else { 0 };
            fill_positions(&mut ws.qpos, p.selected_in_segment(seg, seq).skip_while(|&q| q < lower));
            if ws.qpos.is_empty() {
                continue;
            }
            fill_offsets(&mut ws.qoff, &plan.q, u.b, u.h, &ws.qpos);
            fill_offsets(&mut ws.koff, &plan.k, u.b, u.h, &ws.kpos);
            fill_offsets(&mut ws.voff, &plan.v, u.b, u.h, &ws.kpos);
            query_grads(plan, g, u, ws);
            let nk = ws.kpos.len();
            let pdk = zeroed(&mut ws.pa, nk * d, 0.0);
            let pdv = zeroed(&mut ws.pb, nk * d, 0.0);
            let qg = QueryGrads {
                go: PieceRows { data: g.grad_out.data(), offsets: &ws.goff, pos: &ws.qpos },
                go_scale: hp.out_scale as f32,
                lse: &ws.lse,
                delta: &ws.delta,
            };
            let qr = PieceRows { data: plan.q.data(), offsets: &ws.qoff, pos: &ws.qpos };
            let kr = PieceRows { data: plan.k.data(), offsets: &ws.koff, pos: &ws.kpos };
            let vr = PieceRows { data: plan.v.data(), offsets: &ws.voff, pos: &ws.kpos };
            dkv_piece(
                PieceSpec { isa: plan.isa, scale: plan.scale, d, causal: plan.causal },
                &Piece { q: &qr, k: &kr, v: &vr },
                &qg,
                &mut ws.bwd,
                pdk,
                pdv,
                None,
            );
            for (j, &kp) in ws.kpos.iter().enumerate() {
                let t = kp - u.c0;
                ws.acc_a[t * d..(t + 1) * d].iter_mut().zip(&pdk[j * d..]).for_each(|(a, b)| *a += b);
                ws.acc_b[t * d..(t + 1) * d].iter_mut().zip(&pdv[j * d..]).for_each(|(a, b)| *a += b);
            }
        }
    }
}

/// dq, dk, dv of one fused unit (whole segments of every pattern of the head), one pass
/// per segment, into `ws.acc_c`, `ws.acc_a`, `ws.acc_b` (`[c1-c0, d]` each).
pub(crate) fn fused_unit<T: Element>(plan: &Plan<'_, T>, g: &Grads<'_, T>, u: Unit, ws: &mut Scratch) {
    let (d, n) = (plan.d, u.c1 - u.c0);
    let seq = plan.q.shape().seq;
    zeroed(&mut ws.acc_a, n * d, 0.0);
    zeroed(&mut ws.acc_b, n * d, 0.0);
    zeroed(&mut ws.acc_c, n * d, 0.0);
    let hp = &plan.heads[u.h];
    for (_, p) in &hp.patterns {
        for seg in p.segment_of(u.c0)..=p.segment_of(u.c1 - 1) {
            fill_positions(&mut ws.qpos, p.selected_in_segment(seg, seq));
            if ws.qpos.is_empty() {
                continue;
            }
            ws.kpos.clone_from(&ws.qpos);
            fill_offsets(&mut ws.qoff, &plan.q, u.b, u.h, &ws.qpos);
            fill_offsets(&mut ws.koff, &plan.k, u.b, u.h, &ws.kpos);
            fill_offsets(&mut ws.voff, &plan.v, u.b, u.h, &ws.kpos);
            query_grads(plan, g, u, ws);
            let m = ws.qpos.len();
            let pdk = zeroed(&mut ws.pa, m * d, 0.0);
            let pdv = zeroed(&mut ws.pb, m * d, 0.0);
            let pdq = zeroed(&mut ws.pc, m * d, 0.0);
            let qg = QueryGrads {
                go: PieceRows { data: g.grad_out.data(), offsets: &ws.goff, pos: &ws.qpos },
                go_scale: hp.out_scale as f32,
                lse: &ws.lse,
                delta: &ws.delta,
            };
            let qr = PieceRows { data: plan.q.data(), offsets: &ws.qoff, pos: &ws.qpos };
            let kr = PieceRows { data: plan.k.data(), offsets: &ws.koff, pos: &ws.kpos };
            let vr = PieceRows { data: plan.v.data(), offsets: &ws.voff, pos: &ws.kpos };
            dkv_piece(
                PieceSpec { isa: plan.isa, scale: plan.scale, d, causal: plan.causal },
                &Piece { q: &qr, k: &kr, v: &vr },
                &qg,
                &mut ws.bwd,
                pdk,
                pdv,
                Some(pdq),
            );
            for (i, &pos) in ws.qpos.iter().enumerate() {
                let t = pos - u.c0;
                let add = |acc: &mut [f32], src: &[f32]| {
                    acc[t * d..(t + 1) * d].iter_mut().zip(&src[i * d..(i + 1) * d]).for_each(|(a, b)| *a += b)
                };
                add(&mut ws.acc_a, pdk);
                add(&mut ws.acc_b, pdv);
                add(&mut ws.acc_c, pdq);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The O(patterns) size helpers equal their per-head definitions.
    #[test]
    fn size_helpers_equal_the_per_head_definitions() {
        for mixing in [Mixing::LongNet, Mixing::HeadGroups] {
            for (segs, rates) in [(&[64, 128, 256][..], &[1, 2, 4][..]), (&[4096, 300], &[8, 3]), (&[20000], &[1])] {
                let cfg = DilatedConfig::builder().segments(segs).dilations(rates).mixing(mixing).build().unwrap();
                for heads in 1..40 {
                    for (batch, seq) in [(1, 1), (1, 700), (3, 5000), (2, 40000)] {
                        let want = forward_chunk_lens(&cfg, batch, heads, seq).into_iter().max();
                        assert_eq!(Some(max_forward_chunk_len(&cfg, batch, heads, seq)), want);
                        let per_head = (0..heads)
                            .map(|h| head_unit_len(&cfg.head_patterns(heads, h), seq))
                            .try_fold(0, |m, l| Some(m.max(l?)));
                        assert_eq!(fused_unit_len(&cfg, heads, seq), per_head, "{segs:?} {heads} {seq}");
                    }
                }
            }
        }
    }
}
