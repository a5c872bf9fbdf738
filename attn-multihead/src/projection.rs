//! Linear projections (`nn.Linear`: `y = x W^T + b`, `W: [out, in]`) and their gradients, as GEMMs.

use attn_core::{AttnError, Result, TensorName};

use crate::float::LayerFloat;
use crate::init::{SeededRng, xavier_normal};
use crate::matmul::{Mat, matmul};
use rayon::prelude::*;

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got < want {
        return Err(AttnError::InvalidArgument(format!("{what}: buffer of {got} elements, {want} needed")));
    }
    Ok(())
}

/// `rows * cols` elements of `what`, checked for overflow (`rows` is the caller's).
fn elems(what: &'static str, rows: usize, cols: usize) -> Result<usize> {
    rows.checked_mul(cols)
        .ok_or_else(|| AttnError::ShapeOverflow { tensor: TensorName::Other(what), dims: vec![rows, cols] })
}

/// Rows per block of a biased product. Each block's product is followed by its bias
/// add while much of the block is still in cache, instead of a bias prefill pass over
/// the whole output and an accumulating product that reads it all back (that form cost
/// 8-10 ms of a 30 ms fused QKV projection at seq 8192, embed 512, in a scratch
/// benchmark). In the layer's forward at seq 8192, blocks of 1024, 2048, 4096 and 8192
/// rows measured 131-133, 127-130, 125-126 and 124-126 ms (3 alternating runs each).
const BIAS_BLOCK_ROWS: usize = 4096;

/// `y = lhs * rhs + 1 b^T` (`b` broadcast over rows; none when `bias` is `None`), where
/// `y` is row-major `lhs.rows x rhs.cols` with row stride `y_rs`.
pub(crate) fn biased_product<F: LayerFloat>(
    y: &mut [F],
    y_rs: usize,
    lhs: Mat<'_, F>,
    rhs: Mat<'_, F>,
    bias: Option<&[F]>,
) -> Result<()> {
    biased_product_in_blocks(y, y_rs, lhs, rhs, bias, BIAS_BLOCK_ROWS)
}

/// [`biased_product`] with blocks of `block_rows` rows (at least 1).
fn biased_product_in_blocks<F: LayerFloat>(
    y: &mut [F],
    y_rs: usize,
    lhs: Mat<'_, F>,
    rhs: Mat<'_, F>,
    bias: Option<&[F]>,
    block_rows: usize,
) -> Result<()> {
    let Some(bias) = bias else {
        return matmul(y, y_rs, false, lhs, rhs);
    };
    let n = rhs.cols;
    check_len("linear bias", bias.len(), n)?;
    let mut r0 = 0;
    while r0 < lhs.rows {
        let rows = block_rows.max(1).min(lhs.rows - r0);
        // A block starting past a buffer's end is an error here (slicing would panic);
        // `matmul` checks the rest of each block's extent.
        let (lo, yo) = (r0 * lhs.rs, r0 * y_rs);
        if lo >= lhs.data.len() || yo >= y.len() {
            return Err(AttnError::InvalidArgument(format!("linear: row {r0} lies past the end of a buffer")));
        }
        let block = Mat { data: &lhs.data[lo..], rows, ..lhs };
        let dst = &mut y[yo..];
        matmul(dst, y_rs, false, block, rhs)?;
        // Within `dst`: `matmul` checked this block's extent.
        let span = (rows - 1) * y_rs + n;
        dst[..span].par_chunks_mut(y_rs.max(1)).for_each(|row| {
            for (o, &b) in row[..n].iter_mut().zip(&bias[..n]) {
                *o += b;
            }
        });
        r0 += rows;
    }
    Ok(())
}

/// A linear map's parameters as the kernels read them: `weight` `[out_dim, in_dim]`
/// (PyTorch layout) and an optional `bias` `[out_dim]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LinearRef<'a, F> {
    pub weight: &'a [F],
    pub bias: Option<&'a [F]>,
    pub in_dim: usize,
    pub out_dim: usize,
}

/// A linear map's gradient accumulators: `dweight` `[out_dim, in_dim]`, optional `dbias`.
#[derive(Debug)]
pub(crate) struct LinearGrad<'a, F> {
    pub dweight: &'a mut [F],
    pub dbias: Option<&'a mut [F]>,
    pub in_dim: usize,
    pub out_dim: usize,
}

