//! How the Ulysses strategies split heads and rows: ranks `g*U .. g*U+U` form group `g`,
//! slot `j` of a group attends query heads `slot_heads(j)` (the first `heads % U` slots
//! take one more head) over the group's rows, with the key/value heads those query heads
//! read; the ranks of one slot pass their groups' keys and values around a ring.

use std::ops::Range;

use attn_core::{AttnError, DType, Feature, Pass, Result};

use crate::plan::layout::Layout;
use crate::plan::{MSG_HEADER_BYTES, RingProblem};

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

    /// Global positions of group `g`'s rows, ascending: the union of its members' rows.
    pub fn group_positions(&self, layout: Layout, n: usize, g: usize) -> Vec<usize> {
        let world = self.u * self.groups;
        let mut pos: Vec<usize> = self.members(g).flat_map(|m| layout.positions(n, world, m)).collect();
        pos.sort_unstable();
        pos
    }
}

/// Payload bytes each rank sends in one Ulysses or hybrid call (the head strategies'
/// [`crate::expected_bytes`]), with `L_m` member `m`'s rows, `m_j`/`k_j` slot `j`'s query
/// and key/value heads, `N_g` group `g`'s rows, `D` the head dim and `e` the element size;
/// every message carries a [`MSG_HEADER_BYTES`] header and nothing travels to itself.
/// Forward: to each other member `m` of its group, rank `r` (slot `j`) sends its rows of
/// `m`'s slot, `B*L_r*(m_m + 2k_m)*D*e` (q, k, v), then `m`'s rows of its own slot's out and
/// lse, `B*L_m*m_j*(D*e + 4)`; around the ring of its slot over the `G` groups, at steps
/// `t = 1..G` the k/v of group `g - t + 1`, `B*N*2k_j*D*e`. Backward: the first all-to-all
/// adds grad_out and the f32 gradient into the LSE (`B*L_r*m_m*(D*e + 4)`, zeros when none
/// is given); the ring runs twice (the forward recomputed, then each block with its f32
/// dk/dv, `B*N*2k_j*D*(e + 4)`), and a last step takes group `g + 1`'s dk/dv home
/// (`B*N_(g+1)*2k_j*D*4`); the second all-to-all carries f32 dq, dk, dv
/// (`B*L_m*(m_j + 2k_j)*D*4`). Handshake and completion are not counted.
pub fn heads_bytes(problem: &RingProblem, split: &HeadSplit, dtype: DType, pass: Pass) -> Vec<u64> {
    let backward = pass == Pass::Backward;
    let RingProblem { batch, head_dim, seq: n, world: p, layout, .. } = *problem;
    let (b, d, e) = (batch as u64, head_dim as u64, dtype.size() as u64);
    let rows = |m: usize| layout.rows(n, p, m) as u64;
    let group_rows = |g: usize| split.group_positions(layout, n, g).len() as u64;
    let (heads, kv) = (|j: usize| split.slot_heads(j).len() as u64, |j: usize| split.slot_kv(j).len() as u64);
    (0..p)
        .map(|r| {
            let (g, j) = (split.group_of(r), split.slot_of(r));
            let mut sent = 0u64;
            for m in split.members(g).filter(|&m| m != r) {
                let jm = split.slot_of(m);
                sent += MSG_HEADER_BYTES + b * rows(r) * (heads(jm) + 2 * kv(jm)) * d * e;
                if backward {
                    sent += b * rows(r) * heads(jm) * (d * e + 4);
                    sent += MSG_HEADER_BYTES + b * rows(m) * (heads(j) + 2 * kv(j)) * d * 4;
                } else {
                    sent += MSG_HEADER_BYTES + b * rows(m) * heads(j) * (d * e + 4);
                }
            }
            // The ring over the groups: at step t (1..G) this rank passes on the block of
            // group g - t + 1 (every group but g + 1), in the backward twice (the forward
            // recomputed, then with its f32 dk/dv), and last sends the dk/dv of group g + 1 home.
            let groups = split.groups;
            for t in 1..groups {
                let held = group_rows((g + groups + 1 - t) % groups);
                sent += MSG_HEADER_BYTES + b * held * 2 * kv(j) * d * e;
                if backward {
                    sent += MSG_HEADER_BYTES + b * held * 2 * kv(j) * d * (e + 4);
                }
            }
            if backward && groups > 1 {
                sent += MSG_HEADER_BYTES + b * group_rows((g + 1) % groups) * 2 * kv(j) * d * 4;
            }
            sent
        })
        .collect()
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
