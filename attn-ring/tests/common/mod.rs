//! Test helpers: the ring as a golden-file backend (in-process, or over any
//! communicator), the golden sweep over worlds x layouts x strategies, the list of
//! injected faults, f32 views.
#![allow(dead_code)]

use std::ops::RangeInclusive;
use std::time::Duration;

use attn_core::error::TensorName;
use attn_core::{AttnShape, DilatedConfig, Result, TensorView};
use attn_ring::comm::DEFAULT_TIMEOUT;
use attn_ring::{
    Communicator, Fault, Layout, RingProblem, Strategy, ThreadComm, run_problem_backward_on, run_problem_on,
};
use attn_testkit::golden::{DilatedBackend, Forward32, Gradients32, Problem, check_case, golden_dir, load_dir};

/// The ring over `world` in-process ranks, seen as one device.
#[derive(Debug, Clone, Copy)]
pub struct RingBackend {
    pub world: usize,
    pub layout: Layout,
    pub strategy: Strategy,
}

pub fn views<'a>(shape: AttnShape, q: &'a [f32], k: &'a [f32], v: &'a [f32]) -> Result<[TensorView<'a, f32>; 3]> {
    Ok([
        TensorView::contiguous(TensorName::Query, q, shape.q)?,
        TensorView::contiguous(TensorName::Key, k, shape.kv)?,
        TensorView::contiguous(TensorName::Value, v, shape.kv)?,
    ])
}

/// The ring problem of a test problem on `world` ranks.
fn ring_problem(p: &Problem<'_>, world: usize, layout: Layout, strategy: Strategy) -> RingProblem {
    RingProblem::new(p.cfg, p.shape, layout, strategy, world).with_masks(p.masks.into())
}

/// The problem's global views.
fn problem_views<'a>(p: &Problem<'_>, [q, k, v]: [&'a [f32]; 3]) -> Result<[TensorView<'a, f32>; 3]> {
    views(p.shape, q, k, v)
}

impl DilatedBackend for RingBackend {
    fn name(&self) -> String {
        format!("ring(p={}, {}, {})", self.world, self.layout.as_str(), self.strategy.as_str())
    }

    fn forward(&self, p: &Problem<'_>, qkv: [&[f32]; 3]) -> Result<Forward32> {
        let comms = ThreadComm::world_with_timeout(self.world, DEFAULT_TIMEOUT)?;
        let r =
            run_problem_on(comms, &ring_problem(p, self.world, self.layout, self.strategy), problem_views(p, qkv)?)?;
        Ok(Forward32 { out: r.out, lse: r.lse })
    }

    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<Gradients32> {
        let go = TensorView::contiguous(TensorName::GradOutput, grad_out, p.shape.q)?;
        let comms = ThreadComm::world_with_timeout(self.world, DEFAULT_TIMEOUT)?;
        let problem = ring_problem(p, self.world, self.layout, self.strategy);
        let r = run_problem_backward_on(comms, &problem, problem_views(p, qkv)?, go)?;
        Ok(Gradients32 { dq: r.dq, dk: r.dk, dv: r.dv })
    }
}

/// The ring over `world` ranks whose communicators `join(world)` makes (a fresh set per
/// call), seen as one device.
pub struct CommBackend<F> {
    pub label: &'static str,
    pub world: usize,
    pub layout: Layout,
    pub strategy: Strategy,
    pub join: F,
}

impl<C: Communicator + Send, F: Fn(usize) -> Result<Vec<C>>> DilatedBackend for CommBackend<F> {
    fn name(&self) -> String {
        format!("{} ring(p={}, {}, {})", self.label, self.world, self.layout.as_str(), self.strategy.as_str())
    }

    fn forward(&self, p: &Problem<'_>, qkv: [&[f32]; 3]) -> Result<Forward32> {
        let views = problem_views(p, qkv)?;
        let comms = (self.join)(self.world)?;
        let r = run_problem_on(comms, &ring_problem(p, self.world, self.layout, self.strategy), views)?;
        Ok(Forward32 { out: r.out, lse: r.lse })
    }

    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<Gradients32> {
        let go = TensorView::contiguous(TensorName::GradOutput, grad_out, p.shape.q)?;
        let views = problem_views(p, qkv)?;
        let comms = (self.join)(self.world)?;
        let r = run_problem_backward_on(comms, &ring_problem(p, self.world, self.layout, self.strategy), views, go)?;
        Ok(Gradients32 { dq: r.dq, dk: r.dk, dv: r.dv })
    }
}

/// One run of a golden sweep.
pub struct SweepRun {
    pub cfg: DilatedConfig,
    pub shape: AttnShape,
    pub world: usize,
    pub layout: Layout,
    pub strategy: Strategy,
}

/// Every golden file in `conformance/<dir>` (at least 9) through
/// `backend(world, layout, strategy)` for every world in `worlds` and layout the
/// sequence allows, and every strategy, forward and gradients. Panics listing every
/// failed run; returns the runs.
pub fn golden_sweep<B: DilatedBackend>(
    dir: &str,
    worlds: RangeInclusive<usize>,
    backend: impl Fn(usize, Layout, Strategy) -> B,
) -> Vec<SweepRun> {
    let dir = golden_dir().join(dir);
    let cases = load_dir(&dir).expect("golden dir");
    assert!(cases.len() >= 9, "expected the golden files in {}", dir.display());
    let (mut runs, mut failures) = (Vec::new(), Vec::new());
    for (path, case) in cases {
        let case = case.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let (shape, cfg) = (case.attn_shape().unwrap(), case.config().unwrap());
        for world in worlds.clone() {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                if layout.check(shape.q.seq, world).is_err() {
                    continue;
                }
                for strategy in [Strategy::Auto, Strategy::Ring, Strategy::AllGather] {
                    let report = check_case(&case, Some(&backend(world, layout, strategy)), None);
                    if !report.passed() {
                        failures.push(report.to_string());
                    }
                    runs.push(SweepRun { cfg: cfg.clone(), shape, world, layout, strategy });
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} runs failed:\n{}", failures.len(), runs.len(), failures.join("\n"));
    runs
}

/// Every kind of injected fault at frame `nth` of the faulty rank (a delay of `delay`).
pub fn faults_at(nth: u64, delay: Duration) -> [Fault; 7] {
    [
        Fault::Drop { nth },
        Fault::Duplicate { nth },
        Fault::Reorder { nth },
        Fault::Truncate { nth },
        Fault::Corrupt { nth },
        Fault::Kill { nth },
        Fault::Delay { nth, delay },
    ]
}
