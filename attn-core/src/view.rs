//! Strided views of `[batch, seq, heads, head_dim]` tensors over caller buffers.
//!
//! The innermost (head_dim) stride is always 1, so a row `(b, s, h)` is a plain
//! slice; the other strides are free, so a fused QKV buffer `[b, s, 3, h, d]`
//! feeds attention without copies (see [`TensorView::fused_qkv`]).

use crate::element::Element;
use crate::error::{AttnError, Result, TensorName};
use crate::shape::Shape4;

/// `Shape4` has public fields: a view re-checks what [`Shape4::named`] guarantees (no
/// zero dimension, no overflow) before computing sizes and offsets from it.
fn checked(tensor: TensorName, shape: Shape4) -> Result<Shape4> {
    Shape4::named(tensor, shape.dims())
}

fn check_extent(tensor: TensorName, len: usize, shape: &Shape4, strides: &[usize; 4]) -> Result<()> {
    let shape = &checked(tensor, *shape)?;
    if strides[3] != 1 {
        return Err(AttnError::NonUnitInnerStride { tensor, stride: strides[3] });
    }
    // Largest offset + 1, computed with checked arithmetic.
    let mut last = 0usize;
    for (d, s) in shape.dims().iter().zip(strides) {
        let step =
            (d - 1).checked_mul(*s).ok_or_else(|| AttnError::ShapeOverflow { tensor, dims: shape.dims().to_vec() })?;
        last =
            last.checked_add(step).ok_or_else(|| AttnError::ShapeOverflow { tensor, dims: shape.dims().to_vec() })?;
    }
    let needed = last + 1;
    if needed > len {
        return Err(AttnError::BufferTooSmall { tensor, len, needed });
    }
    Ok(())
}

/// A read-only strided view.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a, T> {
    data: &'a [T],
    shape: Shape4,
    strides: [usize; 4],
}

impl<'a, T: Element> TensorView<'a, T> {
    /// A row-major view; `data.len()` must equal the element count.
    pub fn contiguous(tensor: TensorName, data: &'a [T], shape: Shape4) -> Result<Self> {
        let shape = checked(tensor, shape)?;
        if data.len() != shape.numel() {
            return Err(AttnError::ShapeMismatch { tensor, expected: vec![shape.numel()], got: vec![data.len()] });
        }
        Ok(TensorView { data, shape, strides: shape.contiguous_strides() })
    }

    /// A view with explicit strides (elements); every reachable index must be in `data`.
    pub fn strided(tensor: TensorName, data: &'a [T], shape: Shape4, strides: [usize; 4]) -> Result<Self> {
        check_extent(tensor, data.len(), &shape, &strides)?;
        Ok(TensorView { data, shape, strides })
    }

    /// The q, k and v views of a fused `[batch, seq, 3, heads, head_dim]` buffer
    /// (the output of one fused projection GEMM), without copying.
    pub fn fused_qkv(data: &'a [T], shape: Shape4) -> Result<[Self; 3]> {
        let shape = checked(TensorName::Other("qkv"), shape)?;
        let (h, d) = (shape.heads, shape.head_dim);
        let row = 3usize.checked_mul(h * d).ok_or_else(|| AttnError::ShapeOverflow {
            tensor: TensorName::Other("qkv"),
            dims: shape.dims().to_vec(),
        })?;
        let strides = [shape.seq * row, row, d, 1];
        let part = |i: usize, name| {
            let start = (i * h * d).min(data.len());
            TensorView::strided(name, &data[start..], shape, strides)
        };
        Ok([part(0, TensorName::Query)?, part(1, TensorName::Key)?, part(2, TensorName::Value)?])
    }

    pub fn shape(&self) -> Shape4 {
        self.shape
    }
    pub fn strides(&self) -> [usize; 4] {
        self.strides
    }
    /// The underlying buffer (starting at element (0,0,0,0)).
    pub fn data(&self) -> &'a [T] {
        self.data
    }
    /// Offset of row `(b, s, h)`.
    #[inline(always)]
    pub fn offset(&self, b: usize, s: usize, h: usize) -> usize {
        b * self.strides[0] + s * self.strides[1] + h * self.strides[2]
    }
    /// The `head_dim` elements of row `(b, s, h)`.
    #[inline(always)]
    pub fn row(&self, b: usize, s: usize, h: usize) -> &'a [T] {
        let o = self.offset(b, s, h);
        &self.data[o..o + self.shape.head_dim]
    }
    /// Whether the view is row-major contiguous.
    pub fn is_contiguous(&self) -> bool {
        self.strides == self.shape.contiguous_strides()
    }
    /// Copy out as a contiguous f64 vector (for the reference and tests).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        let mut v = Vec::with_capacity(self.shape.numel());
        for b in 0..self.shape.batch {
            for s in 0..self.shape.seq {
                for h in 0..self.shape.heads {
                    v.extend(self.row(b, s, h).iter().map(|x| x.to_f64()));
                }
            }
        }
        v
    }
}

