//! Which way an owner's ring block travels. A block passes neighbour to neighbour, to the
//! next rank, to the previous one, or split between both ways, choosing the split with
//! the fewest hops: a two-sided window reaches the rank before and the rank after its
//! owner in one hop each instead of going around the whole ring.

/// A direction around the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Way {
    /// Towards rank `r + 1`.
    Next,
    /// Towards rank `r - 1`.
    Prev,
}

impl Way {
    /// Both ways, in the order every rank handles them.
    pub const BOTH: [Way; 2] = [Way::Next, Way::Prev];

    /// Index of the way in per-way tables.
    pub fn index(self) -> usize {
        match self {
            Way::Next => 0,
            Way::Prev => 1,
        }
    }

    /// The rank `t` steps from `from` this way, on a ring of `p` ranks.
    pub fn step(self, from: usize, t: usize, p: usize) -> usize {
        match self {
            Way::Next => (from + t % p) % p,
            Way::Prev => (from + p - t % p) % p,
        }
    }

    /// The owner whose block, travelling this way, reaches `rank` at step `t`.
    pub fn owner_at(self, rank: usize, t: usize, p: usize) -> usize {
        match self {
            Way::Next => Way::Prev.step(rank, t, p),
            Way::Prev => Way::Next.step(rank, t, p),
        }
    }

    /// Steps from `owner` to `rank` this way.
    pub fn distance(self, owner: usize, rank: usize, p: usize) -> usize {
        match self {
            Way::Next => (rank + p - owner) % p,
            Way::Prev => (owner + p - rank) % p,
        }
    }
}

/// How far an owner's block travels each way; a receiver `d` steps after the owner (the
/// [`Way::Next`] distance) gets it going [`Way::Next`] when `d <= split`, else [`Way::Prev`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Route {
    pub next: usize,
    pub prev: usize,
    pub split: usize,
}

impl Route {
    /// Hops the block makes going `way`.
    pub fn hops(&self, way: Way) -> usize {
        match way {
            Way::Next => self.next,
            Way::Prev => self.prev,
        }
    }

    /// The way a receiver `next_distance` steps after the owner gets the block.
    pub fn way_of(&self, next_distance: usize) -> Way {
        if next_distance <= self.split { Way::Next } else { Way::Prev }
    }
}

/// The route with the fewest hops for receivers at the sorted, distinct [`Way::Next`]
/// distances `dists` (each in `1..p`): the nearer ones go next, the farther ones the
/// other way round. Ties keep more receivers on the next way (one way when it is as
/// short). Fewer hops never send more bytes: each way carries a part of the whole block.
pub(crate) fn route(dists: &[usize], p: usize) -> Route {
    let m = dists.len();
    let at = |j: usize| {
        if j == 0 {
            0
        } else if j > m {
            p
        } else {
            dists[j - 1]
        }
    };
    let mut best = Route { next: at(m), prev: 0, split: at(m) };
    for j in (0..m).rev() {
        let (next, prev) = (at(j), p - at(j + 1));
        if next + prev < best.next + best.prev {
            best = Route { next, prev, split: next };
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_take_the_fewest_hops() {
        // Dense attention: every rank needs the block; one way round, as a plain ring.
        assert_eq!(route(&[1, 2, 3], 4), Route { next: 3, prev: 0, split: 3 });
        // A two-sided window: the rank after and the rank before, one hop each.
        assert_eq!(route(&[1, 7], 8), Route { next: 1, prev: 1, split: 1 });
        // Only the rank before: one hop back instead of p - 1 forward.
        assert_eq!(route(&[4], 5), Route { next: 0, prev: 1, split: 0 });
        // Causal contiguous: the ranks after, one way.
        assert_eq!(route(&[1, 2], 5), Route { next: 2, prev: 0, split: 2 });
        assert_eq!(route(&[], 3), Route { next: 0, prev: 0, split: 0 });
        // A tie (2 + 2 against 4 one way) stays on one way.
        assert_eq!(route(&[2, 4], 6), Route { next: 4, prev: 0, split: 4 });
    }

    #[test]
    fn ways_step_and_measure_consistently() {
        let p = 5;
        for way in Way::BOTH {
            for o in 0..p {
                for t in 0..p {
                    let r = way.step(o, t, p);
                    assert_eq!(way.distance(o, r, p), t);
                    assert_eq!(way.owner_at(r, t, p), o);
                }
            }
        }
        let r = route(&[1, 3, 4], 5);
        assert_eq!((r.way_of(1), r.way_of(3), r.way_of(4)), (Way::Next, Way::Prev, Way::Prev));
    }
}
