//! `Strategy::Auto`'s choice, per call, between the row plan (each pattern segment-local,
//! ring pass or all-gather, [`crate::PatternStrategy`]) and the head strategies (Ulysses,
//! and the hybrid at each degree `U` dividing the world with `U <= heads`), from a cost
//! model of each candidate's forward in f32, in closed form (nothing runs):
//! - `bytes`: the most payload bytes any rank sends ([`crate::expected_traffic`]);
//! - `messages`: the most data messages any rank sends;
//! - `memory`: the largest per-rank workspace bound ([`crate::Plan::workspace_bytes`]).
//!
//! The rule: where the row plan sends nothing (every segment sits inside a rank's rows)
//! it is kept. Otherwise a candidate whose `memory` is over [`MEMORY_SLACK`] times the
//! leanest candidate's is out, and of the rest the lowest `bytes + messages *
//! MESSAGE_COST_BYTES` wins; ties keep the earlier of: the row plan, then the head
//! strategies from the largest degree down. The model depends on the problem alone (not on
//! the dtype or the pass), so every rank, and both passes of one problem, choose alike. An
//! explicit strategy is never second-guessed.

use attn_core::{DType, Pass};

use crate::plan::heads_split::HeadSplit;
use crate::plan::heads_workspace::heads_workspace_bytes;
use crate::plan::traffic::{Traffic, heads_traffic, row_traffic};
use crate::plan::{PatternStrategy, Plan, RingProblem, Strategy};

/// The fixed cost of one message, in the payload bytes it could carry instead: about the
/// latency of a small NCCL or MPI message (a few microseconds) at tens of GB/s.
pub const MESSAGE_COST_BYTES: u64 = 64 * 1024;

/// How many times the leanest candidate's per-rank memory a candidate may need: the head
/// strategies' bound is loose by up to 2x and holds both all-to-alls' buffers, about 4x
/// the pieced all-gather's at P = 2 and 2-3x the ring's at P = 8 on dense attention.
pub const MEMORY_SLACK: u64 = 4;

/// One way `Strategy::Auto` can run a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Candidate {
    /// The per-pattern row plan (segment-local, ring pass, all-gather).
    Rows,
    /// Ulysses (`u` = world) or the hybrid of degree `u`.
    Heads(HeadSplit),
}

impl Candidate {
    /// The explicit strategy that runs this candidate (`Auto` for the row plan, whose
    /// per-pattern choice is `Auto`'s own).
    pub fn strategy(&self) -> Strategy {
        match self {
            Candidate::Rows => Strategy::Auto,
            Candidate::Heads(s) if s.groups == 1 => Strategy::Ulysses,
            Candidate::Heads(s) => Strategy::Hybrid { ulysses: s.u },
        }
    }
}

/// A candidate's forward, the worst rank of each figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cost {
    pub bytes: u64,
    pub messages: u64,
    pub memory: u64,
}

impl Cost {
    /// `bytes + messages * MESSAGE_COST_BYTES`, what the choice minimises.
    pub fn score(&self) -> u64 {
        self.bytes.saturating_add(self.messages.saturating_mul(MESSAGE_COST_BYTES))
    }

    fn of(traffic: &[Traffic], memory: impl Iterator<Item = u64>) -> Self {
        Cost {
            bytes: traffic.iter().map(|t| t.bytes).max().unwrap_or(0),
            messages: traffic.iter().map(|t| t.messages).max().unwrap_or(0),
            memory: memory.max().unwrap_or(0),
        }
    }
}

/// Every candidate of `plan`'s problem with its cost: the row plan first, then the head
/// splits from the largest degree down (those the heads allow).
pub fn candidates(plan: &Plan) -> Vec<(Candidate, Cost)> {
    let pr = &plan.problem;
    let (dtype, pass, p) = (DType::F32, Pass::Forward, pr.world);
    let rows = Cost::of(&row_traffic(plan, dtype, pass), (0..p).map(|r| plan.row_workspace_bytes(dtype, r, pass)));
    let mut all = vec![(Candidate::Rows, rows)];
    for u in (2..=p).rev().filter(|&u| p.is_multiple_of(u)) {
        if let Ok(split) = HeadSplit::new(pr.heads, pr.kv_heads, u, p) {
            let memory = (0..p).map(|r| heads_workspace_bytes(pr, &split, dtype, r, pass));
            all.push((Candidate::Heads(split), Cost::of(&heads_traffic(pr, &split, dtype, pass), memory)));
        }
    }
    all
}

/// The rule of the module documentation over `candidates` (the row plan first).
pub fn choose(candidates: &[(Candidate, Cost)]) -> Candidate {
    match candidates.first() {
        None => return Candidate::Rows,
        Some((Candidate::Rows, c)) if c.bytes == 0 => return Candidate::Rows,
        Some(_) => {}
    }
    let leanest = candidates.iter().map(|(_, c)| c.memory).min().unwrap_or(0);
    let fits = |c: &Cost| c.memory <= leanest.saturating_mul(MEMORY_SLACK);
    // `min_by_key` keeps the first of equal scores: the earlier candidate wins a tie.
    candidates.iter().filter(|(_, c)| fits(c)).min_by_key(|(_, c)| c.score()).map_or(Candidate::Rows, |(x, _)| *x)
}

