//! Block-level attention for ring steps: attend a block of query rows to a block of
//! key/value rows, both carrying GLOBAL positions, and LSE-merge the partial result.
//!
//! Contract (shared with `attn-ring`):
//! - A [`BlockRows`] is the rows of one `(batch, head)` slice of q, k or v: row `i` is
//!   `data[i*stride .. i*stride + d]`, at global position `pos[i]`. Positions should be
//!   ascending (any order is accepted; ascending is fastest).
//! - The mask is exactly [`SegmentPattern::attends`]`(qpos, kpos, causal)`.
//! - [`attend_block`] merges its result into an f32 partial `(out, lse)` with the LSE
//!   merge (`out` normalised, `lse = -inf` meaning "nothing yet"), so calling it for
//!   several key blocks, or for several patterns of one LongNet head, in any order gives
//!   the attention over the union of those keys. The caller applies the head's
//!   `out_scale` when writing the final output.
//! - [`attend_block_backward`] accumulates (`+=`) f32 gradients of one block given the
//!   head's FINAL lse per query row, the grad_out rows (any [`Element`], read in place)
//!   with the factor that makes them `grad_out_eff = out_scale * grad_out`, and
//!   `delta = dot(grad_out, out)` per query row (final, scaled output).
//!
//! All arithmetic is f32 (inputs of any [`Element`] are converted on load).

use attn_core::error::TensorName;
use attn_core::{AttnError, Element, Result, SegmentPattern};

use crate::isa::Isa;
use crate::piece::{self, BlockGrads, Strided};

/// Rows of one `(batch, head)` slice of q, k or v, with their global positions.
#[derive(Debug, Clone, Copy)]
pub struct BlockRows<'a, T> {
    /// Row `i` is `data[i*stride .. i*stride + d]`.
    pub data: &'a [T],
    /// Distance in elements between consecutive rows (`>= d` when there are 2+ rows).
    pub stride: usize,
    /// Global position of each row; `pos.len()` is the number of rows.
    pub pos: &'a [usize],
}

impl<'a, T: Element> BlockRows<'a, T> {
    pub fn new(data: &'a [T], stride: usize, pos: &'a [usize]) -> Self {
        BlockRows { data, stride, pos }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.pos.len()
    }

    /// Check that every row of `d` elements lies inside `data` and rows do not overlap.
    pub fn check(&self, tensor: TensorName, d: usize) -> Result<()> {
        let n = self.rows();
        if n == 0 {
            return Ok(());
        }
        if n > 1 && self.stride < d {
            return Err(AttnError::InvalidArgument(format!("{tensor}: row stride {} < head_dim {d}", self.stride)));
        }
        let needed = (n - 1)
            .checked_mul(self.stride)
            .and_then(|x| x.checked_add(d))
            .ok_or_else(|| AttnError::ShapeOverflow { tensor, dims: vec![n, self.stride, d] })?;
        if needed > self.data.len() {
            return Err(AttnError::BufferTooSmall { tensor, len: self.data.len(), needed });
        }
        Ok(())
    }

    fn strided(&self) -> Strided<'a, T> {
        Strided { data: self.data, stride: self.stride, pos: self.pos }
    }
}

fn check_common<T: Element>(
    scale: f32,
    d: usize,
    q: &BlockRows<'_, T>,
    k: &BlockRows<'_, T>,
    v: &BlockRows<'_, T>,
) -> Result<()> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(AttnError::InvalidScale(scale as f64));
    }
    if d == 0 {
        return Err(AttnError::ZeroDim { tensor: TensorName::Query, dim: "head_dim" });
    }
    q.check(TensorName::Query, d)?;
    k.check(TensorName::Key, d)?;
    v.check(TensorName::Value, d)?;
    if v.rows() != k.rows() || v.pos != k.pos {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::Value,
            expected: vec![k.rows()],
            got: vec![v.rows()],
        });
    }
    Ok(())
}

fn check_f32(tensor: TensorName, got: usize, expected: usize) -> Result<()> {
    if got != expected {
        return Err(AttnError::ShapeMismatch { tensor, expected: vec![expected], got: vec![got] });
    }
    Ok(())
}

fn check_pattern(pattern: &SegmentPattern) -> Result<()> {
    if pattern.w == 0 || pattern.r == 0 {
        return Err(AttnError::InvalidArgument(format!("pattern {pattern:?} has a zero segment length or rate")));
    }
    Ok(())
}

/// Attend the q rows to the k/v rows admitted by `pattern.attends(qpos, kpos, causal)` and
/// LSE-merge the result into the f32 partial `out` (`[q_rows * d]`, normalised) and `lse`
/// (`[q_rows]`, `-inf` = nothing yet).
#[allow(clippy::too_many_arguments)]
pub fn attend_block<T: Element>(
    pattern: &SegmentPattern,
    causal: bool,
    scale: f32,
    d: usize,
    q: &BlockRows<'_, T>,
    k: &BlockRows<'_, T>,
    v: &BlockRows<'_, T>,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    check_pattern(pattern)?;
    check_common(scale, d, q, k, v)?;
    check_f32(TensorName::Output, out.len(), q.rows() * d)?;
    check_f32(TensorName::Lse, lse.len(), q.rows())?;
    let (q, k, v) = (q.strided(), k.strided(), v.strided());
    piece::forward_block(Isa::detect(), pattern, causal, scale, d, &q, &k, &v, out, lse);
    Ok(())
}

/// Accumulate (`+=`) the gradients of one block. `grad_out` holds one row per q row
/// (its positions are not read) and `grad_scale * grad_out` is the effective output
/// gradient (`grad_scale` = the head's `out_scale`), so a caller's grad_out tensor is
/// read in place, in its own dtype; `lse` the head's FINAL lse per q row, `delta` per q
/// row `dot(grad_out, out)` of the final (scaled) output; `dq` is `[q_rows * d]`, `dk`
/// and `dv` are `[k_rows * d]`.
#[allow(clippy::too_many_arguments)]
pub fn attend_block_backward<T: Element, G: Element>(
    pattern: &SegmentPattern,
    causal: bool,
    scale: f32,
    d: usize,
    q: &BlockRows<'_, T>,
    k: &BlockRows<'_, T>,
    v: &BlockRows<'_, T>,
    grad_out: &BlockRows<'_, G>,
    grad_scale: f32,
    lse: &[f32],
    delta: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) -> Result<()> {
    check_pattern(pattern)?;
    check_common(scale, d, q, k, v)?;
    let (nq, nk) = (q.rows(), k.rows());
    grad_out.check(TensorName::GradOutput, d)?;
    if grad_out.rows() != nq {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::GradOutput,
            expected: vec![nq, d],
            got: vec![grad_out.rows(), d],
        });
    }
    if !grad_scale.is_finite() {
        return Err(AttnError::InvalidScale(grad_scale as f64));
    }
    check_f32(TensorName::Lse, lse.len(), nq)?;
    check_f32(TensorName::Other("delta"), delta.len(), nq)?;
    check_f32(TensorName::GradQuery, dq.len(), nq * d)?;
    check_f32(TensorName::GradKey, dk.len(), nk * d)?;
    check_f32(TensorName::GradValue, dv.len(), nk * d)?;
    let (q, k, v) = (q.strided(), k.strided(), v.strided());
    let grads = BlockGrads { grad_out: grad_out.strided(), grad_scale, lse, delta, dq, dk, dv };
    piece::backward_block(Isa::detect(), pattern, causal, scale, d, &q, &k, &v, grads);
    Ok(())
}
