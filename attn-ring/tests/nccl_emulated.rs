//! The ring forward and backward over the emulated NCCL transport (blocking grouped
//! rounds, a send completes only when the peer posts its receive): every golden file in
//! `../shared/golden/dilated`, world sizes 2..=5, every strategy and layout, checked
//! with the same tolerances as `golden_ring.rs`. A protocol step that relied on
//! buffered sends would time out here instead of passing.

mod common;

use std::time::Duration;

use attn_core::error::TensorName;
use attn_core::{AttnShape, DilatedConfig, Element, Result, TensorView};
use attn_ring::comm::EmulatedNccl;
use attn_ring::{Layout, Plan, Strategy, backward_on, forward_on, problem_for};
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

/// Write each rank's contiguous rows back into a global `[batch, seq, row]` buffer.
fn assemble<T: Element>(parts: &[Vec<T>], layout: Layout, batch: usize, seq: usize, row: usize) -> Vec<T> {
    let mut global = vec![T::default(); batch * seq * row];
    for (rank, local) in parts.iter().enumerate() {
        let pos = layout.positions(seq, parts.len(), rank);
        for b in 0..batch {
            for (i, &p) in pos.iter().enumerate() {
                let src = &local[(b * pos.len() + i) * row..(b * pos.len() + i + 1) * row];
                global[(b * seq + p) * row..(b * seq + p + 1) * row].copy_from_slice(src);
            }
        }
    }
    global
}

impl DilatedBackend for EmulatedNcclBackend {
    fn name(&self) -> String {
        format!("emulated-nccl ring(p={}, {}, {})", self.world, self.layout.as_str(), self.strategy.as_str())
    }

    fn forward(&self, cfg: &DilatedConfig, shape: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Forward32> {
        let [q, k, v] = views(shape, q, k, v)?;
        let s = q.shape();
        let problem = problem_for(cfg, s, self.layout, self.strategy, self.world);
        let comms = EmulatedNccl::world_with_timeout(self.world, TIMEOUT)?;
        let ranks = forward_on(comms, &problem, q, k, v).into_iter().collect::<Result<Vec<_>>>()?;
        let outs: Vec<Vec<f32>> = ranks.iter().map(|r| r.0.clone()).collect();
        let lses: Vec<Vec<f32>> = ranks.iter().map(|r| r.1.clone()).collect();
        Ok(Forward32 {
            out: assemble(&outs, self.layout, s.batch, s.seq, s.heads * s.head_dim),
            lse: assemble(&lses, self.layout, s.batch, s.seq, s.heads),
        })
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
        let qkv = views(shape, q, k, v)?;
        let go = TensorView::contiguous(TensorName::GradOutput, grad_out, shape.q)?;
        let s = shape.q;
        let problem = problem_for(cfg, s, self.layout, self.strategy, self.world);
        let comms = EmulatedNccl::world_with_timeout(self.world, TIMEOUT)?;
        let ranks = backward_on(comms, &problem, qkv, go).into_iter().collect::<Result<Vec<_>>>()?;
        let grad = |i: usize| {
            let parts: Vec<Vec<f32>> = ranks.iter().map(|r| r.0[i].clone()).collect();
            assemble(&parts, self.layout, s.batch, s.seq, s.heads * s.head_dim)
        };
        Ok(Gradients32 { dq: grad(0), dk: grad(1), dv: grad(2) })
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
