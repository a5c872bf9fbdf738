//! How the Ulysses strategies split heads and rows: ranks `g*U .. g*U+U` form group `g`,
//! slot `j` of a group attends query heads `slot_heads(j)` (the first `heads % U` slots
//! take one more head) over the group's rows, with the key/value heads those query heads
//! read; the ranks of one slot pass their groups' keys and values around a ring.

use std::ops::Range;

use attn_core::{AttnError, Feature, Result};

use crate::plan::layout::Layout;

/// The head split of a Ulysses or hybrid call: `u` ranks a group, `world / u` groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSplit {
    pub heads: usize,
    pub kv_heads: usize,
    /// Ranks per group (the Ulysses degree).
    pub u: usize,
    /// Number of groups.
    pub groups: usize,
}

/// The refusal of a Ulysses degree above the query heads: a slot would attend no head.
pub fn too_few_heads() -> AttnError {
    AttnError::Unsupported {
        backend: "ring",
        feature: Feature::Other(
            "a Ulysses degree above the query heads (every rank of a group needs a head): use a degree U <= heads \
             (strategy hybrid:U) or the ring",
        ),
    }
}

impl HeadSplit {
    /// The split of `heads` query heads (reading `kv_heads`) over groups of `u` of `world`
    /// ranks: `u` must divide `world`, and `heads < u` is `Unsupported` (naming the fix).
    pub fn new(heads: usize, kv_heads: usize, u: usize, world: usize) -> Result<Self> {
        if u == 0 || !world.is_multiple_of(u) {
            return Err(AttnError::InvalidArgument(format!(
                "Ulysses degree {u} does not divide the world of {world} ranks (groups of U consecutive ranks)"
            )));
        }
        if heads < u {
            return Err(too_few_heads());
        }
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(AttnError::KvHeadsNotDividing { heads, kv_heads });
        }
        Ok(HeadSplit { heads, kv_heads, u, groups: world / u })
    }

    /// The group of `rank`.
    pub fn group_of(&self, rank: usize) -> usize {
        rank / self.u
    }

    /// The head slot of `rank` within its group.
    pub fn slot_of(&self, rank: usize) -> usize {
        rank % self.u
    }

    /// The ranks of group `g`, in slot order.
    pub fn members(&self, g: usize) -> Range<usize> {
        g * self.u..(g + 1) * self.u
    }

    /// The rank of slot `j` in group `g`.
    pub fn rank_of(&self, g: usize, j: usize) -> usize {
        g * self.u + j
    }

    /// Query heads of slot `j`.
    pub fn slot_heads(&self, j: usize) -> Range<usize> {
        let (base, extra) = (self.heads / self.u, self.heads % self.u);
        let start = j * base + j.min(extra);
        start..start + base + usize::from(j < extra)
    }

    /// Key/value heads the query heads of slot `j` read.
    pub fn slot_kv(&self, j: usize) -> Range<usize> {
        let group = self.heads / self.kv_heads;
        let h = self.slot_heads(j);
        h.start / group..(h.end - 1) / group + 1
    }

    /// The key/value head (of [`HeadSplit::slot_kv`]`(j)`, counted from its start) that
    /// global query head `h` of slot `j` reads.
    pub fn local_kv(&self, j: usize, h: usize) -> usize {
        h / (self.heads / self.kv_heads) - self.slot_kv(j).start
    }

    /// How many rows group `g` holds (its members' rows, without listing them).
    pub fn group_rows(&self, layout: Layout, n: usize, g: usize) -> usize {
        let world = self.u * self.groups;
        self.members(g).map(|m| layout.rows(n, world, m)).sum()
    }

    /// Global positions of group `g`'s rows, ascending: the union of its members' rows.
    pub fn group_positions(&self, layout: Layout, n: usize, g: usize) -> Vec<usize> {
        let world = self.u * self.groups;
        let mut pos: Vec<usize> = self.members(g).flat_map(|m| layout.positions(n, world, m)).collect();
        pos.sort_unstable();
        pos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_cover_every_head_once_and_read_their_kv_heads() {
        for heads in 1..13 {
            for kv in (1..=heads).filter(|k| heads % k == 0) {
                for u in 1..=heads {
                    let s = HeadSplit::new(heads, kv, u, 2 * u).unwrap();
                    let all: Vec<usize> = (0..u).flat_map(|j| s.slot_heads(j)).collect();
                    assert_eq!(all, (0..heads).collect::<Vec<_>>());
                    let sizes: Vec<usize> = (0..u).map(|j| s.slot_heads(j).len()).collect();
                    assert!(sizes.windows(2).all(|w| w[0] >= w[1] && w[0] - w[1] <= 1), "{sizes:?}");
                    for j in 0..u {
                        for h in s.slot_heads(j) {
                            assert_eq!(s.slot_kv(j).start + s.local_kv(j, h), h / (heads / kv));
                            assert!(s.local_kv(j, h) < s.slot_kv(j).len());
                        }
                    }
                }
                assert!(matches!(HeadSplit::new(heads, kv, heads + 1, heads + 1), Err(AttnError::Unsupported { .. })));
            }
        }
        assert!(matches!(HeadSplit::new(8, 8, 3, 4), Err(AttnError::InvalidArgument(_))));
        // Group positions are the members' rows (zigzag: two runs per member).
        let s = HeadSplit::new(4, 4, 2, 4).unwrap();
        assert_eq!(s.group_positions(Layout::Zigzag, 16, 0), vec![0, 1, 2, 3, 12, 13, 14, 15]);
        assert_eq!(s.group_positions(Layout::Contiguous, 16, 1), (8..16).collect::<Vec<_>>());
    }
}
