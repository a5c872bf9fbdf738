//! `Permutation`: a token order with its inverse, applied to token buffers.
//!
//! `order[i]` is the row-major index of the token placed at sequence position `i`.
//! [`Permutation::apply_tokens`] gathers row-major tokens into that order
//! (`dst[i] = src[order[i]]`), [`Permutation::unapply_tokens`] restores row-major
//! order (`dst[order[i]] = src[i]`, done as the gather `dst[j] = src[inverse[j]]`).
//! A token is `token_len` contiguous elements (`heads * head_dim` for
//! `[batch, seq, heads, head_dim]`, `embed` for `[batch, seq, embed]`), so the
//! out-of-place paths are one `memcpy` per token; the in-place paths walk the
//! cycles of the permutation with a visited bitset and one token of scratch.

use std::ops::Range;
use std::sync::Arc;

use attn_core::error::{AttnError, Result, TensorName};
use attn_core::shape::Shape4;

/// A bijection of `0..n` with its inverse (both shared, so clones are cheap).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permutation {
    order: Arc<[usize]>,
    inverse: Arc<[usize]>,
}

/// How a buffer splits into `batch` blocks of `seq` tokens of `token_len` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenLayout {
    pub batch: usize,
    pub seq: usize,
    pub token_len: usize,
}

impl TokenLayout {
    /// `[batch, seq, heads, head_dim]`: a token is `heads * head_dim` elements.
    pub fn bshd(shape: Shape4) -> Self {
        TokenLayout { batch: shape.batch, seq: shape.seq, token_len: shape.heads * shape.head_dim }
    }

    /// `[batch, seq, embed]` (checked: no zero dimension, no overflow).
    pub fn bse(batch: usize, seq: usize, embed: usize) -> Result<Self> {
        let s = Shape4::named(TensorName::Other("tokens"), [batch, seq, 1, embed])?;
        Ok(Self::bshd(s))
    }

    /// Total elements (checked).
    pub fn numel(&self) -> Result<usize> {
        let overflow = || AttnError::ShapeOverflow {
            tensor: TensorName::Other("tokens"),
            dims: vec![self.batch, self.seq, self.token_len],
        };
        self.batch.checked_mul(self.seq).and_then(|x| x.checked_mul(self.token_len)).ok_or_else(overflow)
    }
}

/// Try to allocate `n` slots (a typed error instead of an abort on huge sizes).
pub(crate) fn try_vec<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| AttnError::OverBudget {
        needed: n.saturating_mul(std::mem::size_of::<T>()),
        budget: isize::MAX as usize,
    })?;
    Ok(v)
}

impl Permutation {
    /// Validate `order` (every index of `0..n` exactly once) and build the inverse.
    pub fn from_order(order: Vec<usize>) -> Result<Self> {
        let n = order.len();
        if n == 0 {
            return Err(AttnError::ZeroDim { tensor: TensorName::Other("permutation"), dim: "len" });
        }
        let mut inverse = try_vec::<usize>(n)?;
        inverse.resize(n, usize::MAX);
        for (i, &t) in order.iter().enumerate() {
            if t >= n || inverse[t] != usize::MAX {
                let why = if t >= n { "is out of range" } else { "appears twice" };
                return Err(AttnError::InvalidArgument(format!("not a permutation of 0..{n}: entry {i} ({t}) {why}")));
            }
            inverse[t] = i;
        }
        Ok(Permutation { order: order.into(), inverse: inverse.into() })
    }

