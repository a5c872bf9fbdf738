//! Tensors handed over from PyTorch as `(address, shape, strides, dtype)`: every field is
//! checked here, then turned into attn views over the tensor's own memory, without copies
//! (a CUDA tensor's memory is never read here: its checked span becomes a foreign device
//! handle, see `cuda_call`).
//!
//! The Python wrapper is the only caller: it passes `tensor.data_ptr()`, `tensor.shape`
//! and `tensor.stride()` of tensors it holds for the whole call, so the address and
//! layout describe live memory. Everything else (rank, signs, dtype, alignment, extent,
//! overlap between written and read buffers) is checked before a slice is formed.

use std::mem::{align_of, size_of};

use attn_core::{AttnError, DType, Element, Result, Shape4, TensorName, TensorView, TensorViewMut};
use pyo3::FromPyObject;

/// A tensor as the Python side describes it: data address, sizes, strides (elements)
/// and the dtype name (`float32`, `bfloat16`, `float16`, `bool`, `uint8`).
#[derive(Debug, Clone, FromPyObject)]
pub struct RawTensor(pub usize, pub Vec<i64>, pub Vec<i64>, pub String);

/// The byte range `[start, end)` a tensor's elements occupy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    fn overlaps(&self, other: &Span) -> bool {
        self.start < other.end && other.start < self.end
    }
}

/// A checked tensor: its sizes, strides, the element count its slice must hold and its
/// byte span.
#[derive(Debug, Clone)]
pub struct Checked {
    tensor: TensorName,
    addr: usize,
    dims: Vec<usize>,
    strides: Vec<usize>,
    len: usize,
    pub span: Span,
}

fn to_usize(tensor: TensorName, what: &str, xs: &[i64]) -> Result<Vec<usize>> {
    xs.iter()
        .map(|&x| {
            usize::try_from(x).map_err(|_| AttnError::InvalidArgument(format!("{tensor}: negative {what} in {xs:?}")))
        })
        .collect()
}

/// The name PyTorch gives `dtype` (what the Python side sends).
pub fn torch_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
    }
}

impl RawTensor {
    pub fn dtype(&self) -> &str {
        &self.3
    }

    /// Check rank, signs, alignment and extent for elements of `elem` bytes: the slice
    /// `[addr, addr + len * elem)` then covers every element the sizes and strides reach.
    pub fn check(&self, tensor: TensorName, rank: usize, elem: usize, align: usize) -> Result<Checked> {
        let RawTensor(addr, shape, strides, _) = self;
        if shape.len() != rank {
            return Err(AttnError::RankMismatch { tensor, expected: rank, got: shape.len() });
        }
        if strides.len() != rank {
            return Err(AttnError::InvalidArgument(format!(
                "{tensor}: {} strides for {rank} dimensions",
                strides.len()
            )));
        }
        let dims = to_usize(tensor, "size", shape)?;
        let strides = to_usize(tensor, "stride", strides)?;
        if rank == 4 {
            Shape4::from_dims(tensor, &dims)?;
        } else if let Some(i) = dims.iter().position(|&d| d == 0) {
            return Err(AttnError::InvalidArgument(format!("{tensor}: dimension {i} is zero (shape {dims:?})")));
        }
        let overflow = || AttnError::ShapeOverflow { tensor, dims: dims.clone() };
        let mut last = 0usize;
        for (d, s) in dims.iter().zip(&strides) {
            last = (d - 1).checked_mul(*s).and_then(|x| last.checked_add(x)).ok_or_else(overflow)?;
        }
        let len = last.checked_add(1).ok_or_else(overflow)?;
        let bytes = len.checked_mul(elem).filter(|&b| b <= isize::MAX as usize).ok_or_else(overflow)?;
        if *addr == 0 || addr % align != 0 {
            return Err(AttnError::InvalidArgument(format!(
                "{tensor}: data address {addr:#x} is null or not aligned to {align} bytes"
            )));
        }
        let end = addr.checked_add(bytes).ok_or_else(overflow)?;
        Ok(Checked { tensor, addr: *addr, dims, strides, len, span: Span { start: *addr, end } })
    }

    /// [`RawTensor::check`] for a 4-dimensional tensor of `T`, its dtype included.
    pub fn check4<T: Element>(&self, tensor: TensorName) -> Result<Checked> {
        self.expect_dtype(tensor, torch_name(T::DTYPE))?;
        self.check(tensor, 4, size_of::<T>(), align_of::<T>())
    }

    /// The dtype must be `want`, else [`AttnError::DTypeMismatch`].
    pub fn expect_dtype(&self, tensor: TensorName, want: &'static str) -> Result<()> {
        if self.3 != want {
            return Err(AttnError::DTypeMismatch { tensor, expected: want, got: self.3.clone() });
        }
        Ok(())
    }
}

