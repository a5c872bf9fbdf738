//! Which patterns each head runs: the split of heads into groups (HeadGroups mixing),
//! every pattern at the head's offset (LongNet), and the same rule counted by offset.

use std::ops::Range;

use crate::config::{DilatedConfig, Mixing};
use crate::pattern::SegmentPattern;

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
