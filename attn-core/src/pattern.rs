//! Pattern math as pure functions of global positions: which positions a
//! `(w, r, off)` pattern selects, their segment, and who attends to whom.
//!
//! Every split of the sequence (contiguous ring chunks, zigzag, Hilbert order)
//! asks these functions with global positions, so all of them compute one function.

use std::ops::Range;

use crate::causality::Causality;

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
}
