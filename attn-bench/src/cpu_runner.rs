//! Runners for `attn_kernels::CpuBackend`: whole-tensor dilated attention (f32, bf16,
//! f16; forward or forward + backward), and the same on a Hilbert-ordered 2D grid
//! (permute in, attend, permute back) through `attn-hilbert`. `--impl cpu` allocates
//! the output (and gradient) buffers on every call, as torch does; `--impl
//! cpu-workspace` keeps them across calls (the caller-buffer API as a server uses it),
//! so its time holds no first-touch page faults of fresh output memory.

use std::sync::Arc;

use attn_core::error::TensorName;
use attn_core::{Attention, AttnError, AttnInputs, DType, DilatedConfig, Element, Grads, Pass, Result, Saved, Shape4};
use attn_core::{TensorView, TensorViewMut};
use attn_hilbert::{Permutation, TokenLayout, TokenOrder};
use attn_kernels::{CpuBackend, zeroed_buffer};
use half::{bf16, f16};

use crate::case::{CaseSpec, Implementation};
use crate::inputs::normal_vec;
use crate::runner::{RunStats, Runner};

/// Build the CPU runner for `spec` in its dtype (`--impl cpu` or `cpu-workspace`).
pub fn dilated(spec: &CaseSpec) -> Result<Box<dyn Runner>> {
    match spec.dtype {
        DType::F32 => Ok(Box::new(CpuRunner::<f32>::new(spec, None)?)),
        DType::BF16 => Ok(Box::new(CpuRunner::<bf16>::new(spec, None)?)),
        DType::F16 => Ok(Box::new(CpuRunner::<f16>::new(spec, None)?)),
        other => {
            Err(AttnError::InvalidArgument(format!("dtype {} is not benchmarked on the cpu backend", other.as_str())))
        }
    }
}

/// The Hilbert case: tokens of a `height x width` grid (`seq = height * width`).
pub fn hilbert(spec: &CaseSpec) -> Result<Box<dyn Runner>> {
    let (h, w) = grid_for(spec.seq_len)?;
    let order = TokenOrder::hilbert_2d(h, w)?;
    let perm = Arc::clone(order.permutation());
    match spec.dtype {
        DType::F32 => Ok(Box::new(CpuRunner::<f32>::new(spec, Some(perm))?)),
        DType::BF16 => Ok(Box::new(CpuRunner::<bf16>::new(spec, Some(perm))?)),
        other => {
            Err(AttnError::InvalidArgument(format!("dtype {} is not benchmarked on the hilbert case", other.as_str())))
        }
    }
}

/// The most square `h x w = n` grid with `h <= w`.
fn grid_for(n: usize) -> Result<(usize, usize)> {
    let mut h = (n as f64).sqrt() as usize;
    while h > 1 && !n.is_multiple_of(h) {
        h -= 1;
    }
    if h == 0 {
        return Err(AttnError::InvalidArgument("hilbert case needs seq_len >= 1".into()));
    }
    Ok((h, n / h))
}

struct CpuRunner<T> {
    /// The attention under test (the CPU kernels), through the shared interface.
    backend: Box<dyn Attention<T>>,
    cfg: DilatedConfig,
    shape: Shape4,
    backward: bool,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    grad_out: Vec<T>,
    /// Hilbert order: inputs are permuted into it on every call, outputs permuted back.
    perm: Option<Arc<Permutation>>,
    /// `--impl cpu-workspace`: the output buffers kept between calls (None before the
    /// first call, and always for `--impl cpu`).
    keep: bool,
    kept: Option<Buffers<T>>,
}

/// A call's output, LSE and (backward) gradient buffers.
struct Buffers<T> {
    out: Vec<T>,
    lse: Vec<f32>,
    grads: [Vec<T>; 3],
}

impl<T: Element> Buffers<T> {
    fn new(s: Shape4, backward: bool) -> Result<Self> {
        let n = s.numel();
        let grad = || if backward { zeroed_buffer(n) } else { Ok(Vec::new()) };
        Ok(Buffers { out: zeroed_buffer(n)?, lse: zeroed_buffer(s.lse_len())?, grads: [grad()?, grad()?, grad()?] })
    }
}

impl<T: Element> CpuRunner<T> {
    fn new(spec: &CaseSpec, perm: Option<Arc<Permutation>>) -> Result<Self> {
        let shape = spec.shape()?;
        let n = shape.numel();
        Ok(CpuRunner {
            backend: Box::new(CpuBackend::new(spec.threads)?),
            cfg: spec.config()?,
            shape,
            backward: spec.backward,
            q: normal_vec(1, n),
            k: normal_vec(2, n),
            v: normal_vec(3, n),
            grad_out: if spec.backward { normal_vec(4, n) } else { Vec::new() },
            perm,
            keep: spec.implementation == Implementation::CpuWorkspace,
            kept: None,
        })
    }

