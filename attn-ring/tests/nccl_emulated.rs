//! The ring forward and backward over the emulated NCCL transport (blocking grouped
//! rounds, a send completes only when the peer posts its receive): every golden file in
//! `conformance/dilated`, world sizes 2..=5, every strategy and layout, checked
//! with the same tolerances as `golden_ring.rs`. A protocol step that relied on
//! buffered sends would time out here instead of passing.

mod common;

use std::time::Duration;

use attn_ring::comm::EmulatedNccl;
use attn_ring::{Plan, problem_for};
use common::{CommBackend, golden_sweep};

/// Well above any healthy group wait; a deadlock fails the run with `Timeout`.
const TIMEOUT: Duration = Duration::from_secs(20);

#[test]
fn ring_over_emulated_nccl_matches_every_golden_file() {
    let runs = golden_sweep("dilated", 2..=5, |world, layout, strategy| CommBackend {
        label: "emulated-nccl",
        world,
        layout,
        strategy,
        join: |p| EmulatedNccl::world_with_timeout(p, TIMEOUT),
    });
    assert_eq!(runs.len(), 9 * 4 * 2 * 3);
    let plans: Vec<Plan> = runs
        .iter()
        .map(|r| Plan::new(problem_for(&r.cfg, r.shape.q, r.layout, r.strategy, r.world)).unwrap())
        .collect();
    let ring_runs = plans.iter().filter(|p| !p.ring_heads.is_empty()).count();
    let multi_step = plans.iter().filter(|p| p.ring_steps() >= 2).count();
    eprintln!("{} runs, {ring_runs} with ring-pass patterns, {multi_step} with two or more ring steps", runs.len());
    assert!(ring_runs > 0 && multi_step > 0, "the ring-pass strategy never ran ({ring_runs}, {multi_step})");
}
