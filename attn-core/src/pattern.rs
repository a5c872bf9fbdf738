//! Pattern math as pure functions of global positions: which positions a
//! `(w, r, off)` pattern selects, their segment, and who attends to whom.
//!
//! Every split of the sequence (contiguous ring chunks, zigzag, Hilbert order)
//! asks these functions with global positions, so all of them compute one function.

use std::ops::Range;

use crate::config::{Causality, DilatedConfig, Mixing};

/// One dilated pattern: segments of length `w`, every `r`-th position from `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SegmentPattern {
    pub w: usize,
    pub r: usize,
    pub off: usize,
}

impl SegmentPattern {
    /// `w >= 1`, `r >= 1` (guaranteed when built from a validated config).
    pub fn new(w: usize, r: usize, off: usize) -> Self {
        debug_assert!(w >= 1 && r >= 1);
        SegmentPattern { w, r, off }
    }

    /// The pattern of window mode: one segment that is the whole sequence, every position.
    pub const fn whole() -> Self {
        SegmentPattern { w: usize::MAX, r: 1, off: 0 }
    }

    /// Segment index of global position `p`.
    #[inline(always)]
    pub fn segment_of(&self, p: usize) -> usize {
        p / self.w
    }

    /// Number of segments in a sequence of length `n` (the last may be short).
    pub fn num_segments(&self, n: usize) -> usize {
        n.div_ceil(self.w)
    }

    /// Global positions `[s*w, min((s+1)*w, n))` of segment `s`.
    pub fn segment_bounds(&self, s: usize, n: usize) -> Range<usize> {
        let lo = s.saturating_mul(self.w).min(n);
        lo..lo.saturating_add(self.w).min(n)
    }

    /// Whether global position `p` is selected (`p < n` is the caller's business).
    #[inline(always)]
    pub fn is_selected(&self, p: usize) -> bool {
        let j = p % self.w;
        j >= self.off && (j - self.off).is_multiple_of(self.r)
    }

    /// The selected positions of segment `s` in a sequence of length `n`, ascending.
    pub fn selected_in_segment(&self, s: usize, n: usize) -> impl Iterator<Item = usize> + use<> {
        let b = self.segment_bounds(s, n);
        (b.start.saturating_add(self.off)..b.end).step_by(self.r)
    }

    /// Number of selected positions in segment `s` of a sequence of length `n`.
    pub fn count_in_segment(&self, s: usize, n: usize) -> usize {
        let b = self.segment_bounds(s, n);
        let start = b.start.saturating_add(self.off);
        if start >= b.end { 0 } else { (b.end - start).div_ceil(self.r) }
    }

    /// The selected positions inside the global range `range`, ascending (may span segments).
    pub fn selected_in_range(&self, range: Range<usize>) -> impl Iterator<Item = usize> + use<> {
        let this = *self;
        let first_seg = range.start / self.w;
        let last_seg = if range.end == 0 { 0 } else { (range.end - 1) / self.w + 1 };
        (first_seg..last_seg.max(first_seg)).flat_map(move |s| {
            let lo = (s * this.w).saturating_add(this.off);
            let hi = ((s + 1) * this.w).min(range.end);
            // First selected position >= range.start in this segment.
            let start = if range.start > lo { lo + (range.start - lo).div_ceil(this.r) * this.r } else { lo };
            (start..hi.max(start)).step_by(this.r)
        })
    }

    /// Number of selected positions inside the global range (closed form).
    pub fn count_in_range(&self, range: Range<usize>) -> usize {
        // count(selected < x) summed per segment, in O(1).
        let below = |x: usize| -> usize {
            let full = x / self.w;
            // An offset at or past `w` selects nothing (SPEC: positions stay inside the segment).
            let per_seg = self.w.saturating_sub(self.off).div_ceil(self.r);
            let rem = x % self.w;
            let tail = if rem > self.off { (rem - self.off).div_ceil(self.r) } else { 0 };
            full * per_seg + tail
        };
        if range.end <= range.start { 0 } else { below(range.end) - below(range.start) }
    }

    /// The mask: query at global `qp` attends key at global `kp` (both selected,
    /// same segment, and `kp <= qp` when causal).
    #[inline(always)]
    pub fn attends(&self, qp: usize, kp: usize, causality: Causality) -> bool {
        self.is_selected(qp)
            && self.is_selected(kp)
            && self.segment_of(qp) == self.segment_of(kp)
            && (!causality.is_causal() || kp <= qp)
    }

