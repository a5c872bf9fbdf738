//! Block-level attention for ring steps: attend a block of query rows to a block of
//! key/value rows, both carrying GLOBAL positions, and LSE-merge the partial result.
//!
//! Contract (shared with `attn-ring`):
//! - A [`BlockRows`] is the rows of one `(batch, head)` slice of q, k or v: row `i` is
//!   `data[i*stride .. i*stride + d]`, at global position `pos[i]`. Positions should be
//!   ascending (any order is accepted; ascending is fastest).
//! - A [`Block`] is one pattern's query rows against key/value rows; query `qp` sees key
//!   `kp` exactly when both are selected by the pattern in the same segment, the band
//!   admits the pair, the key is not padding, and (packed sequences) both lie in the
//!   same sequence, the pattern then applying to positions relative to its start.
//! - A block mask ([`HeadBlockMask`]) removes the (query, key) pairs of the tiles its
//!   batch row and head do not keep, as a function of positions; removed tiles are
//!   never computed.
//! - [`attend_block`] merges its result into an f32 partial `(out, lse)` with the LSE
//!   merge (`out` normalised, `lse = -inf` meaning "nothing yet"), so calling it for
//!   several key blocks, or for several patterns of one LongNet head, in any order gives
//!   the attention over the union of those keys. The caller applies the head's
//!   `out_scale` when writing the final output.
//! - [`attend_block_backward`] accumulates (`+=`) f32 gradients of one block into
//!   [`BlockGradients`] given the [`Upstream`] of its query rows: the head's FINAL lse,
//!   the grad_out rows (any [`Element`], read in place) with the factor that makes them
//!   `grad_out_eff = out_scale * grad_out`, and `delta = dot(grad_out, out) - grad_lse`
//!   (final, scaled output; `grad_lse` the gradient into the LSE, where one reaches it).
//!
//! All arithmetic is f32 (inputs of any [`Element`] are converted on load).

use attn_core::error::TensorName;
use attn_core::{AttnError, Band, BlockMask, Element, PackedSequences, Result, SegmentPattern};

use crate::cpu::isa::Isa;
use crate::cpu::isa::rows::PieceSpec;
use crate::cpu::schedule::block_split::HeadBlocks;
use crate::cpu::schedule::piece::{self, BlockGrads, Strided};

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

/// One pattern's attention of a block of query rows onto a block of key/value rows.
#[derive(Debug, Clone, Copy)]
pub struct Block<'a, T> {
    pub pattern: &'a SegmentPattern,
    /// Which keys a query sees by distance: [`Band::CAUSAL`], [`Band::FULL`] or a window
    /// (`DilatedConfig::band`).
    pub band: Band,
    pub scale: f32,
    pub head_dim: usize,
    pub q: BlockRows<'a, T>,
    pub k: BlockRows<'a, T>,
    pub v: BlockRows<'a, T>,
    /// The key padding of the block's batch row, indexed by global key position (`true`
    /// = padding: never attended). It must cover every key position of the block.
    pub key_padding: Option<&'a [bool]>,
    /// Packed sequences over the global positions: a row's pattern position is relative
    /// to its sequence, and no query sees another sequence.
    pub packing: Option<PackedSequences<'a>>,
    /// The block mask of the block's batch row and query head: query `qp` sees key `kp`
    /// only where it keeps their blocks (positions relative to the row's or packed
    /// sequence's start). Removed tiles are never computed.
    pub block_mask: Option<HeadBlockMask<'a>>,
}

/// A block mask seen from one batch row and query head (a mask of batch or heads 1
/// serves every one).
#[derive(Debug, Clone, Copy)]
pub struct HeadBlockMask<'a> {
    pub mask: BlockMask<'a>,
    pub batch: usize,
    pub head: usize,
}

impl<'a, T: Element> Block<'a, T> {
    /// A block without padding or packing.
    pub fn new(
        pattern: &'a SegmentPattern,
        band: Band,
        scale: f32,
        head_dim: usize,
        [q, k, v]: [BlockRows<'a, T>; 3],
    ) -> Self {
        Block { pattern, band, scale, head_dim, q, k, v, key_padding: None, packing: None, block_mask: None }
    }

    fn spec(&self) -> PieceSpec {
        PieceSpec { isa: Isa::detect(), scale: self.scale, d: self.head_dim, band: self.band }
    }

    /// Where rows sit: the pattern, the packing and the padding the grouping applies.
    fn rule(&self) -> piece::RowRule<'a> {
        let blocks = self.block_mask.map(|m| HeadBlocks::new(m.mask, m.batch, m.head));
        piece::RowRule { pattern: *self.pattern, packing: self.packing, key_padding: self.key_padding, blocks }
    }

