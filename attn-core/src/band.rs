//! [`Band`]: which keys a query may see by distance alone, `qp - left <= kp <= qp + right`.
//!
//! One rule covers causal (`right = 0`), full (both unbounded) and sliding windows, so
//! every kernel masks with the same two position comparisons.

use std::ops::Range;

/// Keys a query at position `qp` may see: `qp - left ..= qp + right` (saturating);
/// `usize::MAX` on a side means unbounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Band {
    pub left: usize,
    pub right: usize,
}

impl Band {
    /// Every key.
    pub const FULL: Band = Band { left: usize::MAX, right: usize::MAX };
    /// Keys at or before the query.
    pub const CAUSAL: Band = Band { left: usize::MAX, right: 0 };

    pub const fn new(left: usize, right: usize) -> Self {
        Band { left, right }
    }

    /// Whether the query at `qp` may see the key at `kp`.
    #[inline(always)]
    pub fn admits(&self, qp: usize, kp: usize) -> bool {
        kp.saturating_add(self.left) >= qp && kp <= qp.saturating_add(self.right)
    }

    /// Whether a lower bound exists (keys far before a query are cut off).
    #[inline(always)]
    pub fn has_left_edge(&self) -> bool {
        self.left != usize::MAX
    }

    /// Whether an upper bound exists (keys far after a query are cut off).
    #[inline(always)]
    pub fn has_right_edge(&self) -> bool {
        self.right != usize::MAX
    }

    /// The positions some query in `first_q..=last_q` may see (half-open, saturating).
    pub fn keys_of_queries(&self, first_q: usize, last_q: usize) -> Range<usize> {
        first_q.saturating_sub(self.left)..last_q.saturating_add(self.right).saturating_add(1)
    }

    /// The query positions that may see some key in `first_k..=last_k` (half-open).
    pub fn queries_of_keys(&self, first_k: usize, last_k: usize) -> Range<usize> {
        first_k.saturating_sub(self.right)..last_k.saturating_add(self.left).saturating_add(1)
    }

    /// The index range of the ascending positions `kpos` that the query at `qp` sees.
    #[inline]
    pub fn visible(&self, kpos: &[usize], qp: usize) -> Range<usize> {
        let lo = if self.has_left_edge() { kpos.partition_point(|&k| k.saturating_add(self.left) < qp) } else { 0 };
        let hi = if self.has_right_edge() {
            let top = qp.saturating_add(self.right);
            kpos.partition_point(|&k| k <= top)
        } else {
            kpos.len()
        };
        lo..hi.max(lo)
    }

    /// The index range of the ascending query positions `qpos` that see the key at `kp`.
    #[inline]
    pub fn seen_by(&self, qpos: &[usize], kp: usize) -> Range<usize> {
        let lo = if self.has_right_edge() { qpos.partition_point(|&q| q.saturating_add(self.right) < kp) } else { 0 };
        let hi = if self.has_left_edge() {
            let top = kp.saturating_add(self.left);
            qpos.partition_point(|&q| q <= top)
        } else {
            qpos.len()
        };
        lo..hi.max(lo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_match_the_pairwise_rule() {
        let pos: Vec<usize> = (0..40).filter(|p| p % 3 != 1).collect();
        for band in [Band::FULL, Band::CAUSAL, Band::new(0, 0), Band::new(5, 0), Band::new(3, 7), Band::new(0, 4)] {
            for p in 0..45 {
                let admitted: Vec<usize> = (0..pos.len()).filter(|&i| band.admits(p, pos[i])).collect();
                let r = band.visible(&pos, p);
                assert_eq!(r.clone().collect::<Vec<_>>(), admitted, "{band:?} query {p}");
                let seen: Vec<usize> = (0..pos.len()).filter(|&i| band.admits(pos[i], p)).collect();
                assert_eq!(band.seen_by(&pos, p).collect::<Vec<_>>(), seen, "{band:?} key {p}");
                for &k in &pos {
                    if band.admits(p, k) {
                        assert!(band.keys_of_queries(p, p).contains(&k) && band.queries_of_keys(k, k).contains(&p));
                    }
                }
            }
        }
        assert!(Band::CAUSAL.admits(usize::MAX, 0) && Band::new(2, 2).admits(usize::MAX, usize::MAX - 2));
        assert!(!Band::new(2, 2).admits(usize::MAX, usize::MAX - 3));
    }
}
