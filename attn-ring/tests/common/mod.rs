//! Test helpers: the ring as a golden-file backend, and f32 view helpers.
#![allow(dead_code)]

use attn_core::error::TensorName;
use attn_core::{AttnShape, DilatedConfig, Result, TensorView};
use attn_ring::{Layout, Strategy, run_in_process, run_in_process_backward};
use attn_testkit::golden::{DilatedBackend, Forward32, Gradients32};

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

impl DilatedBackend for RingBackend {
    fn name(&self) -> String {
        format!("ring(p={}, {}, {})", self.world, self.layout.as_str(), self.strategy.as_str())
    }

    fn forward(&self, cfg: &DilatedConfig, shape: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Forward32> {
        let [q, k, v] = views(shape, q, k, v)?;
        let r = run_in_process(self.world, cfg, self.layout, self.strategy, q, k, v)?;
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
        let qkv = views(shape, q, k, v)?;
        let go = TensorView::contiguous(TensorName::GradOutput, grad_out, shape.q)?;
        let r = run_in_process_backward(self.world, cfg, self.layout, self.strategy, qkv, go)?;
        Ok(Gradients32 { dq: r.dq, dk: r.dk, dv: r.dv })
    }
}