impl Checked {
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    fn shape4(&self) -> Result<(Shape4, [usize; 4])> {
        let shape = Shape4::from_dims(self.tensor, &self.dims)?;
        let strides: [usize; 4] = self.strides.as_slice().try_into().map_err(|_| AttnError::RankMismatch {
            tensor: self.tensor,
            expected: 4,
            got: self.strides.len(),
        })?;
        Ok((shape, strides))
    }

    /// A device tensor's `(address, elements)`, sizes and strides, for a foreign handle
    /// over its memory (no host slice is formed).
    pub fn device_parts4(&self) -> Result<((u64, usize), Shape4, [usize; 4])> {
        let (shape, strides) = self.shape4()?;
        Ok(((self.addr as u64, self.len), shape, strides))
    }

    /// A device tensor's `(address, elements)`.
    pub fn device_span(&self) -> (u64, usize) {
        (self.addr as u64, self.len)
    }

    /// The elements as a slice (the tensor's memory, see the module doc).
    fn slice<'a, T>(&self) -> &'a [T] {
        // SAFETY: `check` verified a non-null address aligned for `T` and a byte length
        // within `isize::MAX`; the caller holds a live tensor whose elements span these
        // `len` elements (module doc), and nothing writes them while the slice lives
        // (`check_disjoint` keeps every written buffer apart from every read one).
        unsafe { std::slice::from_raw_parts(self.addr as *const T, self.len) }
    }

    /// The elements as a mutable slice.
    fn slice_mut<'a, T>(&self) -> &'a mut [T] {
        // SAFETY: as in `slice`; the buffer is written only through this slice, since
        // `check_disjoint` refused any other buffer of the call overlapping it.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, self.len) }
    }

    /// A read view of a `[batch, seq, heads, head_dim]` tensor of `T`.
    pub fn view<'a, T: Element>(&self) -> Result<TensorView<'a, T>> {
        let (shape, strides) = self.shape4()?;
        TensorView::strided(self.tensor, self.slice(), shape, strides)
    }

    /// A write view (rows must not overlap, which the view checks).
    pub fn view_mut<'a, T: Element>(&self) -> Result<TensorViewMut<'a, T>> {
        let (shape, strides) = self.shape4()?;
        TensorViewMut::strided(self.tensor, self.slice_mut(), shape, strides)
    }

    /// A contiguous f32 buffer of exactly `want` sizes (the LSE), for writing.
    pub fn contiguous_f32_mut<'a>(&self, want: &[usize]) -> Result<&'a mut [f32]> {
        self.expect_contiguous(want)?;
        Ok(self.slice_mut())
    }

    /// A contiguous f32 buffer of exactly `want` sizes (the LSE), for reading.
    pub fn contiguous_f32<'a>(&self, want: &[usize]) -> Result<&'a [f32]> {
        self.expect_contiguous(want)?;
        Ok(self.slice())
    }

    /// Require exactly `want` sizes with contiguous strides (as torch judges them: the
    /// stride of a size-1 dimension is never read, so any value passes).
    pub fn expect_contiguous(&self, want: &[usize]) -> Result<()> {
        if self.dims != want {
            return Err(AttnError::ShapeMismatch {
                tensor: self.tensor,
                expected: want.to_vec(),
                got: self.dims.clone(),
            });
        }
        let numel: usize = want.iter().product();
        let mut expect = vec![1usize; want.len()];
        for i in (0..want.len().saturating_sub(1)).rev() {
            expect[i] = expect[i + 1] * want[i + 1];
        }
        let strides_ok = self.strides.len() == want.len()
            && self.strides.iter().zip(&expect).zip(want).all(|((&s, &e), &n)| n == 1 || s == e);
        if !strides_ok || self.len != numel {
            return Err(AttnError::InvalidArgument(format!(
                "{}: strides {:?} are not the contiguous {expect:?}",
                self.tensor, self.strides
            )));
        }
        Ok(())
    }

    /// The rank-4 byte tensor (a bool or uint8 block mask) as its row-major bytes, values
    /// kept as they are (the block mask refuses any but 0 and 1).
    pub fn bytes_4d(&self) -> Vec<u8> {
        let bytes: &[u8] = self.slice();
        let (d, s) = (&self.dims, &self.strides);
        let mut out = Vec::with_capacity(d.iter().product());
        for a in 0..d[0] {
            for b in 0..d[1] {
                for c in 0..d[2] {
                    let row = a * s[0] + b * s[1] + c * s[2];
                    out.extend((0..d[3]).map(|e| bytes[row + e * s[3]]));
                }
            }
        }
        out
    }

    /// The `[rows, cols]` byte tensor (a bool or uint8 mask) as row-major flags, `true`
    /// for a non-zero byte.
    pub fn flags_2d(&self) -> Vec<bool> {
        let bytes: &[u8] = self.slice();
        let (rows, cols) = (self.dims[0], self.dims[1]);
        let mut out = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            out.extend((0..cols).map(|c| bytes[r * self.strides[0] + c * self.strides[1]] != 0));
        }
        out
    }
}

