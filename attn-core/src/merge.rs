//! The LSE merge of two partial attention results, and a streaming online softmax.

use num_traits::Float;

use crate::error::{AttnError, Result, TensorName};

/// Merging partial results `(o, lse)` over disjoint key sets (SPEC.md).
#[derive(Debug, Clone, Copy, Default)]
pub struct LseMerge;

impl LseMerge {
    /// The merged LSE and the two weights `(lse, w_a, w_b)` such that
    /// `o = w_a * o_a + w_b * o_b`. Two `-inf` inputs give `(-inf, 0, 0)`.
    #[inline]
    pub fn weights<F: Float>(lse_a: F, lse_b: F) -> (F, F, F) {
        let ninf = F::neg_infinity();
        if lse_a == ninf && lse_b == ninf {
            return (ninf, F::zero(), F::zero());
        }
        if lse_b == ninf {
            return (lse_a, F::one(), F::zero());
        }
        if lse_a == ninf {
            return (lse_b, F::zero(), F::one());
        }
        let m = lse_a.max(lse_b);
        let lse = m + ((lse_a - m).exp() + (lse_b - m).exp()).ln();
        (lse, (lse_a - lse).exp(), (lse_b - lse).exp())
    }

    /// Merge `(o_b, lse_b)` into the accumulator `(o_a, lse_a)` in place.
    #[inline]
    pub fn merge_into<F: Float>(o_a: &mut [F], lse_a: &mut F, o_b: &[F], lse_b: F) {
        debug_assert_eq!(o_a.len(), o_b.len());
        let (lse, wa, wb) = Self::weights(*lse_a, lse_b);
        if wb == F::zero() && wa == F::one() {
            *lse_a = lse;
            return;
        }
        for (a, &b) in o_a.iter_mut().zip(o_b) {
            *a = wa * *a + wb * b;
        }
        // A fully masked merge leaves exact zeros (never NaN from 0 * inf).
        if lse == F::neg_infinity() {
            o_a.iter_mut().for_each(|a| *a = F::zero());
        }
        *lse_a = lse;
    }

    /// Merge whole row-major blocks: `o` is `[rows, d]`, `lse` is `[rows]`. Blocks of
    /// unequal size, or an `o` that is not `rows` rows, are a `ShapeMismatch`.
    pub fn merge_rows<F: Float>(o_a: &mut [F], lse_a: &mut [F], o_b: &[F], lse_b: &[F]) -> Result<()> {
        let rows = lse_a.len();
        let mismatch = |tensor, expected: usize, got: usize| AttnError::ShapeMismatch {
            tensor,
            expected: vec![expected],
            got: vec![got],
        };
        if lse_b.len() != rows {
            return Err(mismatch(TensorName::Lse, rows, lse_b.len()));
        }
        if o_b.len() != o_a.len() {
            return Err(mismatch(TensorName::Output, o_a.len(), o_b.len()));
        }
        if rows == 0 {
            return if o_a.is_empty() { Ok(()) } else { Err(mismatch(TensorName::Output, 0, o_a.len())) };
        }
        if !o_a.len().is_multiple_of(rows) {
            return Err(mismatch(TensorName::Output, o_a.len().next_multiple_of(rows), o_a.len()));
        }
        let d = o_a.len() / rows;
        for (i, (la, &lb)) in lse_a.iter_mut().zip(lse_b).enumerate() {
            Self::merge_into(&mut o_a[i * d..(i + 1) * d], la, &o_b[i * d..(i + 1) * d], lb);
        }
        Ok(())
    }
}

/// Streaming softmax-weighted sum over keys: push `(score, value row)` pairs in
/// any order and blocking; `finish` gives the normalised output and the LSE.
#[derive(Debug, Clone)]
pub struct OnlineSoftmax<F> {
    max: F,
    sum: F,
    acc: Vec<F>,
}

impl<F: Float> OnlineSoftmax<F> {
    pub fn new(head_dim: usize) -> Self {
        OnlineSoftmax { max: F::neg_infinity(), sum: F::zero(), acc: vec![F::zero(); head_dim] }
    }

