//! The forward when no pattern uses the ring (every spanning pattern is all-gathered):
//! received k/v rows never outlive one round. Each message `o -> r` is cut into
//! pieces of at most [`piece_rows`](crate::plan::Plan::piece_rows) rows of one (pattern, head) pair; round `k` sends
//! piece `k` of every message, and each received piece is decoded, attended by the
//! query rows that can see it into a compact f32 partial `(o, lse)` kept only for
//! the selected query rows of segments holding remote keys, and dropped at once.
//! After the completion round (nothing is written to the caller's output before),
//! each (batch, head) is computed in chunks of rows over the rank's own keys, merged
//! with the partials by their LSE, and written out.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::sync_channel;

use attn_core::{Element, HeadPatterns, LseMerge, Result, TensorViewMut};

use crate::comm::Communicator;
use crate::compute::head_work::for_each_item;
use crate::compute::kernel_bridge::{KeyBlock, Rows, attend_forward, attend_forward_chunked};
use crate::compute::rank_rows::{Local, RawBlock, mask_of};
use crate::plan::pieces::{KEY_ROWS_PER_CALL, Piece, ROW_CHUNK, Run, pieces, query_runs};
use crate::plan::{PatternHead, Plan};
use crate::protocol::wire::{Expected, MsgKind};

/// The pieces of one all-gather message spread evenly over the rounds of the pair of
/// ranks (the larger piece count of its two directions), at most one per round: piece
/// `j` of `m` travels in round `floor(j * rounds / m)`. Both directions of a pair thus
/// move the same share of their pieces per round; sending pieces back to back instead
/// left the rank with the shorter message waiting while its peer worked through the
/// longer one, and then idle (full causal attention, 2 ranks, zigzag).
#[derive(Debug)]
struct Spread {
    peer: usize,
    pieces: Vec<Piece>,
    rounds: usize,
}

impl Spread {
    /// The messages `r -> x` and `x -> r` of one pair of ranks (the first sent by `r`,
    /// the second received), over the rounds they share.
    fn pair(plan: &Plan, r: usize, x: usize) -> [Spread; 2] {
        let (out, inc) = (pieces(plan, r, x), pieces(plan, x, r));
        let rounds = out.len().max(inc.len());
        [Spread { peer: x, pieces: out, rounds }, Spread { peer: x, pieces: inc, rounds }]
    }

    fn any(&self) -> bool {
        !self.pieces.is_empty()
    }

    /// The piece that travels in round `k`, if any.
    fn at(&self, k: usize) -> Option<&Piece> {
        let m = self.pieces.len();
        let j = (k * m).div_ceil(self.rounds.max(1));
        (j < m && j * self.rounds / m == k).then(|| &self.pieces[j])
    }
}

/// Positions `range` of owner `o`'s rows sent to `r` for pair `ph` (only those collected).
fn piece_positions(plan: &Plan, o: usize, r: usize, ph: &PatternHead, range: &Range<usize>) -> Vec<usize> {
    let placed = plan.placed(ph.pat);
    plan.gather_ranges(o, r, ph)
        .into_iter()
        .flat_map(|rg| placed.selected_in_range(rg).collect::<Vec<_>>())
        .skip(range.start)
        .take(range.len())
        .collect()
}

/// The remote share of one all-gather pair (wire pair `wire`, read by query head
/// `query_head`): f32 `(o, lse)` per batch for the selected query rows of the segments
/// that hold keys of other ranks.
#[derive(Debug)]
pub(crate) struct PairPartial {
    pair: PatternHead,
    wire: usize,
    query_head: usize,
    pos: Vec<usize>,
    runs: Vec<Run>,
    o: Vec<f32>,
    l: Vec<f32>,
}

/// The partial rows of `runs` (ascending, disjoint) in one batch's `o` (`[n, d]`) and
/// `l`, one work item per run.
fn run_rows<'r, 'a>(
    runs: impl Iterator<Item = &'r Run>,
    d: usize,
    mut o: &'a mut [f32],
    mut l: &'a mut [f32],
) -> Vec<(Run, &'a mut [f32], &'a mut [f32])> {
    let (mut at, mut items) = (0, Vec::new());
    for run in runs {
        let (_, rest_o) = std::mem::take(&mut o).split_at_mut((run.at - at) * d);
        let (_, rest_l) = std::mem::take(&mut l).split_at_mut(run.at - at);
        let (ro, rest_o) = rest_o.split_at_mut(run.len * d);
        let (rl, rest_l) = rest_l.split_at_mut(run.len);
        (o, l, at) = (rest_o, rest_l, run.at + run.len);
        items.push((*run, ro, rl));
    }
    items
}