    /// One call into `bufs` (fresh, or kept from the last call).
    fn attend(&self, q: &[T], k: &[T], v: &[T], bufs: &mut Buffers<T>) -> Result<()> {
        let s = self.shape;
        let view = |name, x| TensorView::contiguous(name, x, s);
        let (qv, kv, vv) = (view(TensorName::Query, q)?, view(TensorName::Key, k)?, view(TensorName::Value, v)?);
        let Buffers { out, lse, grads: [dq, dk, dv] } = bufs;
        let inputs = AttnInputs::new(&self.cfg, qv, kv, vv);
        self.backend.forward(&inputs, TensorViewMut::contiguous(TensorName::Output, out, s)?, lse)?;
        if self.backward {
            let grads = Grads {
                dq: TensorViewMut::contiguous(TensorName::GradQuery, dq, s)?,
                dk: TensorViewMut::contiguous(TensorName::GradKey, dk, s)?,
                dv: TensorViewMut::contiguous(TensorName::GradValue, dv, s)?,
            };
            let saved = Saved { out: view(TensorName::Output, out)?, lse };
            self.backend.backward(&inputs, saved, view(TensorName::GradOutput, &self.grad_out)?, grads)?;
        }
        if let Some(p) = &self.perm {
            let mut back = zeroed_buffer(s.numel())?;
            p.unapply(&TokenLayout::bshd(s), out, &mut back)?;
            std::hint::black_box(back);
        }
        std::hint::black_box(&bufs);
        Ok(())
    }
}

impl<T: Element> Runner for CpuRunner<T> {
    fn run(&mut self) -> Result<RunStats> {
        let mut bufs = match self.kept.take() {
            Some(b) => b,
            None => Buffers::new(self.shape, self.backward)?,
        };
        match &self.perm {
            Some(p) => {
                let layout = TokenLayout::bshd(self.shape);
                let permute = |x: &[T]| -> Result<Vec<T>> {
                    let mut y = zeroed_buffer(x.len())?;
                    p.apply(&layout, x, &mut y)?;
                    Ok(y)
                };
                let (q, k, v) = (permute(&self.q)?, permute(&self.k)?, permute(&self.v)?);
                self.attend(&q, &k, &v, &mut bufs)?;
            }
            None => self.attend(&self.q, &self.k, &self.v, &mut bufs)?,
        }
        if self.keep {
            self.kept = Some(bufs);
        }
        Ok(RunStats::default())
    }
}

/// The library's workspace-size query for a single-rank case: inputs, outputs and
/// LSE (and gradients for backward) plus the backend's `Attention::workspace_bytes`.
pub fn workspace_query(spec: &CaseSpec) -> Option<u64> {
    let (cfg, shape, dtype) = (spec.config().ok()?, spec.shape().ok()?, spec.dtype);
    let backend = CpuBackend::new(spec.threads).ok()?;
    let tensors = if spec.backward { 8 } else { 4 };
    let bytes = tensors * shape.numel() * dtype.size() + shape.lse_len() * 4;
    let pass = if spec.backward { Pass::Backward } else { Pass::Forward };
    Some((bytes + backend.workspace_bytes(&cfg, shape, pass)) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--impl cpu-workspace` keeps one set of buffers across calls (the same
    /// allocation, refilled), and its output equals a fresh-buffer call's bit for bit.
    #[test]
    fn the_workspace_runner_reuses_its_buffers() {
        for backward in [false, true] {
            let mut spec = CaseSpec::dilated(Implementation::CpuWorkspace, 96, &[32, 64], &[1, 2]);
            spec.backward = backward;
            let mut kept = CpuRunner::<f32>::new(&spec, None).unwrap();
            kept.run().unwrap();
            let first = kept.kept.as_ref().map(|b| b.out.as_ptr()).expect("buffers kept");
            kept.run().unwrap();
            let again = kept.kept.as_ref().unwrap();
            assert_eq!(again.out.as_ptr(), first, "same allocation");
            spec.implementation = Implementation::Cpu;
            let fresh = CpuRunner::<f32>::new(&spec, None).unwrap();
            let mut bufs = Buffers::new(fresh.shape, backward).unwrap();
            fresh.attend(&fresh.q, &fresh.k, &fresh.v, &mut bufs).unwrap();
            assert!(fresh.kept.is_none() && !fresh.keep);
            assert_eq!(bufs.out, again.out);
            assert_eq!(bufs.lse, again.lse);
            assert_eq!(bufs.grads, again.grads);
            assert_eq!(bufs.grads[0].len(), if backward { bufs.out.len() } else { 0 });
        }
    }

    #[test]
    fn grids_are_as_square_as_possible() {
        assert_eq!(grid_for(16384).unwrap(), (128, 128));
        assert_eq!(grid_for(8192).unwrap(), (64, 128));
        assert_eq!(grid_for(7).unwrap(), (1, 7));
    }
}
