//! Ring strategies of `attn-ring` over in-process ranks behind the f32 golden interface.

use attn_core::{AttnShape, DilatedConfig, Result, TensorName, TensorView};
use attn_ring::{Layout, Strategy, run_in_process, run_in_process_backward};
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

fn views<'a>(s: AttnShape, q: &'a [f32], k: &'a [f32], v: &'a [f32]) -> Result<[TensorView<'a, f32>; 3]> {
    Ok([
        TensorView::contiguous(TensorName::Query, q, s.q)?,
        TensorView::contiguous(TensorName::Key, k, s.kv)?,
        TensorView::contiguous(TensorName::Value, v, s.kv)?,
    ])
}

impl DilatedBackend for RingDilated {
    fn name(&self) -> String {
        format!("ring p={} {:?} {:?}", self.world, self.strategy, self.layout).to_lowercase()
    }
    fn forward(&self, cfg: &DilatedConfig, s: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Forward32> {
        let [q, k, v] = views(s, q, k, v)?;
        let r = run_in_process(self.world, cfg, self.layout, self.strategy, q, k, v)?;
        Ok(Forward32 { out: r.out, lse: r.lse })
    }
    fn backward(
        &self,
        cfg: &DilatedConfig,
        s: AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        go: &[f32],
    ) -> Result<Gradients32> {
        let qkv = views(s, q, k, v)?;
        let go = TensorView::contiguous(TensorName::GradOutput, go, s.q)?;
        let r = run_in_process_backward(self.world, cfg, self.layout, self.strategy, qkv, go)?;
        Ok(Gradients32 { dq: r.dq, dk: r.dk, dv: r.dv })
    }
}