    /// The identity on `0..n` (`n >= 1`).
    pub fn identity(n: usize) -> Result<Self> {
        let mut v = try_vec(n)?;
        v.extend(0..n);
        Self::from_order(v)
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.order.len()
    }
    /// Always false: a permutation has at least one element.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// `order[i]`: the row-major index of the token at sequence position `i`.
    pub fn order(&self) -> &[usize] {
        &self.order
    }
    /// `inverse[t]`: the sequence position of row-major token `t`.
    pub fn inverse_order(&self) -> &[usize] {
        &self.inverse
    }
    /// The inverse permutation (cheap: shares both tables).
    pub fn inverse(&self) -> Permutation {
        Permutation { order: self.inverse.clone(), inverse: self.order.clone() }
    }
    /// Whether this is the identity.
    pub fn is_identity(&self) -> bool {
        self.order.iter().enumerate().all(|(i, &t)| i == t)
    }
    /// `self` after `first`: applying the result equals applying `first`, then `self`
    /// (`result.order[i] = first.order[self.order[i]]`).
    pub fn after(&self, first: &Permutation) -> Result<Permutation> {
        check_len("permutation", self.len(), first.len())?;
        let mut v = try_vec(self.len())?;
        v.extend(self.order.iter().map(|&i| first.order[i]));
        Permutation::from_order(v)
    }

    fn check_layout(&self, layout: &TokenLayout, bufs: &[(&'static str, usize)]) -> Result<()> {
        if layout.token_len == 0 {
            return Err(AttnError::ZeroDim { tensor: TensorName::Other("tokens"), dim: "token_len" });
        }
        if layout.batch == 0 {
            return Err(AttnError::ZeroDim { tensor: TensorName::Other("tokens"), dim: "batch" });
        }
        if layout.seq != self.len() {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Other("tokens"),
                expected: vec![self.len()],
                got: vec![layout.seq],
            });
        }
        let numel = layout.numel()?;
        for &(name, got) in bufs {
            check_len(name, got, numel)?;
        }
        Ok(())
    }

    /// Row-major to permuted order: `dst[b, i, :] = src[b, order[i], :]`.
    pub fn apply<T: Copy>(&self, layout: &TokenLayout, src: &[T], dst: &mut [T]) -> Result<()> {
        self.check_layout(layout, &[("src", src.len()), ("dst", dst.len())])?;
        gather(&self.order, layout, src, dst);
        Ok(())
    }

    /// Permuted back to row-major order: `dst[b, order[i], :] = src[b, i, :]`.
    pub fn unapply<T: Copy>(&self, layout: &TokenLayout, src: &[T], dst: &mut [T]) -> Result<()> {
        self.check_layout(layout, &[("src", src.len()), ("dst", dst.len())])?;
        gather(&self.inverse, layout, src, dst);
        Ok(())
    }

    /// [`Permutation::apply`] in place (cycle walking, one token of scratch).
    pub fn apply_in_place<T: Copy>(&self, layout: &TokenLayout, buf: &mut [T]) -> Result<()> {
        self.check_layout(layout, &[("buf", buf.len())])?;
        gather_in_place(&self.order, layout, buf)
    }

    /// [`Permutation::unapply`] in place.
    pub fn unapply_in_place<T: Copy>(&self, layout: &TokenLayout, buf: &mut [T]) -> Result<()> {
        self.check_layout(layout, &[("buf", buf.len())])?;
        gather_in_place(&self.inverse, layout, buf)
    }

    /// [`Permutation::apply`] where the batch count is `src.len() / (len * token_len)`.
    pub fn apply_tokens<T: Copy>(&self, src: &[T], dst: &mut [T], token_len: usize) -> Result<()> {
        self.apply(&self.infer_layout(src.len(), token_len)?, src, dst)
    }

    /// [`Permutation::unapply`] where the batch count is inferred as in `apply_tokens`.
    pub fn unapply_tokens<T: Copy>(&self, src: &[T], dst: &mut [T], token_len: usize) -> Result<()> {
        self.unapply(&self.infer_layout(src.len(), token_len)?, src, dst)
    }

    /// Layout of a buffer of `len` elements holding whole `[seq, token_len]` blocks.
    pub fn infer_layout(&self, len: usize, token_len: usize) -> Result<TokenLayout> {
        let block = self
            .len()
            .checked_mul(token_len)
            .filter(|&b| b > 0)
            .ok_or(AttnError::ZeroDim { tensor: TensorName::Other("tokens"), dim: "token_len" })?;
        if len == 0 || !len.is_multiple_of(block) {
            return Err(AttnError::InvalidArgument(format!(
                "a buffer of {len} elements is not a whole number of [{} tokens x {token_len}] blocks",
                self.len()
            )));
        }
        Ok(TokenLayout { batch: len / block, seq: self.len(), token_len })
    }
}