    /// The keys query `qp` attends among `kv_len` key positions, ascending.
    pub fn keys_of(&self, qp: usize, kv_len: usize, causality: Causality) -> impl Iterator<Item = usize> + use<> {
        let selected = self.is_selected(qp);
        let s = self.segment_of(qp);
        let upper = if causality.is_causal() { qp.saturating_add(1) } else { usize::MAX };
        self.selected_in_segment(s, kv_len).take_while(move |&k| selected && k < upper)
    }
}

/// The split of heads into G contiguous groups: `heads / G` each, the first
/// `heads % G` groups one more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadGroups {
    pub heads: usize,
    pub groups: usize,
}

impl HeadGroups {
    /// The split of `heads` into `groups`. `groups >= 1` is the caller's business (a
    /// validated config guarantees it, see `DilatedConfig::validate_heads`): `range` and
    /// `group_of` divide by it and panic on zero.
    pub fn new(heads: usize, groups: usize) -> Self {
        HeadGroups { heads, groups }
    }
    /// Head range of group `g`.
    pub fn range(&self, g: usize) -> Range<usize> {
        let base = self.heads / self.groups;
        let extra = self.heads % self.groups;
        let start = g * base + g.min(extra);
        start..start + base + usize::from(g < extra)
    }
    /// Group of head `h`.
    pub fn group_of(&self, h: usize) -> usize {
        (0..self.groups).find(|&g| self.range(g).contains(&h)).unwrap_or(self.groups - 1)
    }
}

/// What one head computes: a set of patterns merged by LSE, then scaled.
///
/// Both mixing modes are one rule: `lse = logsumexp_i lse_i`,
/// `out = out_scale * sum_i exp(lse_i - lse) * o_i`. HeadGroups is one pattern per
/// head with `out_scale = 1/G`; LongNet is every pattern with `out_scale = 1`.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadPatterns {
    pub patterns: Vec<(usize, SegmentPattern)>,
    pub out_scale: f64,
}

/// Which heads run one pattern, by offset, without listing them: the rule of
/// [`DilatedConfig::head_patterns`] seen from the pattern's side, for counts whose cost
/// must not grow with `heads`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffsetHeads {
    /// HeadGroups: the pattern's group of `count` heads, all at offset `off`.
    One { off: usize, count: usize },
    /// LongNet: head `h` at offset `h mod r`, so offset `o < r` is used by `base` heads,
    /// plus one more when `o < extra`.
    Every { r: usize, base: usize, extra: usize },
}

impl OffsetHeads {
    /// Number of heads that run the pattern.
    pub fn heads(&self) -> usize {
        match *self {
            OffsetHeads::One { count, .. } => count,
            OffsetHeads::Every { r, base, extra } => base * r + extra,
        }
    }

    /// `(offset, heads at that offset)` for every offset some head uses.
    pub fn offsets(&self) -> impl Iterator<Item = (usize, usize)> + use<> {
        let (range, base, extra) = match *self {
            OffsetHeads::One { off, count } => (off..off + 1, count, 0),
            OffsetHeads::Every { r, base, extra } => (0..r.min(self.heads()), base, extra),
        };
        range.map(move |o| (o, base + usize::from(o < extra))).filter(|&(_, n)| n > 0)
    }
}

impl DilatedConfig {
    /// Which of `heads` heads run pattern `i`, and at which offsets.
    pub fn offset_heads(&self, heads: usize, i: usize) -> OffsetHeads {
        let r = self.rate(i);
        match self.mixing() {
            Mixing::Window => OffsetHeads::One { off: 0, count: heads },
            Mixing::HeadGroups => {
                OffsetHeads::One { off: i % r, count: HeadGroups::new(heads, self.num_patterns()).range(i).len() }
            }
            Mixing::LongNet => OffsetHeads::Every { r, base: heads / r, extra: heads % r },
        }
    }