/// The all-gather rounds: every piece sent, received, attended into the partials (the
/// query runs a piece reaches split over `threads`) and dropped. Returns the partials
/// (one per all-gather pair with remote keys).
pub(crate) fn gather_partials<C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    plan: &Plan,
    local: &Local<'_, T>,
    threads: usize,
) -> Result<Vec<PairPartial>> {
    let (r, p, d, batch) = (comm.rank(), plan.problem.world, local.d, local.batch);
    let gh = &plan.gather_heads;
    // One partial per (wire pair, query head reading it). The partials fault in huge
    // pages where large (every row is written by the merges).
    let mut parts: Vec<PairPartial> = Vec::new();
    for (wire, ph) in gh.iter().enumerate() {
        let (pos, runs) = query_runs(plan, r, ph);
        if runs.is_empty() {
            continue;
        }
        for query_head in (0..local.heads).filter(|&h| plan.reads(h, ph)) {
            let o = attn_kernels::zeroed_buffer(batch * pos.len() * d)?;
            let l = vec![f32::NEG_INFINITY; batch * pos.len()];
            parts.push(PairPartial { pair: *ph, wire, query_head, o, l, pos: pos.clone(), runs: runs.clone() });
        }
    }
    let (mut outgoing, mut incoming) = (Vec::new(), Vec::new());
    for [out, inc] in (0..p).filter(|&x| x != r).map(|x| Spread::pair(plan, r, x)) {
        outgoing.extend(out.any().then_some(out));
        incoming.extend(inc.any().then_some(inc));
    }
    let rounds = outgoing.iter().chain(&incoming).map(|s| s.rounds).max().unwrap_or(0);
    let encode = |k: usize| -> Vec<(usize, Vec<u8>)> {
        let due = outgoing.iter().filter_map(|s| s.at(k).map(|(i, rg)| (s.peer, *i, rg)));
        due.map(|(x, i, rg)| {
            (x, local.encode_rows(&gh[i..=i], &[piece_positions(plan, r, x, &gh[i], rg)], MsgKind::GatherKv, r, k))
        })
        .collect()
    };
    let (mut kbuf, mut vbuf) = (Vec::<T>::new(), Vec::<T>::new());
    for k in 0..rounds {
        let sends = if k == 0 { encode(0) } else { Vec::new() };
        let srcs: Vec<(usize, usize, Range<usize>)> =
            incoming.iter().filter_map(|s| s.at(k).map(|(i, rg)| (s.peer, *i, rg.clone()))).collect();
        let from: Vec<usize> = srcs.iter().map(|s| s.0).collect();
        let got = comm.exchange(sends, &from)?;
        // The next round's pieces leave now (they travel with the next exchange), so a
        // peer that finishes its round early finds them waiting.
        let next = if k + 1 < rounds { encode(k + 1) } else { Vec::new() };
        if !next.is_empty() {
            comm.post(next)?;
        }
        for ((src, i, rg), bytes) in srcs.into_iter().zip(got) {
            let pos = piece_positions(plan, src, r, &gh[i], &rg);
            let raw = RawBlock::new::<T>(
                bytes,
                Expected { kind: MsgKind::GatherKv, owner: src, step: k, rank: r },
                batch,
                d,
                vec![pos],
            )?;
            for b in 0..batch {
                raw.part_rows::<T>(b, 0, d, 0..raw.pos[0].len(), &mut kbuf, &mut vbuf);
                let keys = KeyBlock { pos: &raw.pos[0], k: &kbuf, v: &vbuf, stride: d };
                for part in parts.iter_mut().filter(|x| x.wire == i) {
                    let (pat, placed) = (part.pair.pat, plan.placed(part.pair.pat));
                    let last = raw.pos[0][raw.pos[0].len() - 1];
                    let (k0, k1) = (placed.segment_span(raw.pos[0][0]).start, placed.segment_span(last).start);
                    let (n, m) = (part.pos.len(), mask_of(plan, &part.pair, b, part.query_head));
                    let (pos, runs) = (&part.pos, &part.runs);
                    let (bo, bl) = (&mut part.o[b * n * d..(b + 1) * n * d], &mut part.l[b * n..(b + 1) * n]);
                    let (qd, qs) = local.q_strided(local.bh(b, part.query_head));
                    let items = run_rows(runs.iter().filter(|u| (k0..=k1).contains(&u.seg)), d, bo, bl);
                    for_each_item(threads, items, |(run, o, l)| {
                        let q =
                            Rows { pos: &pos[run.at..run.at + run.len], data: &qd[run.li0 * qs..], stride: pat.r * qs };
                        attend_forward(q, keys, m, o, l)
                    })?;
                }
            }
        }
    }
    Ok(parts)
}

