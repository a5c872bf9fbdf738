//! The multihead case: `attn_multihead::MultiheadDilatedAttention<f32>` (fused QKV
//! projection, dilated attention on `CpuBackend`, LayerNorm, output projection).

use std::sync::Arc;

use attn_core::{AttnError, Mixing, Result};
use attn_kernels::CpuBackend;
use attn_multihead::{Mode, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights};

use crate::backends::{RunStats, Runner};
use crate::case::CaseSpec;
use crate::inputs::normal_vec;

struct MultiheadRunner {
    layer: MultiheadDilatedAttention<f32>,
    x: Vec<f32>,
    grad_out: Vec<f32>,
    batch: usize,
    seq: usize,
    backward: bool,
}

/// Build the multihead runner (f32 only: the layer's float types are f32 and f64).
pub fn multihead(spec: &CaseSpec) -> Result<Box<dyn Runner>> {
    if spec.dtype != "f32" {
        return Err(AttnError::BackendUnavailable {
            backend: "multihead",
            reason: format!("the multihead layer runs f32 or f64, not {}", spec.dtype),
        });
    }
    let e = spec.heads * spec.head_dim;
    let cfg = MultiheadConfig::new(e, spec.heads, &spec.segments, &spec.dilations)
        .with_mixing(Mixing::parse(&spec.mixing)?)
        .with_causal(spec.causal);
    let backend = Arc::new(CpuBackend::new(spec.threads)?);
    let layer = MultiheadDilatedAttention::<f32>::new(cfg, 7, backend)?;
    let n = spec.batch * spec.seq_len * e;
    Ok(Box::new(MultiheadRunner {
        layer,
        x: normal_vec(11, n),
        grad_out: if spec.backward { normal_vec(12, n) } else { Vec::new() },
        batch: spec.batch,
        seq: spec.seq_len,
        backward: spec.backward,
    }))
}

impl Runner for MultiheadRunner {
    fn run(&mut self) -> Result<RunStats> {
        if self.backward {
            let (y, cache) = self.layer.forward_train(&self.x, self.batch, self.seq, Mode::Eval)?;
            let mut grads = MultiheadWeights::<f32>::magneto(self.layer.config(), 0).zeros_like();
            let gx = self.layer.backward(&cache, &self.grad_out, &mut grads)?;
            std::hint::black_box((y, gx, grads));
        } else {
            let y = self.layer.forward(&self.x, self.batch, self.seq, Mode::Eval)?;
            std::hint::black_box(y);
        }
        Ok(RunStats::default())
    }
}