/// `y[r, ..out] = x[r] W^T + b` for `rows` rows of `x` (`[rows, in]` contiguous); rows
/// of `y` are `y_rs` apart, so the output can be a slice of a fused buffer.
pub(crate) fn linear_forward<F: LayerFloat>(
    lin: LinearRef<'_, F>,
    x: &[F],
    rows: usize,
    y: &mut [F],
    y_rs: usize,
) -> Result<()> {
    let LinearRef { weight, bias, in_dim, out_dim } = lin;
    check_len("linear input", x.len(), elems("linear input", rows, in_dim)?)?;
    check_len("linear weight", weight.len(), elems("linear weight", out_dim, in_dim)?)?;
    if rows > 0 {
        let span = elems("linear output", rows - 1, y_rs)?.checked_add(out_dim);
        check_len("linear output", y.len(), span.unwrap_or(usize::MAX))?;
    }
    biased_product(y, y_rs, Mat::rows(x, rows, in_dim, in_dim), Mat::transposed(weight, out_dim, in_dim, in_dim), bias)
}

/// `dx (+)= dy W` where `dy` is `[rows, out]` with row stride `dy_rs` (the bias is not
/// read); `accumulate` adds to `dx` instead of overwriting it.
pub(crate) fn linear_backward_input<F: LayerFloat>(
    lin: LinearRef<'_, F>,
    (dy, dy_rs): (&[F], usize),
    rows: usize,
    dx: &mut [F],
    accumulate: bool,
) -> Result<()> {
    let LinearRef { weight, in_dim, out_dim, .. } = lin;
    check_len("linear grad input", dx.len(), elems("linear grad input", rows, in_dim)?)?;
    matmul(dx, in_dim, accumulate, Mat::rows(dy, rows, out_dim, dy_rs), Mat::rows(weight, out_dim, in_dim, in_dim))
}

/// `dW += dy^T x` and `db += sum_rows dy`.
pub(crate) fn linear_backward_params<F: LayerFloat>(
    grad: LinearGrad<'_, F>,
    (dy, dy_rs): (&[F], usize),
    rows: usize,
    x: &[F],
) -> Result<()> {
    let LinearGrad { dweight, dbias, in_dim, out_dim } = grad;
    check_len("linear grad weight", dweight.len(), elems("linear grad weight", out_dim, in_dim)?)?;
    matmul(dweight, in_dim, true, Mat::transposed(dy, rows, out_dim, dy_rs), Mat::rows(x, rows, in_dim, in_dim))?;
    if let Some(db) = dbias {
        // db += dy^T 1, as a matrix-vector product.
        check_len("linear grad bias", db.len(), out_dim)?;
        let ones = vec![F::one(); rows];
        matmul(db, 1, true, Mat::transposed(dy, rows, out_dim, dy_rs), Mat::rows(&ones, rows, 1, 1))?;
    }
    Ok(())
}

/// Whether a linear map has a bias (initialised to zeros) or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bias {
    Zeros,
    Absent,
}

impl From<bool> for Bias {
    /// `true` (the configs' and PyTorch's `bias=True`) is [`Bias::Zeros`].
    fn from(bias: bool) -> Self {
        if bias { Bias::Zeros } else { Bias::Absent }
    }
}

/// An `nn.Linear`: `weight [out, in]`, optional `bias [out]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Linear<F> {
    pub in_dim: usize,
    pub out_dim: usize,
    pub weight: Vec<F>,
    pub bias: Option<Vec<F>>,
}