/// After the completion round: each (batch, head) in chunks of rows over this rank's
/// own keys, merged with the partials, written to `out` and `lse`. With `threads > 1`
/// scoped workers compute chunks (each into its own buffers, handed back through a
/// bounded channel) and this thread writes them; every chunk is computed the same way
/// on any thread, so the result does not depend on `threads`.
pub(crate) fn forward_direct<T: Element>(
    plan: &Plan,
    local: &Local<'_, T>,
    partials: &[PairPartial],
    out: &mut TensorViewMut<'_, T>,
    lse: &mut [f32],
    threads: usize,
) -> Result<()> {
    let (nl, h, d) = (local.rows(), local.heads, local.d);
    // Per head, once: its patterns (every chunk's) and out_scale (every write's).
    let hps = plan.head_patterns();
    let tasks: Vec<Chunk> = (0..local.batch)
        .flat_map(|b| (0..h).flat_map(move |head| (0..nl).step_by(ROW_CHUNK).map(move |c0| (b, head, c0))))
        .map(|(b, head, c0)| Chunk { b, head, rows: c0..(c0 + ROW_CHUNK).min(nl) })
        .collect();
    let mut write = |c: &Chunk, o: &[f32], l: &[f32]| {
        for i in c.rows.clone() {
            let row = out.row_mut(c.b, i, c.head);
            let src = &o[(i - c.rows.start) * d..(i - c.rows.start + 1) * d];
            row.iter_mut().zip(src).for_each(|(x, &y)| *x = T::from_f32(y * hps[c.head].out_scale as f32));
            lse[(c.b * nl + i) * h + c.head] = l[i - c.rows.start];
        }
    };
    // Ascending positions (every layout's): each row chunk then hands the kernel only the
    // keys of its own segments, so the work stays linear in the rows.
    let order = if local.own_keys(0).pos.windows(2).all(|w| w[0] < w[1]) { KeyOrder::Ascending } else { KeyOrder::Any };
    let workers = threads.min(tasks.len());
    if workers <= 1 {
        let (mut o, mut l) = (vec![0.0f32; ROW_CHUNK * d], vec![0.0f32; ROW_CHUNK]);
        for c in &tasks {
            let (o, l) = (&mut o[..c.rows.len() * d], &mut l[..c.rows.len()]);
            chunk_forward((plan, local, partials), &hps[c.head], c, order, o, l)?;
            write(c, o, l);
        }
        return Ok(());
    }
    let next = AtomicUsize::new(0);
    let (next, tasks, hps) = (&next, &tasks, &hps);
    std::thread::scope(|scope| {
        let (tx, rx) = sync_channel::<Result<(usize, Vec<f32>, Vec<f32>)>>(workers);
        for _ in 0..workers {
            let tx = tx.clone();
            scope.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(c) = tasks.get(i) else { break };
                    let (mut o, mut l) = (vec![0.0f32; c.rows.len() * d], vec![0.0f32; c.rows.len()]);
                    let done = chunk_forward((plan, local, partials), &hps[c.head], c, order, &mut o, &mut l)
                        .map(|()| (i, o, l));
                    let failed = done.is_err();
                    if tx.send(done).is_err() || failed {
                        break;
                    }
                }
            });
        }
        drop(tx);
        // An error returns at once; dropping `rx` stops the workers at their next send.
        for done in rx {
            let (i, o, l) = done?;
            write(&tasks[i], &o, &l);
        }
        Ok(())
    })
}

/// Rows `rows` of (batch `b`, head `head`): one unit of [`forward_direct`].
#[derive(Debug, Clone)]
struct Chunk {
    b: usize,
    head: usize,
    rows: Range<usize>,
}

