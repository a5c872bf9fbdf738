//! How the all-gather forward cuts its messages and sizes its partials, fixed by the
//! plan so every rank cuts alike: the pieces of each message, the query runs a rank
//! keeps a partial for, and the byte bounds the plan's traffic and workspace use.

use std::ops::Range;

use crate::plan::{PatternHead, Plan, RingProblem};

/// Selected key rows handed to the kernel per call by the kernel bridge's `attend_forward_chunked`: the
/// kernel packs a call's keys into per-thread scratch, so this bounds that scratch
/// (about `2 * KEY_ROWS_PER_CALL * d * 4` bytes) whatever the segment length.
pub(crate) const KEY_ROWS_PER_CALL: usize = 1024;

/// Key rows per piece (and per kernel call on it), fixed by the plan so every rank cuts
/// a message alike: an eighth of the smallest all-gather message of one (pattern,
/// head) pair (counted for each pattern's first all-gathered head; the others differ
/// by their offsets only), 128 to 1024 rows ([`KEY_ROWS_PER_CALL`]). Every message thus travels in
/// at least about 8 pieces (the next piece's transfer overlaps this one's compute, and
/// the all-gather's `Spread` has rounds to balance), while each piece is as large as that allows: a
/// kernel call re-packs the query rows it serves and merges its result into their
/// partials, so small pieces cost time (full causal attention, seq 32768, 2 ranks of
/// one thread on a 2-core Zen 4, medians of 8 against one rank with 2 threads: 512-row
/// pieces 1.03x, 1024-row 1.00x, 2048-row 0.97x). Where partials are small (dilated,
/// seq 65536 over 8 or 16 ranks) messages are too, and pieces stay at 128-256 rows.
/// Computed once a plan, on first use: [`Plan::piece_rows`].
fn piece_rows(plan: &Plan) -> usize {
    let p = plan.problem.world;
    let mut patterns: Vec<&PatternHead> = Vec::new();
    for ph in &plan.gather_heads {
        if patterns.iter().all(|x| x.pattern != ph.pattern) {
            patterns.push(ph);
        }
    }
    let smallest = (0..p)
        .flat_map(|o| (0..p).filter(move |&r| r != o).map(move |r| (o, r)))
        .flat_map(|(o, r)| patterns.iter().map(move |ph| plan.gather_count(o, r, ph)))
        .filter(|&n| n > 0)
        .min()
        .unwrap_or(0);
    (smallest / 8).clamp(128, KEY_ROWS_PER_CALL)
}

impl Plan {
    /// Key rows per piece of the direct all-gather forward ([`piece_rows`]).
    pub(crate) fn piece_rows(&self) -> usize {
        *self.piece_rows_once.get_or_init(|| piece_rows(self))
    }
}

/// Query rows per accumulator chunk (and at most per kernel call).
pub(crate) const ROW_CHUNK: usize = 512;

/// One piece: (pair index in `plan.gather_heads`, range of that pair's positions).
pub(crate) type Piece = (usize, Range<usize>);

/// The pieces of the all-gather message `o -> r`, in wire order: (pair index in
/// `plan.gather_heads`, range of that pair's positions). Empty when `r` needs nothing of `o`.
pub(crate) fn pieces(plan: &Plan, o: usize, r: usize) -> Vec<Piece> {
    if !plan.gather_need(o, r) {
        return Vec::new();
    }
    let (mut out, rows) = (Vec::new(), plan.piece_rows());
    for (i, ph) in plan.gather_heads.iter().enumerate() {
        let n = plan.gather_count(o, r, ph);
        out.extend((0..n).step_by(rows).map(|a| (i, a..(a + rows).min(n))));
    }
    out
}

/// Selected query rows `li0, li0 + r, ...` (local indices) of one segment (named by its
/// first global position, `seg`), `len` of them, stored at partial rows `at..at + len`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Run {
    pub at: usize,
    pub len: usize,
    pub li0: usize,
    pub seg: usize,
}

