//! The rows a piece works on: selected rows of one segment addressed by element offsets,
//! with their global positions, and what the kernels of a piece share (plain data).

use attn_core::Element;

use crate::isa::Isa;

/// What every kernel of a piece shares: the kernel flavour, the softmax scale, the head
/// dim and causality.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PieceSpec {
    pub isa: Isa,
    pub scale: f32,
    pub d: usize,
    pub causal: bool,
}

/// A piece's query, key and value rows (the selected rows of one pattern segment).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Piece<'p, 'a, T> {
    pub q: &'p PieceRows<'a, T>,
    pub k: &'p PieceRows<'a, T>,
    pub v: &'p PieceRows<'a, T>,
}

/// Rows addressed by element offsets into `data`, with their global positions
/// (ascending inside a piece).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PieceRows<'a, T> {
    pub data: &'a [T],
    pub offsets: &'a [usize],
    pub pos: &'a [usize],
}

impl<T: Element> PieceRows<'_, T> {
    #[inline]
    pub fn len(&self) -> usize {
        self.offsets.len()
    }
    #[inline]
    pub fn row(&self, i: usize, d: usize) -> &[T] {
        &self.data[self.offsets[i]..self.offsets[i] + d]
    }
}

/// Number of keys (ascending positions) that some query up to `last_q` can see.
pub(crate) fn keys_needed(kpos: &[usize], causal: bool, last_q: usize) -> usize {
    if causal { kpos.partition_point(|&p| p <= last_q) } else { kpos.len() }
}