/// Whether this rank's own key positions ascend (then a chunk attends only the keys of
/// its segments).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyOrder {
    Ascending,
    Any,
}

/// One chunk over this rank's own keys of every pattern of its head, merged with the
/// partials, into `o` (`[rows, d]`, normalised, before `out_scale`) and `l`.
fn chunk_forward<T: Element>(
    (plan, local, partials): (&Plan, &Local<'_, T>, &[PairPartial]),
    hp: &HeadPatterns,
    c: &Chunk,
    order: KeyOrder,
    o: &mut [f32],
    l: &mut [f32],
) -> Result<()> {
    let (d, head, (c0, c1)) = (local.d, c.head, (c.rows.start, c.rows.end));
    let bh = local.bh(c.b, head);
    let keys = local.own_keys(bh);
    o.iter_mut().for_each(|x| *x = 0.0);
    l.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
    let q = local.q_rows_range(bh, c0..c1);
    // Own keys go to the kernel KEY_ROWS_PER_CALL selected rows at a time (bounded
    // kernel scratch).
    for &(pattern, pat) in &hp.patterns {
        let m = mask_of(plan, &PatternHead { pattern, head, pat }, c.b, head);
        let keys = match (order, q.pos.first(), q.pos.last()) {
            (KeyOrder::Ascending, Some(&first), Some(&last)) => {
                // The keys of the chunk's segments within the band's reach of its rows.
                let (placed, reach) = (plan.placed(pat), m.band.keys_of_queries(first, last));
                let lo = placed.segment_span(first).start.max(reach.start);
                keys.positions_within(lo, placed.segment_span(last).end.min(reach.end))
            }
            _ => keys,
        };
        attend_forward_chunked(q, keys, m, o, l, KEY_ROWS_PER_CALL * pat.r)?;
    }
    for part in partials.iter().filter(|x| x.query_head == head) {
        let (n, r) = (part.pos.len(), part.pair.pat.r);
        for run in &part.runs {
            // The run's rows li0, li0 + r, ... that fall in this chunk.
            let first = c0.saturating_sub(run.li0).div_ceil(r);
            let end = c1.saturating_sub(run.li0).div_ceil(r).min(run.len);
            for j in first..end {
                let (li, at) = (run.li0 + j * r, c.b * n + run.at + j);
                let row = &mut o[(li - c0) * d..(li - c0 + 1) * d];
                LseMerge::merge_into(row, &mut l[li - c0], &part.o[at * d..(at + 1) * d], part.l[at]);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Layout, RingProblem, Strategy};
    use attn_core::{AttnShape, DilatedConfig, Shape4};

    /// Every piece of every message travels exactly once, in order, spread over the
    /// rounds its pair shares with the reverse message.
    #[test]
    fn spread_sends_every_piece_once_in_order() {
        let cfg = DilatedConfig::builder().segments(&[8192]).dilations(&[1]).causal().build().unwrap();
        let shape = Shape4::new(1, 8192, 2, 8).unwrap();
        let mut uneven = 0;
        for (world, layout) in [(2, Layout::Zigzag), (3, Layout::Contiguous), (4, Layout::Zigzag)] {
            let problem = RingProblem::new(&cfg, AttnShape::self_attn(shape), layout, Strategy::AllGather, world);
            let plan = Plan::new(problem).unwrap();
            for o in 0..world {
                for r in (0..world).filter(|&r| r != o) {
                    let [s, back] = Spread::pair(&plan, o, r);
                    assert_eq!(s.rounds, back.rounds);
                    assert!(back.pieces == pieces(&plan, r, o) && s.pieces == pieces(&plan, o, r));
                    assert!(s.rounds >= s.pieces.len());
                    let sent: Vec<&Piece> = (0..s.rounds + 3).filter_map(|k| s.at(k)).collect();
                    assert!(sent.iter().copied().eq(s.pieces.iter()), "p={world} {layout:?} {o}->{r}");
                    if s.any() && s.pieces.len() < s.rounds {
                        uneven += 1;
                        // Spread out: the last piece goes in the last half of the rounds.
                        let last = (0..s.rounds).rev().find(|&k| s.at(k).is_some()).unwrap();
                        assert!(2 * last >= s.rounds, "p={world} {layout:?} {o}->{r}: last piece in round {last}");
                    }
                }
            }
        }
        assert!(uneven > 0, "causal splits give messages of different lengths");
    }
}