/// A mutable strided view (head_dim stride 1).
#[derive(Debug)]
pub struct TensorViewMut<'a, T> {
    data: &'a mut [T],
    shape: Shape4,
    strides: [usize; 4],
}

impl<'a, T: Element> TensorViewMut<'a, T> {
    pub fn contiguous(tensor: TensorName, data: &'a mut [T], shape: Shape4) -> Result<Self> {
        let shape = checked(tensor, shape)?;
        if data.len() != shape.numel() {
            return Err(AttnError::ShapeMismatch { tensor, expected: vec![shape.numel()], got: vec![data.len()] });
        }
        Ok(TensorViewMut { data, shape, strides: shape.contiguous_strides() })
    }

    /// A mutable view with explicit strides. Distinct `(b, s, h)` must not alias:
    /// strides are checked to be at least as large as the extent they step over.
    pub fn strided(tensor: TensorName, data: &'a mut [T], shape: Shape4, strides: [usize; 4]) -> Result<Self> {
        check_extent(tensor, data.len(), &shape, &strides)?;
        let d = shape.head_dim;
        let h_ok = shape.heads == 1 || strides[2] >= d;
        let s_ok = shape.seq == 1 || strides[1] >= d + (shape.heads - 1) * strides[2];
        let b_ok = shape.batch == 1 || strides[0] >= d + (shape.heads - 1) * strides[2] + (shape.seq - 1) * strides[1];
        if !(h_ok && s_ok && b_ok) {
            return Err(AttnError::InvalidArgument(format!("{tensor}: strides {strides:?} make rows overlap")));
        }
        Ok(TensorViewMut { data, shape, strides })
    }

    pub fn shape(&self) -> Shape4 {
        self.shape
    }
    pub fn strides(&self) -> [usize; 4] {
        self.strides
    }
    #[inline(always)]
    pub fn offset(&self, b: usize, s: usize, h: usize) -> usize {
        b * self.strides[0] + s * self.strides[1] + h * self.strides[2]
    }
    #[inline(always)]
    pub fn row_mut(&mut self, b: usize, s: usize, h: usize) -> &mut [T] {
        let o = self.offset(b, s, h);
        let d = self.shape.head_dim;
        &mut self.data[o..o + d]
    }
    /// Mutable access to the whole buffer (for backends that split it themselves).
    pub fn data_mut(&mut self) -> &mut [T] {
        self.data
    }
    /// Reborrow mutably for a shorter lifetime (to pass the view on and keep it).
    pub fn reborrow(&mut self) -> TensorViewMut<'_, T> {
        TensorViewMut { data: &mut *self.data, shape: self.shape, strides: self.strides }
    }
    /// Reborrow as read-only.
    pub fn as_view(&self) -> TensorView<'_, T> {
        TensorView { data: self.data, shape: self.shape, strides: self.strides }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_qkv_views_pick_the_right_rows() {
        let shape = Shape4::new(1, 2, 2, 3).unwrap();
        let data: Vec<f32> = (0..36).map(|x| x as f32).collect();
        let [q, k, v] = TensorView::fused_qkv(&data, shape).unwrap();
        assert_eq!(q.row(0, 0, 0), &[0.0, 1.0, 2.0]);
        assert_eq!(k.row(0, 0, 1), &[9.0, 10.0, 11.0]);
        assert_eq!(v.row(0, 1, 1), &[33.0, 34.0, 35.0]);
        assert!(TensorView::fused_qkv(&data[..35], shape).is_err());
    }

    #[test]
    fn strided_views_check_bounds_and_aliasing() {
        let shape = Shape4::new(1, 2, 1, 4).unwrap();
        let mut buf = vec![0.0f32; 8];
        assert!(TensorView::strided(TensorName::Query, &buf, shape, [8, 4, 4, 1]).is_ok());
        assert!(matches!(
            TensorView::strided(TensorName::Query, &buf, shape, [8, 5, 4, 1]),
            Err(AttnError::BufferTooSmall { .. })
        ));
        assert!(matches!(
            TensorView::strided(TensorName::Query, &buf, shape, [8, 4, 4, 2]),
            Err(AttnError::NonUnitInnerStride { .. })
        ));
        assert!(TensorViewMut::strided(TensorName::Output, &mut buf, shape, [8, 2, 4, 1]).is_err());
    }
}