    /// Add one key with its (already scaled) score and value row.
    pub fn push(&mut self, score: F, v: &[F]) {
        if score > self.max {
            let c = (self.max - score).exp();
            self.sum = self.sum * c;
            self.acc.iter_mut().for_each(|a| *a = *a * c);
            self.max = score;
        }
        let p = (score - self.max).exp();
        self.sum = self.sum + p;
        for (a, &x) in self.acc.iter_mut().zip(v) {
            *a = *a + p * x;
        }
    }

    /// Write the normalised output into `out` and return the LSE (`-inf`, zeros if empty).
    pub fn finish(&self, out: &mut [F]) -> F {
        if self.sum == F::zero() {
            out.iter_mut().for_each(|o| *o = F::zero());
            return F::neg_infinity();
        }
        let inv = self.sum.recip();
        for (o, &a) in out.iter_mut().zip(&self.acc) {
            *o = a * inv;
        }
        self.max + self.sum.ln()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_neg_inf_give_zeros_not_nan() {
        let mut o = [f32::NAN, 1.0];
        let mut l = f32::NEG_INFINITY;
        LseMerge::merge_into(&mut o, &mut l, &[2.0, 3.0], f32::NEG_INFINITY);
        // Both sides fully masked: zeros, even from an accumulator holding NaN.
        assert_eq!((o, l), ([0.0, 0.0], f32::NEG_INFINITY));
        let mut o = [0.0f32, 0.0];
        let mut l = f32::NEG_INFINITY;
        LseMerge::merge_into(&mut o, &mut l, &[0.0, 0.0], f32::NEG_INFINITY);
        assert_eq!((o, l), ([0.0, 0.0], f32::NEG_INFINITY));
        let (lse, wa, wb) = LseMerge::weights(f64::NEG_INFINITY, f64::NEG_INFINITY);
        assert_eq!((lse, wa, wb), (f64::NEG_INFINITY, 0.0, 0.0));
    }

    #[test]
    fn merge_with_empty_side_is_identity() {
        let mut o = [1.0f64, 2.0];
        let mut l = 0.5;
        LseMerge::merge_into(&mut o, &mut l, &[9.0, 9.0], f64::NEG_INFINITY);
        assert_eq!((o, l), ([1.0, 2.0], 0.5));
        let mut o = [0.0f64, 0.0];
        let mut l = f64::NEG_INFINITY;
        LseMerge::merge_into(&mut o, &mut l, &[3.0, 4.0], 1.5);
        assert_eq!((o, l), ([3.0, 4.0], 1.5));
    }

    #[test]
    fn merge_rows_merges_each_row_and_refuses_unequal_blocks() {
        let (mut o, mut l) = ([1.0f64, 2.0, 5.0, 6.0], [0.0, f64::NEG_INFINITY]);
        LseMerge::merge_rows(&mut o, &mut l, &[3.0, 4.0, 7.0, 8.0], &[0.0, 1.0]).unwrap();
        // Row 0: equal weights; row 1: the accumulator was empty.
        assert_eq!((o, l), ([2.0, 3.0, 7.0, 8.0], [2f64.ln(), 1.0]));
        let mut o = [0.0f32; 4];
        let mut l = [0.0f32; 2];
        let bad = |r: Result<()>| matches!(r, Err(AttnError::ShapeMismatch { .. }));
        // Each of these must not index out of bounds or silently merge a prefix.
        assert!(bad(LseMerge::merge_rows(&mut o, &mut l, &[0.0; 3], &[0.0; 2])));
        assert!(bad(LseMerge::merge_rows(&mut o, &mut l, &[0.0; 4], &[0.0; 1])));
        assert!(bad(LseMerge::merge_rows(&mut o[..3], &mut l, &[0.0; 3], &[0.0; 2])));
        assert!(bad(LseMerge::merge_rows(&mut o, &mut [], &[0.0; 4], &[])));
        assert!(LseMerge::merge_rows::<f32>(&mut [], &mut [], &[], &[]).is_ok());
    }

    #[test]
    fn online_softmax_empty_is_zero_and_neg_inf() {
        let s = OnlineSoftmax::<f64>::new(2);
        let mut out = [7.0; 2];
        assert_eq!(s.finish(&mut out), f64::NEG_INFINITY);
        assert_eq!(out, [0.0, 0.0]);
    }
}
