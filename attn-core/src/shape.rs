//! Checked shapes: `[batch, seq, heads, head_dim]` and the q/kv pair of one call.

use crate::config::DilatedConfig;
use crate::error::{AttnError, Result, TensorName};

/// A `[batch, seq, heads, head_dim]` shape whose element count fits in `usize`
/// (and whose byte size fits for every dtype up to 8 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape4 {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl Shape4 {
    /// Validate: no zero dimension, no overflow of the element or byte count.
    pub fn new(batch: usize, seq: usize, heads: usize, head_dim: usize) -> Result<Self> {
        Self::named(TensorName::Query, [batch, seq, heads, head_dim])
    }

    /// Like [`Shape4::new`] with the tensor name used in errors.
    pub fn named(tensor: TensorName, dims: [usize; 4]) -> Result<Self> {
        const NAMES: [&str; 4] = ["batch", "seq", "heads", "head_dim"];
        for (d, name) in dims.iter().zip(NAMES) {
            if *d == 0 {
                return Err(AttnError::ZeroDim { tensor, dim: name });
            }
        }
        let overflow = || AttnError::ShapeOverflow { tensor, dims: dims.to_vec() };
        let n = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(overflow)?;
        n.checked_mul(8).filter(|&b| b <= isize::MAX as usize).ok_or_else(overflow)?;
        Ok(Shape4 { batch: dims[0], seq: dims[1], heads: dims[2], head_dim: dims[3] })
    }

    /// From a dims slice, checking the rank.
    pub fn from_dims(tensor: TensorName, dims: &[usize]) -> Result<Self> {
        let d: [usize; 4] =
            dims.try_into().map_err(|_| AttnError::RankMismatch { tensor, expected: 4, got: dims.len() })?;
        Self::named(tensor, d)
    }

    pub fn dims(&self) -> [usize; 4] {
        [self.batch, self.seq, self.heads, self.head_dim]
    }
    /// Element count (cannot overflow: checked at construction).
    pub fn numel(&self) -> usize {
        self.batch * self.seq * self.heads * self.head_dim
    }
    /// Row-major strides.
    pub fn contiguous_strides(&self) -> [usize; 4] {
        [self.seq * self.heads * self.head_dim, self.heads * self.head_dim, self.head_dim, 1]
    }
    /// Number of LSE values `[batch, seq, heads]`.
    pub fn lse_len(&self) -> usize {
        self.batch * self.seq * self.heads
    }
    /// The same shape with another sequence length (checked).
    pub fn with_seq(&self, seq: usize) -> Result<Self> {
        Self::new(self.batch, seq, self.heads, self.head_dim)
    }
}

/// The shapes of one attention call: queries, and keys/values (which may have
/// their own sequence length for cross-attention).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttnShape {
    pub q: Shape4,
    pub kv: Shape4,
}

/// Whether k and v must have q's sequence length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyLength {
    OfQuery,
    Own,
}

impl From<Shape4> for AttnShape {
    /// Self-attention: k and v have q's shape.
    fn from(q: Shape4) -> Self {
        AttnShape::self_attn(q)
    }
}

impl AttnShape {
    /// Self-attention: k and v have q's shape.
    pub fn self_attn(q: Shape4) -> Self {
        AttnShape { q, kv: q }
    }

    /// Number of query heads that share one key/value head (1 without GQA).
    pub fn group_size(&self) -> usize {
        self.q.heads / self.kv.heads
    }

    /// The key/value head query head `h` reads (PyTorch's `repeat_interleave` order).
    #[inline]
    pub fn kv_head(&self, h: usize) -> usize {
        h / self.group_size()
    }

    /// Whether k and v have fewer heads than q (grouped-query attention).
    pub fn is_grouped(&self) -> bool {
        self.kv.heads != self.q.heads
    }

    /// The shapes of a call of `cfg` on tensors of dims `q`, `k`, `v`: cross-attention
    /// where k's sequence length differs from q's, and the config's head rule checked.
    pub fn of_call(cfg: &DilatedConfig, [q, k, v]: [&[usize]; 3]) -> Result<Self> {
        let shape = if k.get(1) != q.get(1) { Self::check_cross(q, k, v)? } else { Self::check(q, k, v)? };
        cfg.validate_heads(shape.q.heads)?;
        Ok(shape)
    }