    fn check(&self) -> Result<()> {
        let (scale, d) = (self.scale, self.head_dim);
        if self.pattern.w == 0 || self.pattern.r == 0 {
            return Err(AttnError::InvalidArgument(format!(
                "pattern {:?} has a zero segment length or rate",
                self.pattern
            )));
        }
        if !(scale.is_finite() && scale > 0.0) {
            return Err(AttnError::InvalidScale(scale as f64));
        }
        if d == 0 {
            return Err(AttnError::ZeroDim { tensor: TensorName::Query, dim: "head_dim" });
        }
        self.q.check(TensorName::Query, d)?;
        self.k.check(TensorName::Key, d)?;
        self.v.check(TensorName::Value, d)?;
        if self.v.rows() != self.k.rows() || self.v.pos != self.k.pos {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Value,
                expected: vec![self.k.rows()],
                got: vec![self.v.rows()],
            });
        }
        let past = |pos: &[usize], len: usize| pos.iter().copied().find(|&p| p >= len);
        if let Some(mask) = self.key_padding
            && let Some(p) = past(self.k.pos, mask.len())
        {
            return Err(AttnError::InvalidArgument(format!(
                "key position {p} is past the key padding mask's {} positions",
                mask.len()
            )));
        }
        if let Some(packing) = self.packing {
            for (rows, tensor) in [(self.q.pos, TensorName::Query), (self.k.pos, TensorName::Key)] {
                if let Some(p) = past(rows, packing.total()) {
                    return Err(AttnError::InvalidArgument(format!(
                        "{tensor} position {p} is past the {} packed positions",
                        packing.total()
                    )));
                }
            }
        }
        if let Some(m) = self.block_mask {
            self.check_block_mask(m)?;
        }
        Ok(())
    }

    /// The mask covers every row's block (positions from the row's or sequence's start)
    /// and the block's batch row and head.
    fn check_block_mask(&self, m: HeadBlockMask<'_>) -> Result<()> {
        let dims = m.mask.dims();
        if (dims.batch != 1 && m.batch >= dims.batch) || (dims.heads != 1 && m.head >= dims.heads) {
            return Err(AttnError::InvalidBlockMask(format!(
                "batch row {} and head {} are past the mask's {} x {}",
                m.batch, m.head, dims.batch, dims.heads
            )));
        }
        let rel = |p: usize| self.packing.map_or(p, |pk| p - pk.bounds(pk.sequence_of(p)).start);
        for (rows, blocks, tensor) in
            [(self.q.pos, dims.q_blocks, TensorName::Query), (self.k.pos, dims.k_blocks, TensorName::Key)]
        {
            if let Some(&p) = rows.iter().find(|&&p| rel(p) / m.mask.block_size() >= blocks) {
                return Err(AttnError::InvalidBlockMask(format!(
                    "{tensor} position {p} is past the mask's {blocks} blocks of {}",
                    m.mask.block_size()
                )));
            }
        }
        Ok(())
    }
}

/// What the backward of a block reads for its query rows besides the block: the
/// upstream gradient rows (any dtype, read in place; `grad_scale` makes them the head's
/// `out_scale * grad_out`), the head's final LSE and `delta = grad_out . out - grad_lse`.
#[derive(Debug, Clone, Copy)]
pub struct Upstream<'a, G> {
    pub grad_out: BlockRows<'a, G>,
    pub grad_scale: f32,
    pub lse: &'a [f32],
    pub delta: &'a [f32],
}

/// The f32 gradient accumulators of a block (added to): `dq` of the query rows, `dk`
/// and `dv` of the key rows, each `rows * head_dim`.
#[derive(Debug)]
pub struct BlockGradients<'a> {
    pub dq: &'a mut [f32],
    pub dk: &'a mut [f32],
    pub dv: &'a mut [f32],
}

fn check_f32(tensor: TensorName, got: usize, expected: usize) -> Result<()> {
    if got != expected {
        return Err(AttnError::ShapeMismatch { tensor, expected: vec![expected], got: vec![got] });
    }
    Ok(())
}

/// Attend the q rows to the k/v rows the block's mask admits (see the module docs) and
/// LSE-merge the result into the f32 partial `out` (`[q_rows * d]`, normalised) and `lse`
/// (`[q_rows]`, `-inf` = nothing yet).
pub fn attend_block<T: Element>(block: &Block<'_, T>, out: &mut [f32], lse: &mut [f32]) -> Result<()> {
    block.check()?;
    let d = block.head_dim;
    check_f32(TensorName::Output, out.len(), block.q.rows() * d)?;
    check_f32(TensorName::Lse, lse.len(), block.q.rows())?;
    let (q, k, v) = (block.q.strided(), block.k.strided(), block.v.strided());
    piece::forward_block(block.spec(), &block.rule(), [&q, &k, &v], out, lse);
    Ok(())
}

/// Accumulate (`+=`) the gradients of one block into `grads`, given the [`Upstream`] of
/// its query rows (the grad_out rows' positions are not read; a caller's grad_out tensor
/// is read in place, in its own dtype).
pub fn attend_block_backward<T: Element, G: Element>(
    block: &Block<'_, T>,
    upstream: &Upstream<'_, G>,
    grads: BlockGradients<'_>,
) -> Result<()> {
    block.check()?;
    let d = block.head_dim;
    let (nq, nk) = (block.q.rows(), block.k.rows());
    let Upstream { grad_out, grad_scale, lse, delta } = *upstream;
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
    let BlockGradients { dq, dk, dv } = grads;
    check_f32(TensorName::Lse, lse.len(), nq)?;
    check_f32(TensorName::Other("delta"), delta.len(), nq)?;
    check_f32(TensorName::GradQuery, dq.len(), nq * d)?;
    check_f32(TensorName::GradKey, dk.len(), nk * d)?;
    check_f32(TensorName::GradValue, dv.len(), nk * d)?;
    let (q, k, v) = (block.q.strided(), block.k.strided(), block.v.strided());
    let grads = BlockGrads { grad_out: grad_out.strided(), grad_scale, lse, delta, dq, dk, dv };
    piece::backward_block(block.spec(), &block.rule(), [&q, &k, &v], grads);
    Ok(())
}
