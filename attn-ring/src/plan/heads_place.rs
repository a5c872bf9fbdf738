//! Where a rank stands in a Ulysses or hybrid call: its group, slot, the group's members
//! and rows ([`HeadPlace`]), shared by the host path (`compute::ulysses`) and the chunk
//! ring's head exchange (`chunk_ring::heads`).

use attn_core::Result;

use crate::plan::RingProblem;
use crate::plan::heads_split::HeadSplit;

/// Where a call stands: the split, this rank, its group's ranks and rows.
pub(crate) struct HeadPlace {
    pub split: HeadSplit,
    pub rank: usize,
    pub group: usize,
    pub slot: usize,
    /// The group's ranks, in slot order.
    pub members: Vec<usize>,
    /// Each member's global positions (its rows, ascending).
    pub member_pos: Vec<Vec<usize>>,
    /// Each member's rows as indices into `qpos`.
    pub member_idx: Vec<Vec<usize>>,
    /// The group's positions, ascending.
    pub qpos: Vec<usize>,
}

impl HeadPlace {
    /// The place of `rank` in `problem`'s head split (its strategy's Ulysses degree).
    pub(crate) fn new(problem: &RingProblem, rank: usize) -> Result<Self> {
        let u = problem.strategy.ulysses_degree(problem.world).unwrap_or(problem.world);
        let split = HeadSplit::new(problem.heads, problem.kv_heads, u, problem.world)?;
        let (n, p, layout) = (problem.seq, problem.world, problem.layout);
        let group = split.group_of(rank);
        let members: Vec<usize> = split.members(group).collect();
        let member_pos: Vec<Vec<usize>> = members.iter().map(|&m| layout.positions(n, p, m)).collect();
        let qpos = split.group_positions(layout, n, group);
        let member_idx =
            member_pos.iter().map(|pos| pos.iter().map(|&x| qpos.partition_point(|&y| y < x)).collect()).collect();
        Ok(HeadPlace { split, rank, group, slot: split.slot_of(rank), members, member_pos, member_idx, qpos })
    }

    /// This slot's rank in the next group (the ring over the groups sends there).
    pub(crate) fn next_across(&self) -> usize {
        self.split.rank_of((self.group + 1) % self.split.groups, self.slot)
    }

    /// This slot's rank in the previous group (the ring over the groups receives from there).
    pub(crate) fn prev_across(&self) -> usize {
        self.split.rank_of((self.group + self.split.groups - 1) % self.split.groups, self.slot)
    }

    /// The group whose block arrives at step `t` of the ring over the groups.
    pub(crate) fn arriving(&self, t: usize) -> usize {
        (self.group + self.split.groups - t % self.split.groups) % self.split.groups
    }
}
