//! The key rows a block mask leaves a receiving rank needing (the definition's "Block
//! masks", "Across ring ranks"): a row of owner `o` travels to the receivers of a ring
//! way, or straight to one all-gather receiver, only if some query block a receiver
//! holds keeps that row's block, in some batch and some query head reading the wire
//! pair, and the pattern's segment and band let those queries reach it. Without a block
//! mask the plan's unmasked regions stand. [`Plan::new`] calls [`Plan::mask_need`] on
//! its need table and keeps [`Plan::masked_ranges`].

use std::collections::HashMap;
use std::ops::Range;

use attn_core::{BlockMask, HeadPatterns, PlacedPattern};

use crate::plan::ring_route::Way;
use crate::plan::{MaskedRanges, PatternHead, Plan, RingProblem, merge_ranges, shared_region};

/// Kept (query block, key block) tiles of one wire pair: the OR over the mask's batches
/// and the query heads reading the pair.
struct KeptTiles {
    k_blocks: usize,
    keep: Vec<bool>,
}

impl KeptTiles {
    fn new(mask: &BlockMask<'_>, heads: &[usize]) -> Self {
        let d = mask.dims();
        let mut keep = vec![false; d.q_blocks * d.k_blocks];
        for b in 0..d.batch {
            for &h in heads {
                for (i, kept) in keep.iter_mut().enumerate() {
                    *kept |= mask.keeps_blocks(b, h, i / d.k_blocks, i % d.k_blocks);
                }
            }
        }
        KeptTiles { k_blocks: d.k_blocks, keep }
    }

    fn keeps(&self, qb: usize, kb: usize) -> bool {
        self.keep[qb * self.k_blocks + kb]
    }
}

/// A block mask seen from the plan: the problem, every query head's patterns, and the
/// kept tiles of each set of query heads reading a wire pair (built once each).
struct Reach<'a> {
    problem: &'a RingProblem,
    mask: BlockMask<'a>,
    query_patterns: &'a [HeadPatterns],
    tiles: HashMap<Vec<usize>, KeptTiles>,
}

impl<'a> Reach<'a> {
    fn new(problem: &'a RingProblem, query_patterns: &'a [HeadPatterns]) -> Option<Self> {
        let mask = problem.masks.block_mask()?.view();
        Some(Reach { problem, mask, query_patterns, tiles: HashMap::new() })
    }

    /// The query heads reading wire pair `ph` that the mask tells apart (a mask of one
    /// head serves every head).
    fn readers(&self, ph: &PatternHead) -> Vec<usize> {
        if self.mask.dims().heads == 1 {
            return vec![0];
        }
        let group = self.problem.group();
        (0..self.problem.heads)
            .filter(|&h| h / group == ph.head)
            .filter(|&h| self.query_patterns[h].patterns.iter().any(|&(i, pat)| i == ph.pattern && pat == ph.pat))
            .collect()
    }

    /// Owner `o`'s key ranges that some query block of some rank in `receivers` keeps
    /// (for a query head reading `ph`, in some batch) and reaches (its segment and band),
    /// cut at key block edges, merged.
    fn kept_keys(&mut self, o: usize, receivers: &[usize], ph: &PatternHead) -> Vec<Range<usize>> {
        let heads = self.readers(ph);
        let mask = self.mask;
        let tiles = self.tiles.entry(heads).or_insert_with_key(|heads| KeptTiles::new(&mask, heads));
        let (prob, bs) = (self.problem, mask.block_size());
        let (n, p, layout, band) = (prob.seq, prob.world, prob.layout, prob.cfg.band());
        let seg = PlacedPattern { pat: prob.cfg.pattern(ph.pattern, 0), packing: prob.masks.view().packing, n };
        let owned = layout.ranges(n, p, o);
        let mut out = Vec::new();
        for &r in receivers {
            for held in layout.ranges(n, p, r) {
                for (start, qb, queries) in query_blocks(&seg, held, bs) {
                    for reg in owned.iter().filter_map(|a| shared_region(a, &queries, &seg, band)) {
                        // `queries` lies in one sequence starting at `start`, and so does `reg`.
                        let (first, last) = ((reg.start - start) / bs, (reg.end - 1 - start) / bs);
                        for kb in (first..=last).filter(|&kb| tiles.keeps(qb, kb)) {
                            let block = start + kb * bs..start + (kb + 1) * bs;
                            out.push(reg.start.max(block.start)..reg.end.min(block.end));
                        }
                    }
                }
            }
        }
        merge_ranges(out)
    }
}