impl Permutation {
    fn check_range(
        &self,
        range: &Range<usize>,
        batch: usize,
        token_len: usize,
        full: usize,
        part: usize,
    ) -> Result<()> {
        if range.start > range.end || range.end > self.len() {
            return Err(AttnError::InvalidArgument(format!(
                "position range {range:?} is not inside 0..{}",
                self.len()
            )));
        }
        let full_layout = TokenLayout { batch, seq: self.len(), token_len };
        self.check_layout(&full_layout, &[("full", full)])?;
        let part_len = TokenLayout { batch, seq: range.len(), token_len }.numel()?;
        check_len("part", part, part_len)
    }

    /// The tokens at sequence positions `range` only (one ring rank's chunk),
    /// gathered from a full row-major `[batch, len, token_len]` buffer:
    /// `part[b, i - range.start] = full[b, order[i]]` for `i` in `range`.
    pub fn apply_range<T: Copy>(
        &self,
        range: Range<usize>,
        batch: usize,
        token_len: usize,
        full: &[T],
        part: &mut [T],
    ) -> Result<()> {
        self.check_range(&range, batch, token_len, full.len(), part.len())?;
        let (l, n, m) = (token_len, self.len(), range.len());
        let from = &self.order[range];
        if m == 0 {
            return Ok(());
        }
        for (src, dst) in full.chunks_exact(n * l).zip(part.chunks_exact_mut(m * l)) {
            for (o, &f) in dst.chunks_exact_mut(l).zip(from) {
                o.copy_from_slice(&src[f * l..f * l + l]);
            }
        }
        Ok(())
    }

    /// Scatter a chunk back: `full[b, order[i]] = part[b, i - range.start]` for
    /// `i` in `range` (other tokens of `full` are left as they are).
    pub fn unapply_range<T: Copy>(
        &self,
        range: Range<usize>,
        batch: usize,
        token_len: usize,
        part: &[T],
        full: &mut [T],
    ) -> Result<()> {
        self.check_range(&range, batch, token_len, full.len(), part.len())?;
        let (l, n, m) = (token_len, self.len(), range.len());
        let to = &self.order[range];
        if m == 0 {
            return Ok(());
        }
        for (src, dst) in part.chunks_exact(m * l).zip(full.chunks_exact_mut(n * l)) {
            for (row, &t) in src.chunks_exact(l).zip(to) {
                dst[t * l..t * l + l].copy_from_slice(row);
            }
        }
        Ok(())
    }
}

fn check_len(name: &'static str, got: usize, expected: usize) -> Result<()> {
    if got != expected {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::Other(name),
            expected: vec![expected],
            got: vec![got],
        });
    }
    Ok(())
}

/// `dst[b, i] = src[b, from[i]]`, one row copy per token.
fn gather<T: Copy>(from: &[usize], layout: &TokenLayout, src: &[T], dst: &mut [T]) {
    let l = layout.token_len;
    let block = layout.seq * l;
    for (s, d) in src.chunks_exact(block).zip(dst.chunks_exact_mut(block)) {
        if l == 1 {
            for (o, &f) in d.iter_mut().zip(from) {
                *o = s[f];
            }
        } else {
            for (o, &f) in d.chunks_exact_mut(l).zip(from) {
                o.copy_from_slice(&s[f * l..f * l + l]);
            }
        }
    }
}