    /// The patterns head `head` of `heads` runs (pairs of pattern index and pattern).
    pub fn head_patterns(&self, heads: usize, head: usize) -> HeadPatterns {
        let g = self.num_patterns();
        match self.mixing() {
            Mixing::Window => HeadPatterns { patterns: vec![(0, SegmentPattern::whole())], out_scale: 1.0 },
            Mixing::HeadGroups => {
                let i = HeadGroups::new(heads, g).group_of(head);
                let r = self.dilation_rates()[i];
                HeadPatterns { patterns: vec![(i, self.pattern(i, i % r))], out_scale: 1.0 / g as f64 }
            }
            Mixing::LongNet => HeadPatterns {
                patterns: (0..g).map(|i| (i, self.pattern(i, head % self.dilation_rates()[i]))).collect(),
                out_scale: 1.0,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_follows_the_spec() {
        let p = SegmentPattern::new(8, 3, 1);
        let sel: Vec<_> = p.selected_in_segment(1, 20).collect();
        assert_eq!(sel, vec![9, 12, 15]);
        // Ragged tail: segment 2 covers [16, 20).
        assert_eq!(p.selected_in_segment(2, 20).collect::<Vec<_>>(), vec![17]);
        assert_eq!(p.count_in_segment(2, 20), 1);
        let (causal, full) = (Causality::Causal, Causality::Full);
        assert!(p.attends(12, 9, causal) && !p.attends(9, 12, causal) && p.attends(9, 12, full));
        assert!(!p.attends(17, 15, full));
        assert_eq!(p.keys_of(12, 20, causal).collect::<Vec<_>>(), vec![9, 12]);
        assert_eq!(p.keys_of(10, 20, full).count(), 0);
    }

    #[test]
    fn range_selection_matches_brute_force() {
        // The last four: a rate wider than the segment, and offsets at or past `w`
        // (nothing selected; `count_in_range` must not wrap around here).
        for (w, r, off) in [(8, 3, 1), (5, 1, 0), (7, 7, 6), (16, 4, 3), (3, 5, 2), (4, 1, 4), (4, 1, 5), (4, 2, 9)] {
            let p = SegmentPattern::new(w, r, off);
            for lo in 0..30 {
                for hi in lo..40 {
                    let brute: Vec<_> = (lo..hi).filter(|&x| p.is_selected(x)).collect();
                    assert_eq!(p.selected_in_range(lo..hi).collect::<Vec<_>>(), brute, "{p:?} {lo}..{hi}");
                    assert_eq!(p.count_in_range(lo..hi), brute.len());
                }
            }
            for seg in 0..8 {
                let brute: Vec<_> = p.segment_bounds(seg, 30).filter(|&x| p.is_selected(x)).collect();
                assert_eq!(p.selected_in_segment(seg, 30).collect::<Vec<_>>(), brute, "{p:?} segment {seg}");
                assert_eq!(p.count_in_segment(seg, 30), brute.len());
            }
        }
        let whole = SegmentPattern::whole();
        assert_eq!((whole.segment_of(1 << 40), whole.segment_bounds(0, 77), whole.num_segments(77)), (0, 0..77, 1));
        assert_eq!(whole.selected_in_range(5..77).collect::<Vec<_>>(), (5..77).collect::<Vec<_>>());
        assert_eq!((whole.count_in_range(5..77), whole.count_in_segment(0, 77)), (72, 77));
        assert!(whole.is_selected(usize::MAX - 1));
        let far = SegmentPattern::new(4, 1, usize::MAX);
        assert_eq!((far.count_in_range(0..100), far.selected_in_range(0..100).count()), (0, 0));
        assert_eq!((far.count_in_segment(3, 100), far.selected_in_segment(3, 100).count()), (0, 0));
    }

    #[test]
    fn offset_heads_follow_head_patterns() {
        for mixing in [Mixing::HeadGroups, Mixing::LongNet] {
            let cfg =
                DilatedConfig::builder().segments(&[8, 12, 30]).dilations(&[1, 3, 5]).mixing(mixing).build().unwrap();
            for heads in 3..17 {
                for i in 0..3 {
                    let mut want = std::collections::BTreeMap::new();
                    for h in 0..heads {
                        for (_, p) in cfg.head_patterns(heads, h).patterns.into_iter().filter(|(j, _)| *j == i) {
                            *want.entry(p.off).or_insert(0usize) += 1;
                        }
                    }
                    let oh = cfg.offset_heads(heads, i);
                    assert_eq!(
                        oh.offsets().collect::<std::collections::BTreeMap<_, _>>(),
                        want,
                        "{mixing:?} {heads} {i}"
                    );
                    assert_eq!(oh.heads(), want.values().sum::<usize>());
                }
            }
        }
    }

    #[test]
    fn head_groups_split_like_the_library() {
        let g = HeadGroups::new(5, 3);
        assert_eq!((g.range(0), g.range(1), g.range(2)), (0..2, 2..4, 4..5));
        assert_eq!(g.group_of(4), 2);
    }
}
