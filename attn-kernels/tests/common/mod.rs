//! Shared test helpers: the CPU backend behind the testkit's `DilatedBackend` trait for
//! any dtype, and f32/f64 conversions.
#![allow(dead_code)]

use attn_core::reference::dilated_backward_with_magnitudes;
use attn_core::{AttnShape, DType, DilatedConfig, Element, Result};
use attn_kernels::{CpuBackend, Isa};
use attn_testkit::golden::{Forward32, Gradients32};
use attn_testkit::{DilatedBackend, Tolerance, mixed_error, rel_l2_error};

pub fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

pub fn conv<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

pub fn back<T: Element>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// The CPU backend computing in dtype `T` (inputs rounded to `T`, results back to f32).
pub struct Cpu<T> {
    pub backend: CpuBackend,
    _t: std::marker::PhantomData<T>,
}

impl<T: Element> Cpu<T> {
    pub fn new(threads: usize, isa: Isa) -> Self {
        Cpu { backend: CpuBackend::new(threads).unwrap().with_isa(isa).unwrap(), _t: std::marker::PhantomData }
    }
}

impl<T: Element> DilatedBackend for Cpu<T> {
    fn name(&self) -> String {
        format!("cpu-{}-{}", T::DTYPE.as_str(), self.backend.isa().as_str())
    }
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn forward(&self, cfg: &DilatedConfig, shape: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Forward32> {
        let (out, lse) = self.backend.forward_cross_vec::<T>(cfg, shape, &conv(q), &conv(k), &conv(v))?;
        Ok(Forward32 { out: back(&out), lse })
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
        let (q, k, v, go) = (conv::<T>(q), conv::<T>(k), conv::<T>(v), conv::<T>(grad_out));
        let (out, lse) = self.backend.forward_cross_vec::<T>(cfg, shape, &q, &k, &v)?;
        let (dq, dk, dv) = self.backend.backward_cross_vec::<T>(cfg, shape, &q, &k, &v, &out, &lse, &go)?;
        Ok(Gradients32 { dq: back(&dq), dk: back(&dk), dv: back(&dv) })
    }
}

/// LSE check: the same `-inf` positions, finite values within `tol` (absolute, on values
/// of order 1-10).
pub fn check_lse(got: &[f32], want: &[f64], tol: f64) -> std::result::Result<(), String> {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_infinite() { *g == f32::NEG_INFINITY } else { (*g as f64 - w).abs() <= tol * (1.0 + w.abs()) };
        if !ok {
            return Err(format!("lse[{i}] = {g}, want {w}"));
        }
    }
    Ok(())
}

/// `||got - want||` as a fraction of `tol * max(||want||, ||dv_want||) + u * ||magnitude||`
/// (pass: <= 1; `u` the unit roundoff of `dtype`). The first term is the relative
/// bound, except that a dq or dk that is zero up to rounding (every query sees copies of
/// one key, so dS = 0 exactly) is judged against the scale of the other gradients of the
/// same problem (dv = P^T grad_out); the second is the rounding of each product term
/// (ds, the stored output inside `delta`), which does not shrink when the terms cancel
/// (see `attn_testkit::mixed_error`).
pub fn grad_error(got: &[f32], want: &[f64], dv_want: &[f64], magnitude: &[f64], tol: f64, dtype: DType) -> f64 {
    let norm = |x: &[f64]| x.iter().map(|w| w * w).sum::<f64>().sqrt();
    if got.len() != want.len() || !got.iter().all(|g| g.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = got.iter().zip(want).map(|(g, w)| (*g as f64 - w).powi(2)).sum::<f64>().sqrt();
    let bound = tol * norm(want).max(norm(dv_want)) + Tolerance::unit_roundoff(dtype) * norm(magnitude);
    if num == 0.0 {
        0.0
    } else if bound > 0.0 {
        num / bound
    } else {
        f64::INFINITY
    }
}

/// A backend's forward (`out`, `lse`) and backward (`grads`: dq, dk, dv) in dtype `T`
/// for the inputs `[q, k, v, grad_out]` (already in `T`), against the float64
/// reference run on those same rounded inputs, so only the kernel's error is measured:
/// the output by `mixed_error`, the LSE by [`check_lse`], each gradient by
/// [`grad_error`] (twice the f32 bound: one more rounding, the stored output).
pub fn judge<T: Element>(
    cfg: &DilatedConfig,
    shape: AttnShape,
    inputs: [&[T]; 4],
    out: &[T],
    lse: &[f32],
    grads: [&[T]; 3],
) -> std::result::Result<(), String> {
    let [q, k, v, go] = inputs.map(|x| to64(&back(x)));
    let (fwd, want, mag) = dilated_backward_with_magnitudes(cfg, shape, &q, &k, &v, &go).map_err(|e| e.to_string())?;
    let tol = Tolerance::for_dtype(T::DTYPE);
    let err = mixed_error(out, &fwd.out, &mag.out, tol, T::DTYPE);
    if err > 1.0 {
        let rel = rel_l2_error(out, &fwd.out);
        return Err(format!("out error {err:.3} of the bound (rel err {rel:.3e}, tol {:.0e})", tol.rel_l2));
    }
    check_lse(lse, &fwd.lse, if T::DTYPE == DType::F32 { 1e-5 } else { tol.rel_l2 })?;
    let bound = if T::DTYPE == DType::F32 { 2.0 * tol.rel_l2 } else { tol.rel_l2 };
    let [dq, dk, dv] = grads;
    for (name, got, w, m) in
        [("dq", dq, &want.dq, &mag.dq), ("dk", dk, &want.dk, &mag.dk), ("dv", dv, &want.dv, &mag.dv)]
    {
        let err = grad_error(&back(got), w, &want.dv, m, bound, T::DTYPE);
        if err > 1.0 {
            return Err(format!("{name} error {err:.3} of the bound (tol {bound:.0e})"));
        }
    }
    Ok(())
}