    /// Check self-attention q, k, v dims: k and v agree exactly and match q in batch,
    /// sequence length and head_dim; their head count divides q's (grouped-query
    /// attention when smaller).
    pub fn check(q: &[usize], k: &[usize], v: &[usize]) -> Result<Self> {
        Self::check_dims(q, k, v, KeyLength::OfQuery)
    }

    /// Check cross-attention q, k, v dims: k and v agree exactly and match q in batch
    /// and head_dim, their head count divides q's; their sequence length is their own.
    pub fn check_cross(q: &[usize], k: &[usize], v: &[usize]) -> Result<Self> {
        Self::check_dims(q, k, v, KeyLength::Own)
    }

    fn check_dims(q: &[usize], k: &[usize], v: &[usize], kv_len: KeyLength) -> Result<Self> {
        let cross = kv_len == KeyLength::Own;
        let qs = Shape4::from_dims(TensorName::Query, q)?;
        let ks = Shape4::from_dims(TensorName::Key, k)?;
        let vs = Shape4::from_dims(TensorName::Value, v)?;
        if vs != ks {
            return Err(AttnError::ShapeMismatch { tensor: TensorName::Value, expected: k.to_vec(), got: v.to_vec() });
        }
        let expect_k = [qs.batch, if cross { ks.seq } else { qs.seq }, ks.heads, qs.head_dim];
        if ks.dims() != expect_k {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Key,
                expected: expect_k.to_vec(),
                got: k.to_vec(),
            });
        }
        if !qs.heads.is_multiple_of(ks.heads) {
            return Err(AttnError::KvHeadsNotDividing { heads: qs.heads, kv_heads: ks.heads });
        }
        Ok(AttnShape { q: qs, kv: ks })
    }

    /// Re-check a hand-built shape (public fields) as [`AttnShape::check_cross`] does.
    pub fn rechecked(&self) -> Result<Self> {
        Self::check_cross(&self.q.dims(), &self.kv.dims(), &self.kv.dims())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_and_overflow_are_errors() {
        assert!(matches!(Shape4::new(0, 1, 1, 1), Err(AttnError::ZeroDim { dim: "batch", .. })));
        assert!(matches!(Shape4::new(1, 1, 1, 0), Err(AttnError::ZeroDim { dim: "head_dim", .. })));
        assert!(matches!(Shape4::new(1 << 20, 1 << 20, 1 << 20, 2), Err(AttnError::ShapeOverflow { .. })));
        assert!(matches!(Shape4::new(usize::MAX, 1, 1, 1), Err(AttnError::ShapeOverflow { .. })));
        assert_eq!(Shape4::new(2, 3, 4, 5).unwrap().numel(), 120);
    }

    #[test]
    fn qkv_checks() {
        let q = [1, 8, 2, 4];
        assert!(AttnShape::check(&q, &q, &q).is_ok());
        assert!(matches!(
            AttnShape::check(&q, &[1, 9, 2, 4], &[1, 9, 2, 4]),
            Err(AttnError::ShapeMismatch { tensor: TensorName::Key, .. })
        ));
        assert!(AttnShape::check_cross(&q, &[1, 9, 2, 4], &[1, 9, 2, 4]).is_ok());
        assert!(matches!(
            AttnShape::check(&q, &q, &[1, 8, 2, 5]),
            Err(AttnError::ShapeMismatch { tensor: TensorName::Value, .. })
        ));
        let gqa = AttnShape::check(&[1, 8, 6, 4], &[1, 8, 2, 4], &[1, 8, 2, 4]).unwrap();
        assert_eq!((gqa.group_size(), gqa.kv_head(2), gqa.kv_head(3), gqa.is_grouped()), (3, 0, 1, true));
        assert!(matches!(
            AttnShape::check(&[1, 8, 6, 4], &[1, 8, 4, 4], &[1, 8, 4, 4]),
            Err(AttnError::KvHeadsNotDividing { heads: 6, kv_heads: 4 })
        ));
        assert!(matches!(
            AttnShape::check(&[1, 8, 2], &q, &q),
            Err(AttnError::RankMismatch { expected: 4, got: 3, .. })
        ));
    }
}
