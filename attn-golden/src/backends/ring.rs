//! Ring strategies of `attn-ring` over in-process ranks behind the f32 golden interface.

use attn_core::{Result, TensorName, TensorView};
use attn_ring::comm::DEFAULT_TIMEOUT;
use attn_ring::{Layout, RingProblem, Strategy, ThreadComm, run_problem_backward_on, run_problem_on};
use attn_testkit::golden::Problem;
use attn_testkit::{DilatedBackend, Forward32, Gradients32};

pub struct RingDilated {
    pub world: usize,
    pub strategy: Strategy,
    pub layout: Layout,
}

impl RingDilated {
    pub fn new(world: usize, strategy: &str, layout: &str) -> Result<Self> {
        Ok(RingDilated { world, strategy: Strategy::parse(strategy)?, layout: Layout::parse(layout)? })
    }

    fn problem(&self, p: &Problem<'_>) -> RingProblem {
        RingProblem::new(p.cfg, p.shape, self.layout, self.strategy, self.world).with_masks(p.masks.into())
    }

    fn comms(&self) -> Result<Vec<ThreadComm>> {
        ThreadComm::world_with_timeout(self.world, DEFAULT_TIMEOUT)
    }
}

/// The problem's views.
fn views<'a>(p: &Problem<'_>, [q, k, v]: [&'a [f32]; 3]) -> Result<[TensorView<'a, f32>; 3]> {
    Ok([
        TensorView::contiguous(TensorName::Query, q, p.shape.q)?,
        TensorView::contiguous(TensorName::Key, k, p.shape.kv)?,
        TensorView::contiguous(TensorName::Value, v, p.shape.kv)?,
    ])
}

impl DilatedBackend for RingDilated {
    fn name(&self) -> String {
        format!("ring p={} {:?} {:?}", self.world, self.strategy, self.layout).to_lowercase()
    }
    fn forward(&self, p: &Problem<'_>, qkv: [&[f32]; 3]) -> Result<Forward32> {
        let r = run_problem_on(self.comms()?, &self.problem(p), views(p, qkv)?)?;
        Ok(Forward32 { out: r.out, lse: r.lse })
    }
    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], go: &[f32]) -> Result<Gradients32> {
        let go = TensorView::contiguous(TensorName::GradOutput, go, p.shape.q)?;
        let r = run_problem_backward_on(self.comms()?, &self.problem(p), views(p, qkv)?, go)?;
        Ok(Gradients32 { dq: r.dq, dk: r.dk, dv: r.dv })
    }
}
