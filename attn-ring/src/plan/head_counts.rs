//! Rows selected by all of one pattern's heads, in O(1) per packed sequence: the
//! planner's all-gather sizes for the auto strategy's choice without a walk over every
//! head (`heads` comes from the caller and may be huge). Segments restart at every packed
//! sequence, so positions count relative to their sequence's start.
//!
//! Which heads run a pattern at which offset is `DilatedConfig::offset_heads`. A
//! position at offset `j` in its segment is selected by exactly one offset, `j mod r`
//! (a validated config has `r <= w`), which turns LongNet's sum over every offset into
//! counts of positions.

use std::ops::Range;

use attn_core::{DilatedConfig, OffsetHeads, PackedSequences, SegmentPattern};

/// Pattern `i`'s heads, as the planner needs them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PatternHeads {
    w: usize,
    r: usize,
    heads: OffsetHeads,
}

impl PatternHeads {
    pub(crate) fn new(cfg: &DilatedConfig, heads: usize, i: usize) -> Self {
        let (w, r) = (cfg.pattern(i, 0).w, cfg.rate(i));
        PatternHeads { w, r, heads: cfg.offset_heads(heads, i) }
    }

    /// Number of heads that run this pattern.
    pub(crate) fn heads(&self) -> usize {
        self.heads.heads()
    }

    /// Sum over this pattern's heads of the selected positions in `range`.
    pub(crate) fn selected(&self, range: Range<usize>) -> usize {
        if range.end <= range.start {
            return 0;
        }
        match self.heads {
            OffsetHeads::One { off, count } => count * SegmentPattern::new(self.w, self.r, off).count_in_range(range),
            OffsetHeads::Every { base, extra, .. } => {
                base * range.len() + self.low_offsets_below(range.end, extra)
                    - self.low_offsets_below(range.start, extra)
            }
        }
    }

    /// [`PatternHeads::selected`] over global positions `range`, the pattern restarting at
    /// every sequence of `packing`.
    pub(crate) fn selected_placed(&self, range: Range<usize>, packing: Option<PackedSequences<'_>>) -> usize {
        match packing {
            None => self.selected(range),
            Some(_) if range.is_empty() => 0,
            Some(pk) => (pk.sequence_of(range.start)..=pk.sequence_of(range.end - 1))
                .map(|i| {
                    let s = pk.bounds(i);
                    let (lo, hi) = (range.start.max(s.start), range.end.min(s.end));
                    self.selected(lo.min(hi) - s.start..hi - s.start)
                })
                .sum(),
        }
    }

    /// Positions `p < x` whose offset `(p mod w) mod r` is below `t`.
    fn low_offsets_below(&self, x: usize, t: usize) -> usize {
        let (w, r) = (self.w, self.r);
        let in_prefix = |len: usize| (len / r) * t + (len % r).min(t);
        (x / w) * in_prefix(w) + in_prefix(x % w)
    }
}

#[cfg(test)]
mod tests {
    use attn_core::{Mixing, PlacedPattern};

    use super::*;

    #[test]
    fn counts_equal_the_walk_over_heads() {
        for mixing in [Mixing::HeadGroups, Mixing::LongNet] {
            for (segs, rates) in [(&[8, 12, 30][..], &[1, 3, 4][..]), (&[5, 7], &[5, 2]), (&[16], &[16])] {
                let cfg = DilatedConfig::builder().segments(segs).dilations(rates).mixing(mixing).build().unwrap();
                for heads in cfg.num_patterns()..23 {
                    for i in 0..cfg.num_patterns() {
                        let ph = PatternHeads::new(&cfg, heads, i);
                        let pats: Vec<_> = (0..heads)
                            .flat_map(|h| cfg.head_patterns(heads, h).patterns)
                            .filter(|(j, _)| *j == i)
                            .map(|(_, p)| p)
                            .collect();
                        assert_eq!(ph.heads(), pats.len(), "{segs:?} {heads} pattern {i}");
                        for lo in 0..40 {
                            for hi in lo..70 {
                                let want: usize = pats.iter().map(|p| p.count_in_range(lo..hi)).sum();
                                assert_eq!(ph.selected(lo..hi), want, "{mixing:?} {segs:?} {heads} {i} {lo}..{hi}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn packed_counts_restart_at_every_sequence() {
        let cu = [0, 5, 6, 17, 40];
        let packing = PackedSequences::new(&cu).unwrap();
        for mixing in [Mixing::HeadGroups, Mixing::LongNet] {
            let cfg = DilatedConfig::builder().segments(&[4, 12]).dilations(&[1, 3]).mixing(mixing).build().unwrap();
            for heads in 2..7 {
                for i in 0..cfg.num_patterns() {
                    let ph = PatternHeads::new(&cfg, heads, i);
                    let pats: Vec<_> = (0..heads)
                        .flat_map(|h| cfg.head_patterns(heads, h).patterns)
                        .filter(|(j, _)| *j == i)
                        .map(|(_, p)| PlacedPattern { pat: p, packing: Some(packing), n: 40 })
                        .collect();
                    for lo in 0..40 {
                        for hi in lo..=40 {
                            let want: usize = pats.iter().map(|p| p.count_in_range(lo..hi)).sum();
                            assert_eq!(ph.selected_placed(lo..hi, Some(packing)), want, "{heads} {i} {lo}..{hi}");
                        }
                    }
                }
            }
        }
    }
}
