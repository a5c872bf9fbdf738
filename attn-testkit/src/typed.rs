//! [`Typed`]: any [`Attention`] backend behind the f32 test interface
//! ([`DilatedBackend`]), computing in the element type `T`: inputs are rounded to `T`,
//! results converted back. One adapter for the reference, the CPU and CUDA kernels and a
//! ring rank alike.

use std::marker::PhantomData;

use attn_core::error::TensorName;
use attn_core::{
    Attention, AttnInputs, AttnShape, DType, DilatedConfig, Element, Grads, ReferenceBackend, Result, Saved,
};
use attn_core::{TensorView, TensorViewMut};

use crate::golden::{DilatedBackend, Forward32, Gradients32, Problem};

/// Backend `A` computing in `T`.
#[derive(Debug)]
pub struct Typed<A, T> {
    pub backend: A,
    label: Option<String>,
    _t: PhantomData<fn() -> T>,
}

impl<A, T> Typed<A, T> {
    pub fn new(backend: A) -> Self {
        Typed { backend, label: None, _t: PhantomData }
    }

    /// Report as `label` instead of the backend's name and the dtype.
    pub fn labeled(mut self, label: String) -> Self {
        self.label = Some(label);
        self
    }
}

/// The float64 reference behind the f32 test interface.
pub fn reference() -> Typed<ReferenceBackend, f64> {
    Typed::new(ReferenceBackend)
}

fn to_t<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

fn to_f32<T: Element>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

impl<A: Attention<T>, T: Element> Typed<A, T> {
    /// Forward in `T` on contiguous buffers: `(out, lse)`.
    pub fn forward_t(&self, cfg: &DilatedConfig, shape: AttnShape, qkv: [&[T]; 3]) -> Result<(Vec<T>, Vec<f32>)> {
        self.forward_problem(&Problem::new(cfg, shape), qkv)
    }

    /// [`Typed::forward_t`] for a problem with masks.
    pub fn forward_problem(&self, problem: &Problem<'_>, qkv: [&[T]; 3]) -> Result<(Vec<T>, Vec<f32>)> {
        let shape = problem.shape;
        let inputs = AttnInputs::contiguous(problem.cfg, shape, qkv)?.with_masks(problem.masks);
        let mut out = vec![T::default(); shape.q.numel()];
        let mut lse = vec![0.0f32; shape.q.lse_len()];
        self.backend.forward(&inputs, TensorViewMut::contiguous(TensorName::Output, &mut out, shape.q)?, &mut lse)?;
        Ok((out, lse))
    }

    /// Forward then backward in `T` on contiguous buffers: `[dq, dk, dv]`.
    pub fn backward_t(
        &self,
        cfg: &DilatedConfig,
        shape: AttnShape,
        qkv: [&[T]; 3],
        grad_out: &[T],
    ) -> Result<[Vec<T>; 3]> {
        self.backward_problem(&Problem::new(cfg, shape), qkv, grad_out)
    }

    /// [`Typed::backward_t`] for a problem with masks.
    pub fn backward_problem(&self, problem: &Problem<'_>, qkv: [&[T]; 3], grad_out: &[T]) -> Result<[Vec<T>; 3]> {
        self.backward_problem_lse(problem, qkv, grad_out, None)
    }

    /// [`Typed::backward_problem`] with a gradient into the LSE.
    pub fn backward_problem_lse(
        &self,
        problem: &Problem<'_>,
        qkv: [&[T]; 3],
        grad_out: &[T],
        grad_lse: Option<&[f32]>,
    ) -> Result<[Vec<T>; 3]> {
        let shape = problem.shape;
        let (out, lse) = self.forward_problem(problem, qkv)?;
        let inputs = AttnInputs::contiguous(problem.cfg, shape, qkv)?.with_masks(problem.masks);
        let saved = Saved { out: TensorView::contiguous(TensorName::Output, &out, shape.q)?, lse: &lse };
        let gv = TensorView::contiguous(TensorName::GradOutput, grad_out, shape.q)?;
        let mut dq = vec![T::default(); shape.q.numel()];
        let (mut dk, mut dv) = (vec![T::default(); shape.kv.numel()], vec![T::default(); shape.kv.numel()]);
        let grads = Grads::contiguous(shape, [&mut dq, &mut dk, &mut dv])?;
        self.backend.backward_with_lse_grad(&inputs, saved, gv, grad_lse, grads)?;
        Ok([dq, dk, dv])
    }
}

impl<A: Attention<T>, T: Element> DilatedBackend for Typed<A, T> {
    fn name(&self) -> String {
        self.label.clone().unwrap_or_else(|| format!("{} {}", self.backend.name(), T::DTYPE.as_str()))
    }
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn forward(&self, problem: &Problem<'_>, qkv: [&[f32]; 3]) -> Result<Forward32> {
        let [q, k, v] = qkv.map(to_t::<T>);
        let (out, lse) = self.forward_problem(problem, [&q, &k, &v])?;
        Ok(Forward32 { out: to_f32(&out), lse })
    }
    fn backward(&self, problem: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<Gradients32> {
        let [q, k, v] = qkv.map(to_t::<T>);
        let go = to_t::<T>(grad_out);
        let [dq, dk, dv] = self.backward_problem(problem, [&q, &k, &v], &go)?;
        Ok(Gradients32 { dq: to_f32(&dq), dk: to_f32(&dk), dv: to_f32(&dv) })
    }
    fn backward_lse(
        &self,
        problem: &Problem<'_>,
        qkv: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: &[f32],
    ) -> Result<Gradients32> {
        let [q, k, v] = qkv.map(to_t::<T>);
        let go = to_t::<T>(grad_out);
        let [dq, dk, dv] = self.backward_problem_lse(problem, [&q, &k, &v], &go, Some(grad_lse))?;
        Ok(Gradients32 { dq: to_f32(&dq), dk: to_f32(&dk), dv: to_f32(&dv) })
    }
}