/// In-place `buf[b, i] = old[b, from[i]]` by walking each cycle once.
fn gather_in_place<T: Copy>(from: &[usize], layout: &TokenLayout, buf: &mut [T]) -> Result<()> {
    let (n, l) = (layout.seq, layout.token_len);
    let mut scratch: Vec<T> = try_vec(l)?;
    let mut visited: Vec<u64> = try_vec(n.div_ceil(64))?;
    for block in buf.chunks_exact_mut(n * l) {
        visited.clear();
        visited.resize(n.div_ceil(64), 0);
        for start in 0..n {
            if visited[start / 64] >> (start % 64) & 1 == 1 {
                continue;
            }
            visited[start / 64] |= 1 << (start % 64);
            if from[start] == start {
                continue;
            }
            scratch.clear();
            scratch.extend_from_slice(&block[start * l..start * l + l]);
            let mut j = start;
            loop {
                let k = from[j];
                if k == start {
                    block[j * l..j * l + l].copy_from_slice(&scratch);
                    break;
                }
                block.copy_within(k * l..k * l + l, j * l);
                visited[k / 64] |= 1 << (k % 64);
                j = k;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_non_permutations() {
        assert!(matches!(Permutation::from_order(vec![]), Err(AttnError::ZeroDim { .. })));
        assert!(matches!(Permutation::from_order(vec![0, 0]), Err(AttnError::InvalidArgument(_))));
        assert!(matches!(Permutation::from_order(vec![0, 2]), Err(AttnError::InvalidArgument(_))));
        let p = Permutation::from_order(vec![2, 0, 1]).unwrap();
        assert_eq!(p.inverse_order(), &[1, 2, 0]);
        assert!(p.after(&p.inverse()).unwrap().is_identity());
    }

    #[test]
    fn layout_errors_are_typed() {
        let p = Permutation::from_order(vec![1, 0]).unwrap();
        let (src, mut dst) = (vec![1.0f32; 8], vec![0.0f32; 6]);
        assert!(matches!(p.apply_tokens(&src, &mut dst, 2), Err(AttnError::ShapeMismatch { .. })));
        assert!(matches!(p.apply_tokens(&src, &mut dst, 0), Err(AttnError::ZeroDim { .. })));
        assert!(matches!(p.apply_tokens(&src[..6], &mut dst, 4), Err(AttnError::InvalidArgument(_))));
        let bad = TokenLayout { batch: 1, seq: 3, token_len: 2 };
        assert!(matches!(p.apply(&bad, &src[..6], &mut dst), Err(AttnError::ShapeMismatch { .. })));
        assert!(matches!(TokenLayout::bse(0, 2, 2), Err(AttnError::ZeroDim { .. })));
        assert!(matches!(TokenLayout::bse(usize::MAX, 2, 2), Err(AttnError::ShapeOverflow { .. })));
    }

    #[test]
    fn gathers_rows_and_restores_them() {
        let p = Permutation::from_order(vec![2, 0, 1]).unwrap();
        let src: Vec<u32> = (0..12).collect(); // batch 2, 3 tokens of 2
        let mut dst = vec![0; 12];
        p.apply_tokens(&src, &mut dst, 2).unwrap();
        assert_eq!(dst, vec![4, 5, 0, 1, 2, 3, 10, 11, 6, 7, 8, 9]);
        let mut back = vec![0; 12];
        p.unapply_tokens(&dst, &mut back, 2).unwrap();
        assert_eq!(back, src);
        let mut inplace = src.clone();
        let layout = p.infer_layout(12, 2).unwrap();
        p.apply_in_place(&layout, &mut inplace).unwrap();
        assert_eq!(inplace, dst);
        p.unapply_in_place(&layout, &mut inplace).unwrap();
        assert_eq!(inplace, src);
    }

    #[test]
    fn ranges_gather_and_scatter_chunks() {
        let p = Permutation::from_order(vec![3, 1, 0, 2]).unwrap();
        let full: Vec<u32> = (0..8).collect(); // batch 2, 4 tokens of 1
        let mut part = vec![0; 4];
        p.apply_range(1..3, 2, 1, &full, &mut part).unwrap();
        assert_eq!(part, vec![1, 0, 5, 4]);
        let mut back = vec![9; 8];
        p.unapply_range(1..3, 2, 1, &part, &mut back).unwrap();
        assert_eq!(back, vec![0, 1, 9, 9, 4, 5, 9, 9]);
        assert!(matches!(p.apply_range(2..5, 2, 1, &full, &mut part), Err(AttnError::InvalidArgument(_))));
        assert!(matches!(p.apply_range(0..3, 2, 1, &full, &mut part), Err(AttnError::ShapeMismatch { .. })));
        assert!(p.apply_range(2..2, 2, 1, &full, &mut []).is_ok());
    }
}
