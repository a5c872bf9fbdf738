//! The position masks a call may add to its pattern: a key padding mask, packed
//! variable-length sequences (`cu_seqlens`) and a block mask ([`BlockMask`]). All are
//! functions of global positions, so every split of the sequence applies them with the
//! same kernels. [`Masks`] borrows them for one call; [`OwnedMasks`] keeps a checked
//! copy (a training cache, a ring problem, a framework op, a conformance file) and lends
//! it out as a [`Masks`].

use std::ops::Range;

use crate::block_mask::{BlockMask, BlockMaskBuf};
use crate::error::{AttnError, Result, TensorName};
pub use crate::packing::PackedSequences;
use crate::shape::AttnShape;

/// A `[batch, key_seq]` key padding mask, row-major, `true` = padding: a padded key is
/// never attended (PyTorch's `key_padding_mask` sense). Queries are not masked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyPadding<'a> {
    flags: &'a [bool],
    batch: usize,
    seq: usize,
}

impl<'a> KeyPadding<'a> {
    /// The mask of `batch` rows of `seq` keys; `flags.len()` must be `batch * seq`.
    pub fn new(flags: &'a [bool], batch: usize, seq: usize) -> Result<Self> {
        if batch.checked_mul(seq) != Some(flags.len()) {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::KeyPaddingMask,
                expected: vec![batch, seq],
                got: vec![flags.len()],
            });
        }
        Ok(KeyPadding { flags, batch, seq })
    }

    pub fn batch(&self) -> usize {
        self.batch
    }
    pub fn seq(&self) -> usize {
        self.seq
    }
    /// The flags, `[batch, seq]` row-major.
    pub fn flags(&self) -> &'a [bool] {
        self.flags
    }
    /// The flags of batch `b`, indexed by global key position.
    pub fn row(&self, b: usize) -> &'a [bool] {
        &self.flags[b * self.seq..(b + 1) * self.seq]
    }
    /// Whether key `pos` of batch `b` is padding.
    #[inline]
    pub fn is_padding(&self, b: usize, pos: usize) -> bool {
        self.flags[b * self.seq + pos]
    }
    /// Whether some key is padding.
    pub fn any(&self) -> bool {
        self.flags.iter().any(|&f| f)
    }
}

/// The masks of one call besides its pattern: none by default. Build one as
/// `Masks { packing, ..Masks::NONE }` so a mask added later leaves the literal valid.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Masks<'a> {
    pub key_padding: Option<KeyPadding<'a>>,
    pub packing: Option<PackedSequences<'a>>,
    /// Which (query block, key block) tiles each head keeps, ANDed with everything else.
    pub block: Option<BlockMask<'a>>,
}

impl<'a> Masks<'a> {
    /// No padding, one sequence per batch row, every block kept.
    pub const NONE: Masks<'static> = Masks { key_padding: None, packing: None, block: None };

    /// Whether no mask is set.
    pub fn is_none(&self) -> bool {
        self.key_padding.is_none() && self.packing.is_none() && self.block.is_none()
    }

    /// Check the masks against the call's shapes: the padding mask is `[batch, key_seq]`;
    /// packed sequences need batch 1, self-attention, and end at the sequence length; a
    /// block mask has the call's blocks ([`BlockMask::check`]).
    pub fn check(&self, shape: &AttnShape) -> Result<()> {
        Self::check_sizes(self.key_padding.map(|m| (m.batch, m.seq)), self.packing, shape)?;
        match self.block {
            Some(b) => b.check(shape, self.packing),
            None => Ok(()),
        }
    }

    /// Whether the block mask (if any) keeps key `k` for query `q` of head `h`, batch `b`,
    /// both global positions: within a packed sequence, positions count from its start.
    #[inline]
    pub fn block_keeps(&self, b: usize, h: usize, q: usize, k: usize) -> bool {
        let Some(m) = self.block else { return true };
        match self.packing {
            Some(p) => {
                let seq = p.bounds(p.sequence_of(q));
                seq.contains(&k) && m.keeps(b, h, q - seq.start, k - seq.start)
            }
            None => m.keeps(b, h, q, k),
        }
    }

    /// [`Masks::check`] for a padding mask given by its `(batch, key_seq)` sizes (one
    /// whose flags live elsewhere, such as device memory).
    pub fn check_sizes(
        key_padding: Option<(usize, usize)>,
        packing: Option<PackedSequences<'_>>,
        shape: &AttnShape,
    ) -> Result<()> {
        if let Some((batch, seq)) = key_padding
            && (batch, seq) != (shape.kv.batch, shape.kv.seq)
        {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::KeyPaddingMask,
                expected: vec![shape.kv.batch, shape.kv.seq],
                got: vec![batch, seq],
            });
        }
        if let Some(p) = packing {
            if shape.q.batch != 1 {
                return Err(AttnError::PackedBatch { batch: shape.q.batch });
            }
            if shape.kv.seq != shape.q.seq {
                return Err(AttnError::PackedCrossAttention);
            }
            if p.total() != shape.q.seq {
                return Err(AttnError::InvalidCuSeqlens(format!(
                    "ends at {} but the packed batch has {} tokens",
                    p.total(),
                    shape.q.seq
                )));
            }
        }
        Ok(())
    }

    /// The global positions of the sequence holding `pos` in a batch row of `n`
    /// positions: its packed sequence, or the whole row.
    #[inline]
    pub fn sequence_bounds(&self, pos: usize, n: usize) -> Range<usize> {
        match self.packing {
            Some(p) => p.bounds(p.sequence_of(pos)),
            None => 0..n,
        }
    }

    /// Whether key `pos` of batch `b` is padding.
    #[inline]
    pub fn is_padding(&self, b: usize, pos: usize) -> bool {
        self.key_padding.is_some_and(|m| m.is_padding(b, pos))
    }
}

