//! Sizes and plain state the bf16 pair engines share: block and tile constants, the
//! padded geometry of a piece and the online-softmax state of one query row.

use attn_core::Element;

/// Queries per block (tile rows).
pub(super) const QB: usize = 16;
/// Keys per softmax step (four 16-key score tiles).
pub(super) const KS: usize = 64;
/// bf16 elements per tile row (64 bytes): keys per `p·v` chunk, dims per `q·k` chunk.
pub(super) const KC: usize = 32;
/// Widest head the tile path takes (`pack_keys` stages one row of pairs on the stack);
/// wider heads run on the f32 kernel.
pub(super) const MAX_HEAD_DIM: usize = 512;
/// bf16 pairs (u32) in one 16 x 64-byte tile.
pub(super) const TILE: usize = 256;

/// The 16 stored bits of an element known to be bf16.
#[inline(always)]
pub(super) fn bits<T: Element>(x: T) -> u16 {
    x.to_bits() as u16
}

/// Online-softmax state of one query row (base 2, scores already scaled).
#[derive(Debug, Clone, Copy)]
pub(super) struct RowState {
    /// Running maximum (moved lazily, see `LAZY_RESCALE`).
    pub(super) m: f32,
    /// Lane-wise partial sums of the probabilities (before their rounding to bf16).
    pub(super) l: [f32; 16],
}

impl Default for RowState {
    fn default() -> Self {
        RowState { m: f32::NEG_INFINITY, l: [0.0; 16] }
    }
}

impl RowState {
    /// The row's probability sum (fixed summation order).
    pub(super) fn sum(&self) -> f32 {
        self.l.iter().sum()
    }
}

/// How far (log2) a score may pass the running maximum before the row is rescaled:
/// probabilities stay below `2^LAZY_RESCALE`, far inside f32 and bf16 range, and most
/// steps need no rescaling of the output accumulator.
pub(super) const LAZY_RESCALE: f32 = 8.0;

/// Padded sizes of one piece.
#[derive(Debug, Clone, Copy)]
pub(super) struct Geometry {
    /// `d` rounded up to 32 (the `q·k` inner dimension, in `KC` chunks).
    pub(super) dq: usize,
    /// `d` rounded up to 16 (output columns, in 16-wide tiles).
    pub(super) dv: usize,
    /// Key steps of `KS` keys.
    pub(super) steps: usize,
}

impl Geometry {
    pub(super) fn new(d: usize, nk: usize) -> Self {
        Geometry { dq: d.next_multiple_of(KC), dv: d.next_multiple_of(16), steps: nk.div_ceil(KS) }
    }
    /// Inner-dimension chunks of `q·k`.
    pub(super) fn qc(&self) -> usize {
        self.dq / KC
    }
    /// 16-wide output tiles.
    pub(super) fn ne(&self) -> usize {
        self.dv / 16
    }
    /// Offset (in bf16 pairs) of the key tile (step `t`, dim chunk `c`, 16-key group `g`).
    pub(super) fn k_tile(&self, t: usize, c: usize, g: usize) -> usize {
        ((t * self.qc() + c) * 4 + g) * TILE
    }
    /// Offset (in bf16 pairs) of the value tile (step `t`, key chunk `kc`, output tile `e`).
    pub(super) fn v_tile(&self, t: usize, kc: usize, e: usize) -> usize {
        ((t * 2 + kc) * self.ne() + e) * TILE
    }
}