/// The rank's selected query rows of pair `ph` that may see keys this rank receives
/// (in the segments holding such keys, within the band's reach of them), as runs of at
/// most [`ROW_CHUNK`] rows inside one segment.
pub(crate) fn query_runs(plan: &Plan, rank: usize, ph: &PatternHead) -> (Vec<usize>, Vec<Run>) {
    let RingProblem { seq: n, world: p, layout, ref cfg, .. } = plan.problem;
    let (placed, band) = (plan.placed(ph.pat), cfg.band());
    // (segment start, query interval) of every segment holding received keys.
    let mut reach: Vec<(usize, Range<usize>)> = Vec::new();
    for rg in (0..p).filter(|&x| x != rank).flat_map(|x| plan.gather_regions(x, rank, ph.pattern)) {
        if placed.count_in_range(rg.clone()) == 0 {
            continue;
        }
        let queries = band.queries_of_keys(rg.start, rg.end - 1);
        let mut at = rg.start;
        while at < rg.end {
            let span = placed.segment_span(at);
            let (lo, hi) = (span.start.max(queries.start), span.end.min(queries.end));
            if lo < hi {
                reach.push((span.start, lo..hi));
            }
            at = span.end;
        }
    }
    reach.sort_by_key(|(s, r)| (*s, r.start));
    let mut merged: Vec<(usize, Range<usize>)> = Vec::new();
    for (s, r) in reach {
        match merged.last_mut() {
            Some((ls, lr)) if *ls == s && r.start <= lr.end => lr.end = lr.end.max(r.end),
            _ => merged.push((s, r)),
        }
    }
    let (mut pos, mut runs, mut base) = (Vec::new(), Vec::new(), 0);
    for range in layout.ranges(n, p, rank) {
        for (s, r) in merged.iter().filter(|(_, r)| r.start < range.end && r.end > range.start) {
            let sel: Vec<usize> = placed.selected_in_range(range.start.max(r.start)..range.end.min(r.end)).collect();
            for c in sel.chunks(ROW_CHUNK) {
                runs.push(Run { at: pos.len(), len: c.len(), li0: base + c[0] - range.start, seg: *s });
                pos.extend_from_slice(c);
            }
        }
        base += range.len();
    }
    (pos, runs)
}

/// Query heads that read wire pair `ph`.
pub(crate) fn readers(plan: &Plan, ph: &PatternHead) -> u64 {
    (0..plan.problem.heads).filter(|&h| plan.reads(h, ph)).count() as u64
}

/// Query rows (summed over all-gather pairs and the query heads reading them) for which
/// rank `rank` keeps a partial.
pub(crate) fn partial_rows(plan: &Plan, rank: usize) -> u64 {
    plan.gather_heads.iter().map(|ph| readers(plan, ph) * query_runs(plan, rank, ph).0.len() as u64).sum()
}

/// Bound of the bytes of the partials rank `rank` keeps (f32 o and lse, positions,
/// runs) and of the lists that build them, from the plan.
pub(crate) fn partial_bytes(plan: &Plan, rank: usize) -> u64 {
    let (b, d) = (plan.problem.batch as u64, plan.problem.head_dim as u64);
    plan.gather_heads
        .iter()
        .map(|ph| {
            let (pos, runs) = query_runs(plan, rank, ph);
            let n = pos.len() as u64;
            // Positions are pushed (up to 2x) from a per-segment list; runs likewise.
            let segs = (plan.problem.seq / ph.pat.w.min(plan.problem.seq.max(1)) + 2) as u64;
            let one = b * n * (d + 1) * 4 + 24 * n + 64 * runs.len() as u64;
            if runs.is_empty() { 0 } else { readers(plan, ph) * one + 16 * segs + 256 }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Layout, Strategy};
    use attn_core::{AttnShape, DilatedConfig, Shape4};

    /// Pieces are an eighth of the smallest one-pair message, 128 to 1024 rows.
    #[test]
    fn piece_rows_follow_the_smallest_message() {
        let full = DilatedConfig::builder().segments(&[32768]).dilations(&[1]).causal().build().unwrap();
        let dilated = DilatedConfig::builder().segments(&[2048, 4096, 8192]).dilations(&[1, 2, 4]).build().unwrap();
        for (cfg, seq, world, layout, want) in [
            // Causal zigzag: rank 1 needs only rank 0's first chunk (8192 rows).
            (&full, 32768, 2, Layout::Zigzag, 1024),
            (&full, 16384, 2, Layout::Zigzag, 512),
            (&full, 2048, 2, Layout::Zigzag, 128),
            (&dilated, 65536, 8, Layout::Zigzag, 256),
            (&dilated, 65536, 16, Layout::Contiguous, 128),
            (&dilated, 65536, 16, Layout::Zigzag, 128),
        ] {
            let shape = Shape4::new(1, seq, 8, 64).unwrap();
            let problem = RingProblem::new(cfg, AttnShape::self_attn(shape), layout, Strategy::AllGather, world);
            let plan = Plan::new(problem).unwrap();
            assert_eq!(plan.piece_rows(), want, "seq {seq} p={world} {layout:?}");
            for o in 0..world {
                for r in (0..world).filter(|&r| r != o) {
                    for ph in &plan.gather_heads {
                        let n = plan.gather_count(o, r, ph);
                        assert!(n == 0 || want == 128 || n.div_ceil(want) >= 8, "{o}->{r}: {n} rows");
                    }
                }
            }
        }
    }
}
