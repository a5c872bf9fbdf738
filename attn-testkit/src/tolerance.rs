//! Error measures and per-dtype tolerances used by every test and the golden runner.

use attn_core::{DType, Element};

/// `||got - want|| / ||want||` in float64 (absolute norm if `want` is all zero).
/// Equal infinities (an empty row's LSE of `-inf`) match exactly and add nothing;
/// any other NaN/Inf, or a length mismatch, gives infinity.
pub fn rel_l2_error<A: Element, B: Element>(got: &[A], want: &[B]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        let (g, w) = (g.to_f64(), w.to_f64());
        if g == w && g.is_infinite() {
            continue;
        }
        if !g.is_finite() || !w.is_finite() {
            return f64::INFINITY;
        }
        num += (g - w) * (g - w);
        den += w * w;
    }
    if den == 0.0 { num.sqrt() } else { (num / den).sqrt() }
}

/// Largest `|got - want|` (infinity on NaN or a length mismatch).
pub fn max_abs_error<A: Element, B: Element>(got: &[A], want: &[B]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    got.iter().zip(want).fold(0.0f64, |m, (g, w)| {
        let (g, w) = (g.to_f64(), w.to_f64());
        let e = if g == w { 0.0 } else { (g - w).abs() };
        if e.is_nan() { f64::INFINITY } else { m.max(e) }
    })
}

/// Relative L2 tolerance for results computed from inputs of one dtype.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    pub rel_l2: f64,
}

impl Tolerance {
    /// A whole-tensor bound for a result computed in `dtype` against a float64 result
    /// from the unrounded inputs: f32 matches the golden files' `rel_tol` of 1e-5; f16
    /// and bf16 get about ten unit roundoffs (q, k, v and the output are each rounded).
    /// Attention results in any dtype are judged row by row instead ([`crate::judge`]);
    /// this serves whole-layer comparisons.
    pub fn for_dtype(dtype: DType) -> Self {
        let rel_l2 = match dtype {
            DType::F64 => 1e-10,
            DType::F32 => 1e-5,
            DType::F16 => 5e-3,
            DType::BF16 => 4e-2,
        };
        Tolerance { rel_l2 }
    }

    /// The bound for a golden file with `rel_tol` run in `dtype`: the file's bound,
    /// or the dtype's if that is looser.
    pub fn golden(dtype: DType, rel_tol: f64) -> Self {
        Tolerance { rel_l2: rel_tol.max(Self::for_dtype(dtype).rel_l2) }
    }

    /// The largest relative error of one rounding to `dtype` (round to nearest).
    pub fn unit_roundoff(dtype: DType) -> f64 {
        match dtype {
            DType::F64 => f64::EPSILON / 2.0,
            DType::F32 => f32::EPSILON as f64 / 2.0,
            DType::F16 => 2f64.powi(-11),
            DType::BF16 => 2f64.powi(-8),
        }
    }

    pub fn accepts(&self, err: f64) -> bool {
        err <= self.rel_l2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_measure_what_they_say() {
        assert_eq!(rel_l2_error(&[1.0f32, 0.0], &[1.0f64, 0.0]), 0.0);
        assert!((rel_l2_error(&[1.1f64], &[1.0f64]) - 0.1).abs() < 1e-12);
        assert_eq!(rel_l2_error(&[f32::NAN], &[1.0f32]), f64::INFINITY);
        assert_eq!(rel_l2_error(&[1.0f32], &[1.0f32, 2.0]), f64::INFINITY);
        assert_eq!(rel_l2_error(&[f32::NEG_INFINITY, 1.0], &[f32::NEG_INFINITY, 1.0]), 0.0);
        assert_eq!(rel_l2_error(&[0.0f32, 1.0], &[f32::NEG_INFINITY, 1.0]), f64::INFINITY);
        assert_eq!(rel_l2_error(&[f32::NEG_INFINITY], &[0.0f32]), f64::INFINITY);
        assert!((max_abs_error(&[1.0f32, 3.0], &[1.5f32, 3.0]) - 0.5).abs() < 1e-12);
        assert!(Tolerance::golden(DType::F32, 1e-5).accepts(1e-6));
        assert!(!Tolerance::golden(DType::F32, 1e-5).accepts(1e-4));
    }
}
