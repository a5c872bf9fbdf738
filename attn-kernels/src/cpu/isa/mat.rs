//! Operands of the tile primitives, grouped so that each primitive takes a few arguments:
//! a matrix product's inputs ([`MatMul`], and its raw-pointer form for the vector code)
//! and the running state of the lane softmax ([`LaneState`]).

/// The inputs of `C[m x n] (=|+=) A[m x k] * B[k x n]`: `a` with row stride `lda` (or,
/// in the column-major `TN` products, column stride: `A[i, kk]` at `a[kk*lda + i]`), `b`
/// with row stride `ldb`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MatMul<'a> {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub a: &'a [f32],
    pub lda: usize,
    pub b: &'a [f32],
    pub ldb: usize,
}

/// [`MatMul`] as raw pointers (bounds already checked by the safe wrapper).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawMatMul {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub a: *const f32,
    pub lda: usize,
    pub b: *const f32,
    pub ldb: usize,
}

impl MatMul<'_> {
    pub(crate) fn raw(&self) -> RawMatMul {
        let MatMul { m, k, n, a, lda, b, ldb } = *self;
        RawMatMul { m, k, n, a: a.as_ptr(), lda, b: b.as_ptr(), ldb }
    }
}

/// What a matrix product does with C: overwrite it, or add to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Accumulate {
    Overwrite,
    Add,
}

/// The lane softmax's running state for `lanes` queries: maxima `m`, sums `l`, and the
/// `dp` accumulator rows `o` (`o[e * lanes + j]`).
#[derive(Debug)]
pub(crate) struct LaneState<'a> {
    pub m: &'a mut [f32],
    pub l: &'a mut [f32],
    pub o: &'a mut [f32],
    pub dp: usize,
}