impl Plan {
    /// The head split the call runs instead of the row plan: an explicit Ulysses or
    /// hybrid's, or where [`Strategy::Auto`] picks one (this module's rule); `None` for the
    /// row plan. Decided on first use.
    pub fn head_split(&self) -> Option<&HeadSplit> {
        self.head_split_once.get_or_init(|| head_split_of(self)).as_ref()
    }
}

/// The head split of [`Plan::head_split`], from the row plan's costs.
fn head_split_of(plan: &Plan) -> Option<HeadSplit> {
    let pr = &plan.problem;
    match pr.strategy {
        Strategy::Auto => match choose(&candidates(plan)) {
            Candidate::Rows => None,
            Candidate::Heads(split) => Some(split),
        },
        // Where no query reaches another rank's keys there is nothing to exchange: the
        // call is segment-local, as the ring's is then.
        _ if plan.strategies.iter().all(|s| *s == PatternStrategy::Local) => None,
        s => HeadSplit::new(pr.heads, pr.kv_heads, s.ulysses_degree(pr.world)?, pr.world).ok(),
    }
}

/// Whether a call of `problem` runs a head strategy: Ulysses or the hybrid (explicit, or
/// `Auto`'s pick after [`resolved`]) where [`Plan::head_split`] has a split. A problem the
/// plan refuses goes the way its strategy names, whose checks report why.
pub(crate) fn runs_heads(problem: &RingProblem) -> bool {
    problem.strategy.ulysses_degree(problem.world).is_some()
        && Plan::new(problem.clone()).map_or(true, |plan| plan.head_split().is_some())
}

