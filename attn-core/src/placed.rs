//! [`PlacedPattern`]: a pattern on global positions of a batch row, applied to the
//! positions relative to each packed sequence (or to the whole row without packing),
//! for planners that count and list selected rows of global ranges.

use std::ops::Range;

use crate::masks::PackedSequences;
use crate::pattern::SegmentPattern;

/// `pat` on a row of `n` global positions, restarting at every packed sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacedPattern<'a> {
    pub pat: SegmentPattern,
    pub packing: Option<PackedSequences<'a>>,
    pub n: usize,
}

impl PlacedPattern<'_> {
    /// The global positions of the sequence holding `p` (`p < n`).
    #[inline]
    pub fn sequence_of(&self, p: usize) -> Range<usize> {
        match self.packing {
            Some(pk) => pk.bounds(pk.sequence_of(p)),
            None => 0..self.n,
        }
    }

    /// The global positions of the segment holding `p` (`p < n`).
    pub fn segment_span(&self, p: usize) -> Range<usize> {
        let s = self.sequence_of(p);
        let b = self.pat.segment_bounds(self.pat.segment_of(p - s.start), s.len());
        s.start + b.start..s.start + b.end
    }

    /// Whether global position `p` is selected.
    pub fn is_selected(&self, p: usize) -> bool {
        self.pat.is_selected(p - self.sequence_of(p).start)
    }

    /// The sequences overlapping `range` (clamped to `n`), as (sequence start, the part
    /// of `range` inside it).
    fn parts(&self, range: Range<usize>) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        let range = range.start.min(self.n)..range.end.min(self.n);
        let first = if range.is_empty() { 1 } else { 0 };
        let seqs: Box<dyn Iterator<Item = Range<usize>> + '_> = match self.packing {
            Some(pk) if !range.is_empty() => {
                Box::new((pk.sequence_of(range.start)..=pk.sequence_of(range.end - 1)).map(move |i| pk.bounds(i)))
            }
            _ => Box::new(std::iter::once(0..self.n).skip(first)),
        };
        seqs.map(move |s| (s.start, range.start.max(s.start)..range.end.min(s.end))).filter(|(_, r)| !r.is_empty())
    }

    /// The selected global positions inside `range`, ascending.
    pub fn selected_in_range(&self, range: Range<usize>) -> impl Iterator<Item = usize> + '_ {
        let pat = self.pat;
        self.parts(range).flat_map(move |(s, r)| pat.selected_in_range(r.start - s..r.end - s).map(move |x| x + s))
    }

    /// Number of selected positions inside `range`.
    pub fn count_in_range(&self, range: Range<usize>) -> usize {
        self.parts(range).map(|(s, r)| self.pat.count_in_range(r.start - s..r.end - s)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placed_patterns_restart_at_every_sequence() {
        let cu = [0, 5, 6, 17];
        let packing = Some(PackedSequences::new(&cu).unwrap());
        for pat in [SegmentPattern::new(4, 2, 1), SegmentPattern::new(3, 1, 0), SegmentPattern::whole()] {
            for pk in [None, packing] {
                let placed = PlacedPattern { pat, packing: pk, n: 17 };
                let start = |p: usize| if pk.is_some() { cu[cu.partition_point(|&c| c <= p) - 1] } else { 0 };
                let end = |p: usize| if pk.is_some() { cu[cu.partition_point(|&c| c <= p)] } else { 17 };
                for lo in 0..18 {
                    for hi in lo..20 {
                        let brute: Vec<usize> = (lo..hi.min(17)).filter(|&p| pat.is_selected(p - start(p))).collect();
                        assert_eq!(placed.selected_in_range(lo..hi).collect::<Vec<_>>(), brute, "{pat:?} {lo}..{hi}");
                        assert_eq!(placed.count_in_range(lo..hi), brute.len());
                    }
                }
                for p in 0..17 {
                    let span = placed.segment_span(p);
                    let (s, e) = (start(p), end(p));
                    let seg = pat.segment_of(p - s);
                    let want = pat.segment_bounds(seg, e - s);
                    assert_eq!(span, s + want.start..s + want.end, "{pat:?} {p}");
                    assert_eq!(placed.is_selected(p), pat.is_selected(p - s));
                }
            }
        }
    }
}
