//! Bounds-checked strided matrix products on top of the `gemm` crate (the crate's only
//! `unsafe`). f32 and f64 multiply in place; bf16 and f16 operands are widened to f32,
//! multiplied (and accumulated) there, and each result rounded once.

use attn_core::{AttnError, Result};

use crate::float::{Accumulator, LayerFloat};

/// A read-only strided matrix over a slice: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mat<'a, F> {
    pub data: &'a [F],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, F> Mat<'a, F> {
    /// A row-major `rows x cols` matrix whose rows are `rs` elements apart.
    pub fn rows(data: &'a [F], rows: usize, cols: usize, rs: usize) -> Self {
        Mat { data, rows, cols, rs, cs: 1 }
    }
    /// The transpose of a row-major `rows x cols` matrix with row stride `rs`.
    pub fn transposed(data: &'a [F], rows: usize, cols: usize, rs: usize) -> Self {
        Mat { data, rows: cols, cols: rows, rs: 1, cs: rs }
    }
    /// The same layout over other data (already checked to cover it, or to be checked).
    fn with_data<'b, G>(&self, data: &'b [G]) -> Mat<'b, G> {
        Mat { data, rows: self.rows, cols: self.cols, rs: self.rs, cs: self.cs }
    }
    fn check(&self, what: &str) -> Result<()> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let last = (self.rows - 1)
            .checked_mul(self.rs)
            .and_then(|a| (self.cols - 1).checked_mul(self.cs).and_then(|b| a.checked_add(b)))
            .ok_or_else(|| AttnError::InvalidArgument(format!("{what}: matrix extent overflows")))?;
        if last >= self.data.len() {
            return Err(AttnError::BufferTooSmall {
                tensor: attn_core::error::TensorName::Other("matmul operand"),
                len: self.data.len(),
                needed: last + 1,
            });
        }
        Ok(())
    }
}

/// Work size above which the product runs on the rayon pool.
const PARALLEL_WORK: usize = 1 << 18;

/// `dst = lhs * rhs` (or `dst += lhs * rhs` when `accumulate`), where `dst` is row-major
/// `lhs.rows x rhs.cols` with row stride `dst_rs` (columns contiguous).
pub(crate) fn matmul<F: LayerFloat>(
    dst: &mut [F],
    dst_rs: usize,
    accumulate: bool,
    lhs: Mat<'_, F>,
    rhs: Mat<'_, F>,
) -> Result<()> {
    if lhs.cols != rhs.rows {
        return Err(AttnError::InvalidArgument(format!(
            "matmul: inner dimensions {} and {} differ",
            lhs.cols, rhs.rows
        )));
    }
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    if m == 0 || n == 0 {
        return Ok(());
    }
    if dst_rs < n && m > 1 {
        return Err(AttnError::InvalidArgument(format!("matmul: destination rows overlap (stride {dst_rs} < {n})")));
    }
    Mat::rows(&*dst, m, n, dst_rs).check("dst")?;
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                dst[i * dst_rs..i * dst_rs + n].fill(F::zero());
            }
        }
        return Ok(());
    }
    lhs.check("lhs")?;
    rhs.check("rhs")?;
    if let (Some(l), Some(r)) = (F::as_acc(lhs.data), F::as_acc(rhs.data))
        && let Some(d) = F::as_acc_mut(dst)
    {
        gemm_checked(d, dst_rs, accumulate, lhs.with_data(l), rhs.with_data(r));
        return Ok(());
    }
    widened(dst, dst_rs, accumulate, lhs, rhs)
}

/// [`matmul`] for a type narrower than its accumulator: contiguous widened copies of
/// the operands (and of `dst` when accumulating) are multiplied in the accumulator,
/// and each result is rounded once into `dst`. The extents were checked by the caller.
fn widened<F: LayerFloat>(
    dst: &mut [F],
    dst_rs: usize,
    accumulate: bool,
    lhs: Mat<'_, F>,
    rhs: Mat<'_, F>,
) -> Result<()> {
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    let wide = |a: &Mat<'_, F>| -> Result<Vec<F::Acc>> {
        let mut out = attn_kernels::zeroed_buffer(a.rows * a.cols)?;
        for (i, row) in out.chunks_exact_mut(a.cols).enumerate() {
            for (j, o) in row.iter_mut().enumerate() {
                *o = a.data[i * a.rs + j * a.cs].widen();
            }
        }
        Ok(out)
    };
    let (l, r) = (wide(&lhs)?, wide(&rhs)?);
    let mut d = if accumulate { wide(&Mat::rows(&*dst, m, n, dst_rs))? } else { attn_kernels::zeroed_buffer(m * n)? };
    gemm_checked(&mut d, n, accumulate, Mat::rows(&l, m, k, k), Mat::rows(&r, k, n, n));
    for (i, row) in d.chunks_exact(n).enumerate() {
        for (o, &v) in dst[i * dst_rs..i * dst_rs + n].iter_mut().zip(row) {
            *o = F::narrow(v);
        }
    }
    Ok(())
}