impl Plan {
    /// Under a block mask, clear `need[i][o][r]` where no kept block of `r` reaches a key
    /// of `o` for any (key/value head, offset) pair of pattern `i`, so blocks travel only
    /// as far as their receivers (and nothing moves where the mask keeps nothing across
    /// ranks).
    pub(super) fn mask_need(problem: &RingProblem, query_patterns: &[HeadPatterns], need: &mut [Vec<Vec<bool>>]) {
        let Some(mut reach) = Reach::new(problem, query_patterns) else { return };
        let group = problem.group();
        let mut pairs: Vec<PatternHead> = Vec::new();
        for (head, hp) in query_patterns.iter().enumerate() {
            for &(pattern, pat) in &hp.patterns {
                let ph = PatternHead { pattern, head: head / group, pat };
                if !pairs.contains(&ph) {
                    pairs.push(ph);
                }
            }
        }
        for (i, by_owner) in need.iter_mut().enumerate() {
            for (o, by_receiver) in by_owner.iter_mut().enumerate() {
                for (r, needed) in by_receiver.iter_mut().enumerate().filter(|(_, x)| **x) {
                    *needed =
                        pairs.iter().filter(|ph| ph.pattern == i).any(|ph| !reach.kept_keys(o, &[r], ph).is_empty());
                }
            }
        }
    }

    /// Under a block mask, the key ranges each owner sends per wire pair (per way for the
    /// ring pairs, per receiver for the all-gather pairs); `None` without one.
    pub(super) fn masked_ranges(&self) -> Option<MaskedRanges> {
        let mut reach = Reach::new(&self.problem, &self.query_patterns)?;
        let p = self.problem.world;
        let mut out = MaskedRanges::default();
        for ph in &self.ring_heads {
            for o in 0..p {
                for way in Way::BOTH {
                    let receivers: Vec<usize> =
                        (0..p).filter(|&r| self.need[ph.pattern][o][r] && way_of(self, o, r) == way).collect();
                    out.ring.insert((way.index(), o, *ph), reach.kept_keys(o, &receivers, ph));
                }
            }
        }
        for ph in &self.gather_heads {
            for o in 0..p {
                for r in (0..p).filter(|&r| r != o && self.need[ph.pattern][o][r]) {
                    out.gather.insert((o, r, *ph), reach.kept_keys(o, &[r], ph));
                }
            }
        }
        Some(out)
    }
}

/// The way owner `o`'s block reaches ring receiver `r`: the next way covers the
/// receivers up to its hop count (the route sends the nearer receivers that way).
fn way_of(plan: &Plan, o: usize, r: usize) -> Way {
    let p = plan.problem.world;
    if Way::Next.distance(o, r, p) <= plan.hops_of(Way::Next, o) { Way::Next } else { Way::Prev }
}

/// `range` cut at packed sequence starts and query block edges: (sequence start, query
/// block index within the sequence, the part of `range` in that block).
fn query_blocks(seg: &PlacedPattern<'_>, range: Range<usize>, bs: usize) -> Vec<(usize, usize, Range<usize>)> {
    let mut out = Vec::new();
    let mut at = range.start;
    while at < range.end {
        let seq = seg.sequence_of(at);
        let qb = (at - seq.start) / bs;
        let end = range.end.min(seq.end).min(seq.start + (qb + 1) * bs);
        out.push((seq.start, qb, at..end));
        at = end;
    }
    out
}
