//! Attended (query, key) pairs of variable-length sequences, packed (each sequence alone)
//! and padded to the longest with the padding masked as keys: the work of a kernel whose
//! time follows the attended pairs in each layout, so their ratio is the most packing can
//! gain. A padded query attends the real keys of its segment (it is computed normally);
//! a segment of padding alone has no keys and costs nothing.

use attn_core::{DilatedConfig, SegmentPattern};

/// Attended pairs of a batch in both layouts, over every head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairCounts {
    pub packed: u128,
    pub padded: u128,
}

impl PairCounts {
    /// Padded pairs per packed pair.
    pub fn ratio(&self) -> f64 {
        self.padded as f64 / self.packed.max(1) as f64
    }
}

/// Selected positions of `p` in `[lo, hi)`, both inside the segment starting at `start`.
fn selected(p: &SegmentPattern, start: usize, lo: usize, hi: usize) -> u128 {
    let below = |x: usize| if x - start > p.off { (x - start - p.off).div_ceil(p.r) } else { 0 };
    if hi <= lo { 0 } else { (below(hi) - below(lo)) as u128 }
}

/// The pairs of `lengths` under `cfg` (a dilated config; `None` for a window) with `heads`
/// query heads.
pub fn varlen_pairs(cfg: &DilatedConfig, heads: usize, lengths: &[usize]) -> Option<PairCounts> {
    if cfg.window().is_some() {
        return None;
    }
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let among = |c: u128| if cfg.causal() { c * (c + 1) / 2 } else { c * c };
    let mut counts = PairCounts { packed: 0, padded: 0 };
    for h in 0..heads {
        for (_, p) in cfg.head_patterns(heads, h).patterns {
            for &len in lengths {
                for s in 0..p.num_segments(longest) {
                    let seg = p.segment_bounds(s, longest);
                    let real = selected(&p, seg.start, seg.start, seg.end.min(len).max(seg.start));
                    let all = selected(&p, seg.start, seg.start, seg.end);
                    counts.packed += among(real);
                    // Real queries as packed; each padded query (after every real key) sees them all.
                    counts.padded += among(real) + (all - real) * real;
                }
            }
        }
    }
    Some(counts)
}

#[cfg(test)]
mod tests {
    use attn_core::Mixing;

    use super::*;

    /// The pairs by walking every (query, key) of every head: packed sequences alone, the
    /// padded batch with keys past each length masked.
    fn walk(cfg: &DilatedConfig, heads: usize, lengths: &[usize]) -> PairCounts {
        let longest = lengths.iter().copied().max().unwrap();
        let causality = cfg.causality();
        let mut c = PairCounts { packed: 0, padded: 0 };
        for h in 0..heads {
            for (_, p) in cfg.head_patterns(heads, h).patterns {
                for &len in lengths {
                    let pairs = |n_q: usize, n_k: usize| {
                        (0..n_q).map(|q| (0..n_k).filter(|&k| p.attends(q, k, causality)).count() as u128).sum::<u128>()
                    };
                    c.packed += pairs(len, len);
                    c.padded += pairs(longest, len);
                }
            }
        }
        c
    }

    #[test]
    fn counts_equal_the_walk() {
        for (segs, rates) in [(vec![4, 8], vec![1, 2]), (vec![6, 12, 24], vec![1, 2, 4]), (vec![5], vec![3])] {
            for mixing in [Mixing::HeadGroups, Mixing::LongNet] {
                for causal in [false, true] {
                    let cfg = DilatedConfig::builder()
                        .segments(&segs)
                        .dilations(&rates)
                        .mixing(mixing)
                        .causality(causal.into())
                        .build()
                        .unwrap();
                    for lengths in [vec![7, 30, 1, 19], vec![24, 24], vec![13]] {
                        let got = varlen_pairs(&cfg, 5, &lengths).unwrap();
                        assert_eq!(got, walk(&cfg, 5, &lengths), "{segs:?} {mixing:?} causal={causal} {lengths:?}");
                    }
                }
            }
        }
        let window = DilatedConfig::builder().window(3, 0).build().unwrap();
        assert_eq!(varlen_pairs(&window, 2, &[5]), None);
    }
}
