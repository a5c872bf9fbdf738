//! Ring strategies of `attn-ring` over in-process ranks behind the f32 golden interface.

use attn_core::{AttnError, Result, TensorName, TensorView};
use attn_ring::{Layout, Strategy, run_in_process, run_in_process_backward};
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
}

/// The problem's views, refusing masks (which the in-process runners do not take).
fn views<'a>(p: &Problem<'_>, [q, k, v]: [&'a [f32]; 3]) -> Result<[TensorView<'a, f32>; 3]> {
    if !p.masks.is_none() {
        return Err(AttnError::Unsupported { backend: "ring", feature: "key padding masks and packed sequences" });
    }
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
        let [q, k, v] = views(p, qkv)?;
        let r = run_in_process(self.world, p.cfg, self.layout, self.strategy, q, k, v)?;
        Ok(Forward32 { out: r.out, lse: r.lse })
    }
    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], go: &[f32]) -> Result<Gradients32> {
        let qkv = views(p, qkv)?;
        let go = TensorView::contiguous(TensorName::GradOutput, go, p.shape.q)?;
        let r = run_in_process_backward(self.world, p.cfg, self.layout, self.strategy, qkv, go)?;
        Ok(Gradients32 { dq: r.dq, dk: r.dk, dv: r.dv })
    }
}