/// An owned `[batch, key_seq]` key padding mask, `true` = padding ([`KeyPadding`] is
/// its borrowed form).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyPaddingMask {
    flags: Vec<bool>,
    batch: usize,
    seq: usize,
}

impl KeyPaddingMask {
    /// A mask from row-major flags; `flags.len()` must be `batch * seq`.
    pub fn new(flags: Vec<bool>, batch: usize, seq: usize) -> Result<Self> {
        KeyPadding::new(&flags, batch, seq)?;
        Ok(KeyPaddingMask { flags, batch, seq })
    }

    /// The borrowed mask.
    pub fn view(&self) -> KeyPadding<'_> {
        KeyPadding { flags: &self.flags, batch: self.batch, seq: self.seq }
    }
}

impl From<KeyPadding<'_>> for KeyPaddingMask {
    fn from(k: KeyPadding<'_>) -> Self {
        KeyPaddingMask { flags: k.flags.to_vec(), batch: k.batch, seq: k.seq }
    }
}

/// The masks of a call, owned and checked: what [`Masks`] borrows. Each mask is set
/// through a checking constructor, so [`OwnedMasks::view`] cannot fail, and a new kind of
/// mask joins as one more private field with its own `with_` constructor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnedMasks {
    key_padding: Option<KeyPaddingMask>,
    /// Checked `cu_seqlens` ([`PackedSequences::new`] accepted them).
    cu_seqlens: Option<Vec<usize>>,
    block: Option<BlockMaskBuf>,
}

impl OwnedMasks {
    /// No masks.
    pub fn none() -> Self {
        OwnedMasks::default()
    }

    /// These masks with a key padding mask.
    pub fn with_key_padding(mut self, mask: KeyPaddingMask) -> Self {
        self.key_padding = Some(mask);
        self
    }

    /// These masks with packed sequences, checked by [`PackedSequences::new`].
    pub fn with_cu_seqlens(mut self, cu_seqlens: Vec<usize>) -> Result<Self> {
        PackedSequences::new(&cu_seqlens)?;
        self.cu_seqlens = Some(cu_seqlens);
        Ok(self)
    }

    /// These masks with a block mask, whose sizes and values its constructors checked;
    /// its fit to a call's blocks is checked with the call ([`Masks::check`]).
    pub fn with_block_mask(mut self, mask: BlockMaskBuf) -> Self {
        self.block = Some(mask);
        self
    }

    /// The block mask, if set.
    pub fn block_mask(&self) -> Option<&BlockMaskBuf> {
        self.block.as_ref()
    }

    /// The key padding mask, if set.
    pub fn key_padding(&self) -> Option<&KeyPaddingMask> {
        self.key_padding.as_ref()
    }

    /// The packed sequences' offsets, if set.
    pub fn cu_seqlens(&self) -> Option<&[usize]> {
        self.cu_seqlens.as_deref()
    }

    /// Whether no mask is set.
    pub fn is_none(&self) -> bool {
        self.view().is_none()
    }

    /// The masks as one call borrows them.
    pub fn view(&self) -> Masks<'_> {
        Masks {
            key_padding: self.key_padding.as_ref().map(KeyPaddingMask::view),
            packing: self.cu_seqlens.as_deref().map(PackedSequences::from_checked),
            block: self.block.as_ref().map(BlockMaskBuf::view),
        }
    }
}