/// `problem` as the call runs it: itself, or where `Auto` picks a head strategy a copy
/// naming it (the compute paths read the strategy from the problem).
pub(crate) fn resolved(problem: &RingProblem) -> std::borrow::Cow<'_, RingProblem> {
    use std::borrow::Cow;
    if problem.strategy != Strategy::Auto {
        return Cow::Borrowed(problem);
    }
    match Plan::new(problem.clone()).ok().and_then(|plan| plan.head_split().copied()) {
        Some(split) => {
            let mut chosen = problem.clone();
            chosen.strategy = Candidate::Heads(split).strategy();
            Cow::Owned(chosen)
        }
        None => Cow::Borrowed(problem),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::layout::Layout;
    use attn_core::{DilatedConfig, Shape4};

    /// `Auto`'s plan (or `strategy`'s) for one config on `world` ranks, n = 4096, D = 64.
    fn plan(w: &[usize], r: &[usize], heads: usize, world: usize, strategy: Strategy) -> Plan {
        let cfg = DilatedConfig::builder().segments(w).dilations(r).build().unwrap();
        let shape = Shape4::new(1, 4096, heads, 64).unwrap();
        Plan::new(RingProblem::new(&cfg, shape.into(), Layout::Contiguous, strategy, world)).unwrap()
    }

    fn picked(plan: &Plan) -> Strategy {
        plan.head_split().map_or(Strategy::Auto, |s| Candidate::Heads(*s).strategy())
    }

    fn cost(bytes: u64, messages: u64, memory: u64) -> Cost {
        Cost { bytes, messages, memory }
    }

    #[test]
    fn the_rule_weighs_messages_drops_memory_hogs_and_keeps_the_rows_on_a_tie() {
        let heads = |u| Candidate::Heads(HeadSplit::new(8, 8, u, 8).unwrap());
        let (rows, ulysses, hybrid) = (Candidate::Rows, heads(8), heads(4));
        // Fewer bytes win; a message costs MESSAGE_COST_BYTES.
        let c =
            [(rows, cost(10_000_000, 1, 100)), (ulysses, cost(4_000_000, 14, 100)), (hybrid, cost(5_000_000, 7, 100))];
        assert_eq!(choose(&c), ulysses);
        let c =
            [(rows, cost(10_000_000, 1, 100)), (ulysses, cost(4_000_000, 100, 100)), (hybrid, cost(5_000_000, 7, 100))];
        assert_eq!(choose(&c), hybrid);
        // Over MEMORY_SLACK times the leanest's memory is out, however few the bytes.
        let c = [(rows, cost(10_000_000, 1, 100)), (ulysses, cost(1, 1, 100 * MEMORY_SLACK + 1))];
        assert_eq!(choose(&c), rows);
        let c = [(rows, cost(10_000_000, 1, 100)), (ulysses, cost(1, 1, 100 * MEMORY_SLACK))];
        assert_eq!(choose(&c), ulysses);
        // A tie keeps the row plan; a row plan sending nothing is kept outright.
        let c = [(rows, cost(1000, 2, 100)), (ulysses, cost(1000, 2, 100))];
        assert_eq!(choose(&c), rows);
        let c = [(rows, cost(0, 0, 1000)), (ulysses, cost(0, 0, 1))];
        assert_eq!(choose(&c), rows);
    }

    #[test]
    fn segments_inside_ranks_keep_the_row_plan_which_sends_nothing() {
        for world in [2, 4, 8] {
            let plan = plan(&[256, 512], &[1, 2], 8, world, Strategy::Auto);
            assert_eq!(picked(&plan), Strategy::Auto, "p={world}");
            assert!(crate::expected_bytes(&plan, DType::F32, Pass::Forward).iter().all(|&b| b == 0));
            assert!(plan.strategies.iter().all(|s| *s == crate::PatternStrategy::Local));
        }
    }

    #[test]
    fn each_candidate_wins_where_the_model_says_it_must() {
        // Dense attention (one segment of n, rate 1), 8 heads: Ulysses sends about 2/P of
        // the ring's bytes at P = 4 and 8; at P = 2 the pieced all-gather stays, Ulysses'
        // buffers being over MEMORY_SLACK times its own.
        assert_eq!(picked(&plan(&[4096], &[1], 8, 2, Strategy::Auto)), Strategy::Auto);
        assert_eq!(picked(&plan(&[4096], &[1], 8, 4, Strategy::Auto)), Strategy::Ulysses);
        assert_eq!(picked(&plan(&[4096], &[1], 8, 8, Strategy::Auto)), Strategy::Ulysses);
        // 4 heads on 8 ranks: Ulysses cannot run (a slot would have no head); the hybrid of
        // degree 4 sends least.
        assert_eq!(picked(&plan(&[4096], &[1], 4, 8, Strategy::Auto)), Strategy::Hybrid { ulysses: 4 });
        // Rate 8: the all-gather moves an eighth of the rows; at P = 8 its 56 messages
        // score above Ulysses, whose memory is then over the slack: the rows stay.
        for world in [2, 4, 8] {
            let p = plan(&[4096], &[8], 8, world, Strategy::Auto);
            assert_eq!(picked(&p), Strategy::Auto, "p={world}");
            assert!(p.strategies.iter().all(|s| *s == crate::PatternStrategy::AllGather));
        }
        let c = candidates(&plan(&[4096], &[8], 8, 8, Strategy::Auto));
        let (rows, ulysses) = (c[0].1, c[1].1);
        assert!(ulysses.score() < rows.score() && ulysses.memory > MEMORY_SLACK * rows.memory, "{c:?}");
    }

    #[test]
    fn an_explicit_strategy_always_wins() {
        // Where Auto would run Ulysses, Ring and AllGather keep their rows.
        for strategy in [Strategy::Ring, Strategy::AllGather] {
            let p = plan(&[4096], &[1], 8, 8, strategy);
            assert!(p.head_split().is_none(), "{strategy:?}");
        }
        // Where Auto keeps the row plan for its bytes (rate 8 on 8 ranks), Ulysses and the
        // hybrid still run.
        for (strategy, u) in [(Strategy::Ulysses, 8), (Strategy::Hybrid { ulysses: 2 }, 2)] {
            let p = plan(&[4096], &[8], 8, 8, strategy);
            assert_eq!(p.head_split().map(|s| s.u), Some(u), "{strategy:?}");
            assert!(runs_heads(&p.problem), "{strategy:?}");
        }
    }

    #[test]
    fn a_head_strategy_with_every_segment_inside_a_rank_exchanges_nothing() {
        for (strategy, world) in [(Strategy::Ulysses, 8), (Strategy::Hybrid { ulysses: 2 }, 8), (Strategy::Ulysses, 2)]
        {
            let p = plan(&[256, 512], &[1, 2], 8, world, strategy);
            assert!(p.head_split().is_none() && !runs_heads(&p.problem), "{strategy:?} p={world}");
            for pass in [Pass::Forward, Pass::Backward] {
                assert!(crate::expected_bytes(&p, DType::F32, pass).iter().all(|&b| b == 0), "{strategy:?}");
            }
        }
        // One segment spanning two ranks is enough for the exchange.
        let p = plan(&[256, 1024], &[1, 2], 8, 8, Strategy::Ulysses);
        assert!(p.head_split().is_some() && runs_heads(&p.problem));
        // A split the heads cannot take still goes the head way, to its typed error.
        let cfg = DilatedConfig::builder().segments(&[256]).dilations(&[1]).build().unwrap();
        let shape = Shape4::new(1, 4096, 4, 64).unwrap();
        assert!(runs_heads(&RingProblem::new(&cfg, shape.into(), Layout::Contiguous, Strategy::Ulysses, 8)));
    }
}
