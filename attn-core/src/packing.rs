//! Packed variable-length sequences (`cu_seqlens`): several sequences in one batch row,
//! each its own sequence, by global position.

use std::ops::Range;

use crate::error::{AttnError, Result};

/// Packed variable-length sequences: `cu_seqlens = [0, n_0, n_0 + n_1, ..., total]`,
/// strictly increasing, over a `[1, total, heads, head_dim]` batch. Every sequence is
/// its own sequence: positions restart at 0 at its first token and no query sees
/// another sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedSequences<'a> {
    cu: &'a [usize],
}

impl<'a> PackedSequences<'a> {
    /// Check `cu_seqlens`: at least one sequence, starting at 0, strictly increasing.
    pub fn new(cu_seqlens: &'a [usize]) -> Result<Self> {
        let bad = |reason: String| Err(AttnError::InvalidCuSeqlens(reason));
        match cu_seqlens {
            [] | [_] => return bad(format!("{} entries; at least [0, total] is needed", cu_seqlens.len())),
            [first, ..] if *first != 0 => return bad(format!("starts at {first}, not 0")),
            _ => {}
        }
        if let Some(i) = cu_seqlens.windows(2).position(|w| w[1] <= w[0]) {
            return bad(format!(
                "entry {} ({}) is not greater than entry {i} ({}): every sequence needs a token",
                i + 1,
                cu_seqlens[i + 1],
                cu_seqlens[i]
            ));
        }
        Ok(PackedSequences { cu: cu_seqlens })
    }

    /// Offsets already checked by [`PackedSequences::new`] (an owned copy lent out again).
    pub(crate) fn from_checked(cu: &'a [usize]) -> Self {
        PackedSequences { cu }
    }

    /// The offsets `[0, ..., total]`.
    pub fn cu_seqlens(&self) -> &'a [usize] {
        self.cu
    }
    /// Number of sequences.
    pub fn count(&self) -> usize {
        self.cu.len() - 1
    }
    /// Total tokens.
    pub fn total(&self) -> usize {
        self.cu[self.cu.len() - 1]
    }
    /// Global positions of sequence `i`.
    pub fn bounds(&self, i: usize) -> Range<usize> {
        self.cu[i]..self.cu[i + 1]
    }
    /// Index of the sequence holding global position `pos` (`pos < total`).
    #[inline]
    pub fn sequence_of(&self, pos: usize) -> usize {
        self.cu.partition_point(|&c| c <= pos).saturating_sub(1).min(self.count() - 1)
    }
    /// Every sequence's global positions, in order.
    pub fn iter(&self) -> impl Iterator<Item = Range<usize>> + 'a {
        self.cu.windows(2).map(|w| w[0]..w[1])
    }
}
