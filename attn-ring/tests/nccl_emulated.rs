//! The ring forward and backward over the emulated NCCL transport (blocking grouped
//! rounds, a send completes only when the peer posts its receive): every golden file in
//! `conformance/dilated` and `conformance/features`, world sizes 2..=5, every strategy
//! and layout, checked with the same tolerances as `golden_ring.rs`. A protocol step
//! that relied on buffered sends would time out here instead of passing.

use crate::common;

use std::time::Duration;

use attn_ring::Plan;
use attn_ring::comm::EmulatedNccl;
use attn_ring::plan::ring_route::Way;
use common::{CommBackend, SweepRun, golden_sweep};

/// Well above any healthy group wait; a deadlock fails the run with `Timeout`.
const TIMEOUT: Duration = Duration::from_secs(20);

fn sweep(dir: &str) -> Vec<Plan> {
    let runs: Vec<SweepRun> = golden_sweep(dir, 2..=5, |world, layout, strategy| CommBackend {
        label: "emulated-nccl",
        world,
        layout,
        strategy,
        join: |p| EmulatedNccl::world_with_timeout(p, TIMEOUT),
    });
    assert_eq!(runs.len(), 9 * 4 * 2 * 3);
    runs.into_iter().map(|r| Plan::new(r.problem).unwrap()).collect()
}

#[test]
fn ring_over_emulated_nccl_matches_every_golden_file() {
    let plans = sweep("dilated");
    let ring_runs = plans.iter().filter(|p| !p.ring_heads.is_empty()).count();
    let multi_step = plans.iter().filter(|p| p.ring_steps() >= 2).count();
    eprintln!("{} runs, {ring_runs} with ring-pass patterns, {multi_step} with two or more ring steps", plans.len());
    assert!(ring_runs > 0 && multi_step > 0, "the ring-pass strategy never ran ({ring_runs}, {multi_step})");
}

/// The features' windows send ring blocks both ways at once: each rank receives from both
/// neighbours in one grouped round.
#[test]
fn ring_features_over_emulated_nccl_match_every_golden_file() {
    let plans = sweep("features");
    let both_ways =
        plans.iter().filter(|p| Way::BOTH.iter().all(|&w| (0..p.problem.world).any(|o| p.hops_of(w, o) > 0))).count();
    eprintln!("{} runs, {both_ways} with ring blocks going both ways", plans.len());
    assert!(both_ways > 0, "no run sent ring blocks both ways");
}