/// Whether a buffer is written by the call or only read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

/// Refuse a written buffer that overlaps any other buffer of the call (read buffers may
/// share memory with each other, as `q = k = v` does).
pub fn check_disjoint(buffers: &[(&Checked, Access)]) -> Result<()> {
    for (i, (a, access)) in buffers.iter().enumerate() {
        if *access == Access::Read {
            continue;
        }
        for (j, (b, _)) in buffers.iter().enumerate() {
            if i != j && a.span.overlaps(&b.span) {
                return Err(AttnError::InvalidArgument(format!(
                    "{} shares memory with {}: outputs need their own buffers",
                    a.tensor, b.tensor
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(addr: usize, shape: &[i64], strides: &[i64], dtype: &str) -> RawTensor {
        RawTensor(addr, shape.to_vec(), strides.to_vec(), dtype.to_string())
    }

    #[test]
    fn checks_rank_signs_dtype_alignment_and_extent() {
        let q = TensorName::Query;
        let ok = raw(64, &[1, 2, 3, 4], &[24, 12, 4, 1], "float32");
        let c = ok.check4::<f32>(q).unwrap();
        assert_eq!((c.len, c.span), (24, Span { start: 64, end: 64 + 96 }));
        let expanded = raw(64, &[2, 5, 3, 4], &[0, 0, 4, 1], "float32").check4::<f32>(q).unwrap();
        assert_eq!(expanded.len, 12);
        let err = |r: RawTensor| r.check4::<f32>(q).unwrap_err();
        assert!(matches!(err(raw(64, &[2, 3, 4], &[12, 4, 1], "float32")), AttnError::RankMismatch { got: 3, .. }));
        assert!(matches!(err(raw(64, &[1, 2, 3, 4], &[24, 12, 4, 1], "float16")), AttnError::DTypeMismatch { .. }));
        assert!(matches!(err(raw(64, &[1, -2, 3, 4], &[24, 12, 4, 1], "float32")), AttnError::InvalidArgument(_)));
        assert!(matches!(err(raw(64, &[1, 2, 3, 4], &[24, -12, 4, 1], "float32")), AttnError::InvalidArgument(_)));
        assert!(matches!(err(raw(66, &[1, 2, 3, 4], &[24, 12, 4, 1], "float32")), AttnError::InvalidArgument(_)));
        assert!(matches!(err(raw(0, &[1, 2, 3, 4], &[24, 12, 4, 1], "float32")), AttnError::InvalidArgument(_)));
        assert!(matches!(
            err(raw(64, &[1, 0, 3, 4], &[24, 12, 4, 1], "float32")),
            AttnError::ZeroDim { dim: "seq", .. }
        ));
        let huge = raw(64, &[i64::MAX, 2, 3, 4], &[i64::MAX, 12, 4, 1], "float32");
        assert!(matches!(err(huge), AttnError::ShapeOverflow { .. }));
        assert!(matches!(err(raw(64, &[1, 2], &[2, 1, 1, 1], "float32")), AttnError::RankMismatch { .. }));
    }

    #[test]
    fn contiguity_ignores_the_strides_of_size_one_dimensions() {
        let mask = |shape: &[i64], strides: &[i64]| {
            raw(64, shape, strides, "bool").check(TensorName::KeyPaddingMask, 2, 1, 1).unwrap()
        };
        // `torch.zeros(32, 1, dtype=torch.bool).t()`: torch calls it contiguous.
        assert!(mask(&[1, 32], &[1, 1]).expect_contiguous(&[1, 32]).is_ok());
        assert!(mask(&[1, 32], &[32, 1]).expect_contiguous(&[1, 32]).is_ok());
        assert!(mask(&[2, 32], &[1, 2]).expect_contiguous(&[2, 32]).is_err());
        assert!(mask(&[2, 32], &[64, 1]).expect_contiguous(&[2, 32]).is_err());
        assert!(mask(&[2, 32], &[32, 1]).expect_contiguous(&[2, 16]).is_err());
    }

    #[test]
    fn written_buffers_may_not_overlap_others() {
        let a = raw(64, &[1, 1, 1, 4], &[4, 4, 4, 1], "float32").check4::<f32>(TensorName::Query).unwrap();
        let b = raw(72, &[1, 1, 1, 4], &[4, 4, 4, 1], "float32").check4::<f32>(TensorName::Output).unwrap();
        let c = raw(80, &[1, 1, 1, 4], &[4, 4, 4, 1], "float32").check4::<f32>(TensorName::Output).unwrap();
        assert!(check_disjoint(&[(&a, Access::Read), (&a, Access::Read)]).is_ok());
        assert!(check_disjoint(&[(&a, Access::Read), (&b, Access::Write)]).is_err());
        assert!(check_disjoint(&[(&a, Access::Read), (&c, Access::Write)]).is_ok());
        assert!(check_disjoint(&[(&b, Access::Read), (&c, Access::Write)]).is_err());
    }
}
