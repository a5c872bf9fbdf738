//! The multihead case: `attn_multihead::MultiheadDilatedAttention<f32>` (fused QKV
//! projection, dilated attention on `CpuBackend`, LayerNorm, output projection).
//!
//! Forward+backward (`--backward`) times what `torch/torch_multihead.py` times with
//! `m(x).backward(go)`: the forward keeping activations, the backward to the input
//! and every weight, accumulated into gradient buffers allocated once before the
//! timed runs (as `.grad` is after torch's warm-up call), never re-initialised per run.
//!
//! `--impl cpu` times `forward`, which allocates its output and intermediates on every
//! call as torch does; `--impl cpu-workspace` times `forward_into` on one
//! `MultiheadWorkspace` and output buffer kept across runs (repeated inference).

use std::sync::Arc;

use attn_core::{AttnError, DType, Result};
use attn_kernels::CpuBackend;
use attn_multihead::{Call, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, MultiheadWorkspace};

use crate::case::{CaseSpec, Implementation};
use crate::inputs::normal_vec;
use crate::runner::{RunStats, Runner};

struct MultiheadRunner {
    layer: MultiheadDilatedAttention<f32>,
    x: Vec<f32>,
    grad_out: Vec<f32>,
    /// Weight gradients (`Some` for forward+backward), accumulated over runs like torch's `.grad`.
    grads: Option<MultiheadWeights<f32>>,
    /// `--impl cpu-workspace`: the workspace and output buffer kept across forward runs.
    reuse: Option<(MultiheadWorkspace<f32>, Vec<f32>)>,
    batch: usize,
    seq: usize,
}

/// Build the multihead runner (f32 only: the layer's float types are f32 and f64).
pub fn multihead(spec: &CaseSpec) -> Result<Box<dyn Runner>> {
    Ok(Box::new(MultiheadRunner::build(spec)?))
}

impl MultiheadRunner {
    fn build(spec: &CaseSpec) -> Result<Self> {
        if spec.dtype != DType::F32 {
            return Err(AttnError::BackendUnavailable {
                backend: "multihead",
                reason: format!("the multihead layer runs f32 or f64, not {}", spec.dtype.as_str()),
            });
        }
        let e = spec.heads * spec.head_dim;
        // The spec's attention, a sliding window included.
        let cfg = MultiheadConfig::new(e, spec.heads, spec.config()?);
        let backend = Arc::new(CpuBackend::new(spec.threads)?);
        let layer = MultiheadDilatedAttention::<f32>::new(cfg, 7, backend)?;
        let n = spec.batch.checked_mul(spec.seq_len).and_then(|r| r.checked_mul(e)).ok_or_else(|| {
            AttnError::InvalidArgument(format!("batch {} x seq {} x embed {e} overflows", spec.batch, spec.seq_len))
        })?;
        let grads = spec.backward.then(|| layer.zero_grads());
        let reuse = match (spec.implementation, spec.backward) {
            (Implementation::CpuWorkspace, true) => {
                return Err(AttnError::InvalidArgument(
                    "--impl cpu-workspace times the inference forward (forward_into); drop --backward".into(),
                ));
            }
            (Implementation::CpuWorkspace, false) => Some((MultiheadWorkspace::new(), vec![0.0; n])),
            _ => None,
        };
        Ok(MultiheadRunner {
            layer,
            x: normal_vec(11, n),
            grad_out: if spec.backward { normal_vec(12, n) } else { Vec::new() },
            grads,
            reuse,
            batch: spec.batch,
            seq: spec.seq_len,
        })
    }
}

impl Runner for MultiheadRunner {
    fn run(&mut self) -> Result<RunStats> {
        if let Some(grads) = self.grads.as_mut() {
            let (y, cache) = self.layer.forward_train(&self.x, &Call::new(self.batch, self.seq))?;
            let gx = self.layer.backward(&cache, &self.grad_out, grads)?;
            std::hint::black_box((y, gx));
        } else if let Some((ws, y)) = self.reuse.as_mut() {
            self.layer.forward_into(&self.x, &Call::new(self.batch, self.seq), ws, y)?;
            std::hint::black_box(y);
        } else {
            let y = self.layer.forward(&self.x, &Call::new(self.batch, self.seq))?;
            std::hint::black_box(y);
        }
        Ok(RunStats::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_multihead::NamedParams;

    /// Forward+backward accumulates into one set of gradient buffers made before the
    /// timed runs: two runs hold twice one run's gradients (nothing re-initialised).
    #[test]
    fn backward_runs_accumulate_into_buffers_made_once() {
        let mut spec = CaseSpec::dilated(Implementation::Cpu, 48, &[16, 32], &[1, 2]);
        (spec.kind, spec.backward, spec.heads, spec.head_dim, spec.threads) =
            (crate::case::CaseKind::Multihead, true, 2, 8, 1);
        let mut r = MultiheadRunner::build(&spec).unwrap();
        r.run().unwrap();
        let once = r.grads.clone().unwrap();
        r.run().unwrap();
        let twice = r.grads.as_ref().unwrap();
        let max_abs = |v: &[f32]| v.iter().fold(0f32, |m, x| m.max(x.abs()));
        let k_weight = max_abs(once.params().into_iter().find(|p| p.name == "k_proj.weight").unwrap().data);
        for (a, b) in once.params().into_iter().zip(twice.params()) {
            assert_eq!(a.name, b.name);
            if a.name == "k_proj.bias" {
                // Exactly zero in exact arithmetic (softmax shift invariance): pure
                // round-off of cancelling terms, which stays round-off small.
                assert!(max_abs(b.data) <= 1e-5 * k_weight, "d k_proj.bias {:e}", max_abs(b.data));
                continue;
            }
            let scale = max_abs(a.data);
            assert!(scale > 0.0, "d {} is zero", a.name);
            for (x, y) in a.data.iter().zip(b.data) {
                assert!((2.0 * x - y).abs() <= 1e-5 * scale, "d {}: {x} then {y}", a.name);
            }
        }
        let fwd = MultiheadRunner::build(&CaseSpec { backward: false, ..spec.clone() }).unwrap();
        assert!(fwd.grads.is_none());
    }

    /// `--impl cpu-workspace` runs `forward_into` on buffers kept across runs and gives
    /// the output `forward` gives; it refuses `--backward`.
    #[test]
    fn the_workspace_runner_reuses_its_buffers_and_matches_forward() {
        let mut spec = CaseSpec::dilated(Implementation::CpuWorkspace, 48, &[16, 32], &[1, 2]);
        (spec.kind, spec.heads, spec.head_dim, spec.threads) = (crate::case::CaseKind::Multihead, 2, 8, 1);
        let mut r = MultiheadRunner::build(&spec).unwrap();
        r.run().unwrap();
        let ptr = r.reuse.as_ref().unwrap().1.as_ptr();
        r.run().unwrap();
        let (ws, y) = r.reuse.as_ref().unwrap();
        assert_eq!(y.as_ptr(), ptr, "output buffer replaced");
        assert!(ws.bytes() > 0);
        assert_eq!(*y, r.layer.forward(&r.x, &Call::new(1, 48)).unwrap());
        assert!(MultiheadRunner::build(&CaseSpec { backward: true, ..spec }).is_err());
    }
}
