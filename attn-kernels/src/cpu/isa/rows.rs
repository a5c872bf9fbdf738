//! The rows a piece works on: selected rows of one segment addressed by element offsets,
//! with their global positions, and what the kernels of a piece share (plain data).

use std::ops::Range;

use attn_core::{Band, Element};

use crate::cpu::isa::Isa;

/// What every kernel of a piece shares: the kernel flavour, the softmax scale, the head
/// dim and the band of keys each query may see (causal, full or a sliding window).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PieceSpec {
    pub isa: Isa,
    pub scale: f32,
    pub d: usize,
    pub band: Band,
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

impl<'a, T> PieceRows<'a, T> {
    /// Rows `range` of these rows.
    pub fn slice(&self, range: Range<usize>) -> PieceRows<'a, T> {
        PieceRows { data: self.data, offsets: &self.offsets[range.clone()], pos: &self.pos[range] }
    }
}

/// Index range of the keys (ascending positions `kpos`) that some query at a position in
/// `first_q..=last_q` may see under `band`.
#[inline]
pub(crate) fn key_span(kpos: &[usize], band: Band, first_q: usize, last_q: usize) -> Range<usize> {
    let lo = if band.has_left_edge() { band.visible(kpos, first_q).start } else { 0 };
    let hi = if band.has_right_edge() { band.visible(kpos, last_q).end } else { kpos.len() };
    lo..hi.max(lo)
}

/// Index range of the queries (ascending positions `qpos`) that may see some key at a
/// position in `first_k..=last_k` under `band`.
#[inline]
pub(crate) fn query_span(qpos: &[usize], band: Band, first_k: usize, last_k: usize) -> Range<usize> {
    let lo = if band.has_right_edge() { band.seen_by(qpos, first_k).start } else { 0 };
    let hi = if band.has_left_edge() { band.seen_by(qpos, last_k).end } else { qpos.len() };
    lo..hi.max(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_cover_exactly_the_admitted_pairs() {
        let pos: Vec<usize> = (0..60).filter(|p| p % 4 != 2).collect();
        for band in [Band::FULL, Band::CAUSAL, Band::new(3, 0), Band::new(2, 5), Band::new(0, 0)] {
            for a in 0..62 {
                for b in a..62 {
                    let want: Vec<usize> =
                        (0..pos.len()).filter(|&i| (a..=b).any(|q| band.admits(q, pos[i]))).collect();
                    let got: Vec<usize> = key_span(&pos, band, a, b).collect();
                    // The span is contiguous and holds every admitted key; the kernels mask the rest.
                    assert!(want.iter().all(|i| got.contains(i)), "{band:?} keys of {a}..={b}");
                    if let (Some(f), Some(l)) = (want.first(), want.last()) {
                        assert_eq!((got[0], *got.last().unwrap()), (*f, *l), "{band:?} keys of {a}..={b}");
                    }
                    let want: Vec<usize> =
                        (0..pos.len()).filter(|&i| (a..=b).any(|k| band.admits(pos[i], k))).collect();
                    let got: Vec<usize> = query_span(&pos, band, a, b).collect();
                    assert!(want.iter().all(|i| got.contains(i)), "{band:?} queries of {a}..={b}");
                    if let (Some(f), Some(l)) = (want.first(), want.last()) {
                        assert_eq!((got[0], *got.last().unwrap()), (*f, *l), "{band:?} queries of {a}..={b}");
                    }
                }
            }
        }
    }
}