/// `gemm` on operands whose extents [`matmul`] checked (`m, n, k > 0`, `dst_rs >= n`).
fn gemm_checked<A: Accumulator>(dst: &mut [A], dst_rs: usize, accumulate: bool, lhs: Mat<'_, A>, rhs: Mat<'_, A>) {
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    let work = m.saturating_mul(n).saturating_mul(k);
    let parallelism = if work >= PARALLEL_WORK { gemm::Parallelism::Rayon(0) } else { gemm::Parallelism::None };
    // Strides fit in isize: every extent was checked against a slice length.
    let s = |x: usize| x as isize;
    // SAFETY: `A` is f32 or f64 (the only `Accumulator` impls, sealed), which `gemm`
    // supports. Every element `gemm` touches is in bounds: `matmul` checked the largest
    // offset of `dst`, `lhs` and `rhs` against their slice lengths (the widened copies
    // are contiguous and exactly sized), and `m, n, k > 0`. `dst` is borrowed mutably
    // and cannot alias `lhs`/`rhs` (shared borrows), and its rows do not overlap
    // (`dst_rs >= n`, column stride 1).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            s(dst_rs),
            accumulate,
            lhs.data.as_ptr(),
            s(lhs.cs),
            s(lhs.rs),
            rhs.data.as_ptr(),
            s(rhs.cs),
            s(rhs.rs),
            A::one(),
            A::one(),
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &Mat<'_, f64>, b: &Mat<'_, f64>) -> Vec<f64> {
        let mut out = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                out[i * b.cols + j] =
                    (0..a.cols).map(|t| a.data[i * a.rs + t * a.cs] * b.data[t * b.rs + j * b.cs]).sum();
            }
        }
        out
    }

    #[test]
    fn strided_products_match_naive() {
        let a: Vec<f64> = (0..35).map(|x| (x as f64 * 0.37).sin()).collect();
        let b: Vec<f64> = (0..40).map(|x| (x as f64 * 0.11).cos()).collect();
        let cases = [
            (Mat::rows(&a[..], 5, 7, 7), Mat::rows(&b[..], 7, 4, 5)),
            (Mat::transposed(&a[..], 7, 5, 5), Mat::transposed(&b[..], 4, 7, 10)),
        ];
        for (l, r) in cases {
            let want = naive(&l, &r);
            let mut got = vec![1.0; l.rows * 6];
            matmul(&mut got, 6, false, l, r).unwrap();
            for i in 0..l.rows {
                for j in 0..r.cols {
                    assert!((got[i * 6 + j] - want[i * r.cols + j]).abs() < 1e-12);
                }
                assert_eq!(got[i * 6 + 4..i * 6 + 6], [1.0, 1.0], "padding untouched");
            }
            matmul(&mut got, 6, true, l, r).unwrap();
            assert!((got[0] - 2.0 * want[0]).abs() < 1e-12);
        }
    }

    /// bf16 and f16 products (strided, overwritten and accumulated) are the f32 products
    /// of the widened operands, rounded once; the padding between rows stays untouched.
    #[test]
    fn half_products_are_f32_products_rounded_once() {
        fn case<F: LayerFloat<Acc = f32>>() {
            let a: Vec<F> = (0..35).map(|x| F::of((x as f64 * 0.37).sin())).collect();
            let b: Vec<F> = (0..40).map(|x| F::of((x as f64 * 0.11).cos())).collect();
            let wide = |x: &[F]| x.iter().map(|v| v.widen()).collect::<Vec<f32>>();
            let (aw, bw) = (wide(&a), wide(&b));
            let (l, r) = (Mat::transposed(&a[..], 7, 5, 5), Mat::rows(&b[..], 7, 4, 5));
            let (lw, rw) = (l.with_data(&aw[..]), r.with_data(&bw[..]));
            let start: Vec<F> = (0..30).map(|x| F::of(x as f64 * 0.25 - 3.0)).collect();
            for accumulate in [false, true] {
                let mut want = wide(&start);
                matmul(&mut want, 6, accumulate, lw, rw).unwrap();
                let mut got = start.clone();
                matmul(&mut got, 6, accumulate, l, r).unwrap();
                for i in 0..5 {
                    for j in 0..6 {
                        let w = if j < 4 { F::narrow(want[i * 6 + j]) } else { start[i * 6 + j] };
                        assert_eq!(got[i * 6 + j], w, "{:?} ({i}, {j}), accumulate {accumulate}", F::DTYPE);
                    }
                }
            }
        }
        case::<half::bf16>();
        case::<half::f16>();
    }

    #[test]
    fn bad_operands_are_errors() {
        let a = [0.0f32; 6];
        let mut d = vec![0.0f32; 4];
        assert!(matmul(&mut d, 2, false, Mat::rows(&a[..], 2, 3, 3), Mat::rows(&a[..], 2, 3, 3)).is_err());
        assert!(matmul(&mut d, 2, false, Mat::rows(&a[..], 2, 3, 4), Mat::rows(&a[..], 3, 2, 2)).is_err());
        assert!(matmul(&mut d, 1, false, Mat::rows(&a[..], 2, 3, 3), Mat::rows(&a[..], 3, 2, 2)).is_err());
    }
}