impl From<Masks<'_>> for OwnedMasks {
    /// An owned copy of borrowed masks.
    fn from(m: Masks<'_>) -> Self {
        OwnedMasks {
            key_padding: m.key_padding.map(KeyPaddingMask::from),
            cu_seqlens: m.packing.map(|p| p.cu_seqlens().to_vec()),
            block: m.block.map(BlockMaskBuf::from),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::{AttnShape, Shape4};

    #[test]
    fn cu_seqlens_rules() {
        for bad in [&[][..], &[0], &[1, 4], &[0, 3, 3, 5], &[0, 4, 2]] {
            assert!(matches!(PackedSequences::new(bad), Err(AttnError::InvalidCuSeqlens(_))), "{bad:?}");
        }
        let p = PackedSequences::new(&[0, 3, 4, 9]).unwrap();
        assert_eq!((p.count(), p.total(), p.bounds(2)), (3, 9, 4..9));
        let seqs: Vec<usize> = (0..9).map(|x| p.sequence_of(x)).collect();
        assert_eq!(seqs, [0, 0, 0, 1, 2, 2, 2, 2, 2]);
        assert_eq!(p.iter().collect::<Vec<_>>(), [0..3, 3..4, 4..9]);
    }

    #[test]
    fn masks_check_against_the_shape() {
        let one = AttnShape::self_attn(Shape4::new(1, 9, 2, 4).unwrap());
        let cu = [0, 3, 9];
        let packed = Masks { packing: Some(PackedSequences::new(&cu).unwrap()), ..Masks::NONE };
        assert!(packed.check(&one).is_ok());
        assert_eq!(packed.sequence_bounds(5, 9), 3..9);
        let two = AttnShape::self_attn(Shape4::new(2, 9, 2, 4).unwrap());
        assert!(matches!(packed.check(&two), Err(AttnError::PackedBatch { batch: 2 })));
        let cross = AttnShape { q: one.q, kv: Shape4::new(1, 7, 2, 4).unwrap() };
        assert!(matches!(packed.check(&cross), Err(AttnError::PackedCrossAttention)));
        let short = AttnShape::self_attn(Shape4::new(1, 10, 2, 4).unwrap());
        assert!(matches!(packed.check(&short), Err(AttnError::InvalidCuSeqlens(_))));
        let flags = [false; 18];
        let pad = Masks { key_padding: Some(KeyPadding::new(&flags, 2, 9).unwrap()), ..Masks::NONE };
        assert!(pad.check(&two).is_ok());
        assert!(matches!(pad.check(&one), Err(AttnError::ShapeMismatch { tensor: TensorName::KeyPaddingMask, .. })));
        assert!(KeyPadding::new(&flags, 2, 8).is_err());
    }

    #[test]
    fn owned_masks_round_trip_and_check() {
        let flags = [false, true, false, false, true, true];
        let cu = [0, 2, 3];
        let borrowed = Masks {
            key_padding: Some(KeyPadding::new(&flags, 2, 3).unwrap()),
            packing: Some(PackedSequences::new(&cu).unwrap()),
            ..Masks::NONE
        };
        let owned = OwnedMasks::from(borrowed);
        assert_eq!(owned.view(), borrowed);
        assert_eq!(owned.cu_seqlens(), Some(&cu[..]));
        assert_eq!(owned.key_padding().map(|k| k.view().flags()), Some(&flags[..]));
        assert!(OwnedMasks::none().is_none() && !owned.is_none());
        assert!(matches!(OwnedMasks::none().with_cu_seqlens(vec![0, 2, 2]), Err(AttnError::InvalidCuSeqlens(_))));
        assert!(matches!(
            KeyPaddingMask::new(vec![false; 5], 2, 3),
            Err(AttnError::ShapeMismatch { tensor: TensorName::KeyPaddingMask, .. })
        ));
    }

    #[test]
    fn a_block_mask_is_checked_with_the_call_and_owned_alike() {
        use crate::block_mask::BlockDims;
        let dims = |q_blocks, k_blocks| BlockDims { batch: 1, heads: 1, q_blocks, k_blocks };
        let one = AttnShape::self_attn(Shape4::new(1, 9, 2, 4).unwrap());
        let fits = BlockMaskBuf::from_fn(dims(3, 3), 4, |_, _, i, j| j <= i).unwrap();
        let masks = Masks { block: Some(fits.view()), ..Masks::NONE };
        assert!(masks.check(&one).is_ok() && !masks.is_none());
        assert!(masks.block_keeps(0, 1, 4, 3) && !masks.block_keeps(0, 1, 3, 4));
        let off = BlockMaskBuf::from_fn(dims(2, 3), 4, |_, _, _, _| true).unwrap();
        let misfit = Masks { block: Some(off.view()), ..Masks::NONE };
        assert!(matches!(misfit.check(&one), Err(AttnError::InvalidBlockMask(_))));
        // Packed: sequences [0, 3) and [3, 9), each from its own start, blocks of the longest.
        let cu = [0, 3, 9];
        let packed =
            Masks { packing: Some(PackedSequences::new(&cu).unwrap()), block: Some(off.view()), ..Masks::NONE };
        assert!(matches!(packed.check(&one), Err(AttnError::InvalidBlockMask(_))));
        let square = BlockMaskBuf::from_fn(dims(2, 2), 4, |_, _, i, j| j <= i).unwrap();
        let packed = Masks { block: Some(square.view()), ..packed };
        assert!(packed.check(&one).is_ok());
        assert!(packed.block_keeps(0, 0, 7, 3) && !packed.block_keeps(0, 0, 3, 7) && !packed.block_keeps(0, 0, 4, 2));
        let owned = OwnedMasks::none().with_block_mask(square.clone());
        assert_eq!(owned.view().block, Some(square.view()));
        assert_eq!(OwnedMasks::from(packed).block_mask(), Some(&square));
        assert!(!owned.is_none());
    }
}
