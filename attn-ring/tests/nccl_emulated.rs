//! The ring forward and backward over the emulated NCCL transport (blocking grouped
//! rounds, a send completes only when the peer posts its receive): every golden file in
//! `../shared/golden/dilated`, world sizes 2..=5, every strategy and layout, checked
//! with the same tolerances as `golden_ring.rs`. A protocol step that relied on
//! buffered sends would time out here instead of passing.

mod common;

use std::time::Duration;

use attn_core::error::TensorName;
use attn_core::{AttnShape, DilatedConfig, Result, TensorView};
use attn_ring::comm::EmulatedNccl;
use attn_ring::{Layout, Plan, Strategy, problem_for, run_backward_on, run_on};
use attn_testkit::golden::{DilatedBackend, Forward32, Gradients32, check_case, golden_dir, load_dir};
use common::views;

/// Well above any healthy group wait; a deadlock fails the run with `Timeout`.
const TIMEOUT: Duration = Duration::from_secs(20);

/// The ring over `world` ranks joined by the NCCL emulator, seen as one device.
#[derive(Debug, Clone, Copy)]
struct EmulatedNcclBackend {
    world: usize,
    layout: Layout,
    strategy: Strategy,
}

impl DilatedBackend for EmulatedNcclBackend {
    fn name(&self) -> String {
        format!("emulated-nccl ring(p={}, {}, {})", self.world, self.layout.as_str(), self.strategy.as_str())
    }

    fn forward(&self, cfg: &DilatedConfig, shape: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Forward32> {
        let comms = EmulatedNccl::world_with_timeout(self.world, TIMEOUT)?;
        let r = run_on(comms, cfg, self.layout, self.strategy, views(shape, q, k, v)?)?;
        Ok(Forward32 { out: r.out, lse: r.lse })
    }

    fn backward(
        &self,
        cfg: &DilatedConfig,
        shape: AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        grad_out: &[f32],
    ) -> Result<Gradients32> {
        let go = TensorView::contiguous(TensorName::GradOutput, grad_out, shape.q)?;
        let comms = EmulatedNccl::world_with_timeout(self.world, TIMEOUT)?;
        let r = run_backward_on(comms, cfg, self.layout, self.strategy, views(shape, q, k, v)?, go)?;
        Ok(Gradients32 { dq: r.dq, dk: r.dk, dv: r.dv })
    }
}

#[test]
fn ring_over_emulated_nccl_matches_every_golden_file() {
    let dir = golden_dir().join("dilated");
    let cases = load_dir(&dir).expect("golden dir");
    assert!(cases.len() >= 9, "expected the dilated golden files in {}", dir.display());
    let (mut runs, mut ring_runs, mut multi_step) = (0, 0, 0);
    let mut failures = Vec::new();
    for (path, case) in cases {
        let case = case.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let shape = case.attn_shape().unwrap().q;
        let cfg = case.config().unwrap();
        for world in 2..=5 {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                if layout.check(shape.seq, world).is_err() {
                    continue;
                }
                for strategy in [Strategy::Auto, Strategy::Ring, Strategy::AllGather] {
                    let plan = Plan::new(problem_for(&cfg, shape, layout, strategy, world)).unwrap();
                    ring_runs += usize::from(!plan.ring_heads.is_empty());
                    multi_step += usize::from(plan.ring_steps() >= 2);
                    let backend = EmulatedNcclBackend { world, layout, strategy };
                    let report = check_case(&case, Some(&backend), None);
                    runs += 1;
                    if !report.passed() {
                        failures.push(report.to_string());
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {runs} runs failed:\n{}", failures.len(), failures.join("\n"));
    assert_eq!(runs, 9 * 4 * 2 * 3);
    eprintln!("{runs} runs, {ring_runs} with ring-pass patterns, {multi_step} with two or more ring steps");
    assert!(ring_runs > 0 && multi_step > 0, "the ring-pass strategy never ran ({ring_runs}, {multi_step})");
}