impl<F: LayerFloat> Linear<F> {
    /// Xavier-normal weight with `gain`, zero bias or none (MAGNETO / library init).
    pub fn xavier(rng: &mut SeededRng, in_dim: usize, out_dim: usize, gain: f64, bias: Bias) -> Self {
        let bias = bias == Bias::Zeros;
        Linear {
            in_dim,
            out_dim,
            weight: xavier_normal(rng, out_dim, in_dim, gain),
            bias: bias.then(|| vec![F::zero(); out_dim]),
        }
    }
    /// All-zero parameters of the same shape (a gradient accumulator).
    pub fn zeros_like(&self) -> Self {
        Linear {
            in_dim: self.in_dim,
            out_dim: self.out_dim,
            weight: vec![F::zero(); self.weight.len()],
            bias: self.bias.as_ref().map(|b| vec![F::zero(); b.len()]),
        }
    }
    /// `y = x W^T + b` for `x: [rows, in]`.
    pub fn forward(&self, x: &[F], rows: usize) -> Result<Vec<F>> {
        // The input first: `rows` sizes the allocation below.
        check_len("linear input", x.len(), elems("linear input", rows, self.in_dim)?)?;
        let mut y = vec![F::zero(); elems("linear output", rows, self.out_dim)?];
        self.forward_into(x, rows, &mut y)?;
        Ok(y)
    }
    /// `y = x W^T + b` into the caller's `y: [rows, out]`.
    pub fn forward_into(&self, x: &[F], rows: usize, y: &mut [F]) -> Result<()> {
        if Some(y.len()) != rows.checked_mul(self.out_dim) {
            return Err(AttnError::InvalidArgument(format!(
                "linear output: buffer of {} elements for {rows} rows of {}",
                y.len(),
                self.out_dim
            )));
        }
        linear_forward(
            LinearRef { weight: &self.weight, bias: self.bias.as_deref(), in_dim: self.in_dim, out_dim: self.out_dim },
            x,
            rows,
            y,
            self.out_dim,
        )
    }
    /// Accumulate parameter gradients into `grads` and return `dx`.
    pub fn backward(&self, x: &[F], rows: usize, dy: &[F], grads: &mut Linear<F>) -> Result<Vec<F>> {
        check_len("linear grad output", dy.len(), elems("linear grad output", rows, self.out_dim)?)?;
        linear_backward_params(
            LinearGrad {
                dweight: &mut grads.weight,
                dbias: grads.bias.as_deref_mut(),
                in_dim: self.in_dim,
                out_dim: self.out_dim,
            },
            (dy, self.out_dim),
            rows,
            x,
        )?;
        let mut dx = vec![F::zero(); elems("linear grad input", rows, self.in_dim)?];
        linear_backward_input(
            LinearRef { weight: &self.weight, bias: None, in_dim: self.in_dim, out_dim: self.out_dim },
            (dy, self.out_dim),
            rows,
            &mut dx,
            false,
        )?;
        Ok(dx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks of 1, 3 and 4 rows over 10 strided rows (a last partial block) give
    /// `lhs * rhs + b` on every row, and leave the padding between rows untouched.
    #[test]
    fn biased_products_in_blocks_match_the_definition() {
        let (rows, k, n, lrs, yrs) = (10, 3, 4, 5, 6);
        let a: Vec<f64> = (0..rows * lrs).map(|x| (x as f64 * 0.37).sin()).collect();
        let w: Vec<f64> = (0..n * k).map(|x| (x as f64 * 0.11).cos()).collect();
        let b: Vec<f64> = (0..n).map(|x| x as f64 - 1.5).collect();
        for block in [1, 3, 4, 64] {
            let mut y = vec![7.0; rows * yrs];
            let (lhs, rhs) = (Mat::rows(&a[..], rows, k, lrs), Mat::transposed(&w[..], n, k, k));
            biased_product_in_blocks(&mut y, yrs, lhs, rhs, Some(&b), block).unwrap();
            for r in 0..rows {
                for o in 0..n {
                    let want: f64 = (0..k).map(|i| a[r * lrs + i] * w[o * k + i]).sum::<f64>() + b[o];
                    assert!((y[r * yrs + o] - want).abs() < 1e-12, "block {block}, row {r}, col {o}");
                }
                assert_eq!(y[r * yrs + n..r * yrs + yrs], [7.0, 7.0], "block {block}: padding written");
            }
        }
        let mut y = vec![0.0; rows * yrs];
        let short = [1.0];
        let (lhs, rhs) = (Mat::rows(&a[..], rows, k, lrs), Mat::transposed(&w[..], n, k, k));
        assert!(biased_product(&mut y, yrs, lhs, rhs, Some(&short)).is_err(), "short bias accepted");
    }

    #[test]
    fn linear_matches_definition_and_its_gradients() {
        let mut rng = SeededRng::new(3);
        let lin: Linear<f64> = Linear {
            bias: Some((0..3).map(|i| i as f64 * 0.5).collect()),
            ..Linear::xavier(&mut rng, 4, 3, 1.0, Bias::Zeros)
        };
        let x: Vec<f64> = (0..8).map(|_| rng.normal()).collect();
        let y = lin.forward(&x, 2).unwrap();
        for r in 0..2 {
            for o in 0..3 {
                let want: f64 =
                    (0..4).map(|i| x[r * 4 + i] * lin.weight[o * 4 + i]).sum::<f64>() + lin.bias.as_ref().unwrap()[o];
                assert!((y[r * 3 + o] - want).abs() < 1e-12);
            }
        }
        let dy: Vec<f64> = (0..6).map(|_| rng.normal()).collect();
        let mut g = lin.zeros_like();
        let dx = lin.backward(&x, 2, &dy, &mut g).unwrap();
        for r in 0..2 {
            for i in 0..4 {
                let want: f64 = (0..3).map(|o| dy[r * 3 + o] * lin.weight[o * 4 + i]).sum();
                assert!((dx[r * 4 + i] - want).abs() < 1e-12);
            }
        }
        for o in 0..3 {
            for i in 0..4 {
                let want: f64 = (0..2).map(|r| dy[r * 3 + o] * x[r * 4 + i]).sum();
                assert!((g.weight[o * 4 + i] - want).abs() < 1e-12);
            }
            assert!((g.bias.as_ref().unwrap()[o] - (dy[o] + dy[3 + o])).abs() < 1e-12);
        }
    }
}
