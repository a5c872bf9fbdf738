//! `Call`: what one forward call of a layer runs on besides its input: sizes, mode, masks, cross-attention keys, which rows a ring rank holds.
//!
//! One struct instead of a method per combination: every layer type of the crate
//! (`MultiheadDilatedAttention`, the encoder layer and stack, the token-order
//! wrappers) takes `forward(x, &Call)`, `forward_into(x, &Call, ws, out)` and
//! `forward_train(x, &Call)`; a layer refuses with a typed error what it cannot run
//! (cross-attention in an encoder, masks through a token order).
//!
//! ```
//! use std::sync::Arc;
//! use attn_core::DilatedConfig;
//! use attn_multihead::{Call, Cross, Mode, MultiheadConfig, MultiheadDilatedAttention, ReferenceBackend};
//! # fn main() -> attn_core::Result<()> {
//! let cfg = MultiheadConfig::new(16, 2, DilatedConfig::new(&[4, 8], &[1, 2])?);
//! let layer = MultiheadDilatedAttention::<f32>::new(cfg, 7, Arc::new(ReferenceBackend))?;
//! // Queries [2, 8, 16] attending to keys and values [2, 5, 16], training with dropout seed 7.
//! let (query, kv) = (vec![0.5f32; 2 * 8 * 16], vec![0.25f32; 2 * 5 * 16]);
//! let call = Call::new(2, 8).mode(Mode::Train { seed: 7 }).cross(Cross::new(&kv, &kv, 5));
//! let (y, cache) = layer.forward_train(&query, &call)?;
//! let mut grads = layer.zero_grads();
//! let g = layer.backward(&cache, &y, &mut grads)?;
//! assert_eq!((y.len(), g.key.map(|k| k.len())), (query.len(), Some(kv.len())));
//! # Ok(()) }
//! ```

use attn_core::{AttnError, Feature, Masks, Result};
use attn_hilbert::Grid;

use crate::dropout::Mode;

/// Which rows a rank of an `OrderedRing` passes and gets back. Every other layer takes
/// the rows its backend expects (a ring rank's own rows on a `RingBackend`) and
/// ignores this.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RankRows {
    /// The whole row-major grid, on every rank.
    #[default]
    Whole,
    /// This rank's rows (`OrderedRing::tokens`, ascending).
    Split,
}

/// How long the keys of a cross-attention call are: a row count, or (for a token
/// order) the grid whose row-major tokens they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyRows {
    Seq(usize),
    Grid(Grid),
}

impl KeyRows {
    /// The number of key rows.
    pub fn len(&self) -> usize {
        match self {
            KeyRows::Seq(n) => *n,
            KeyRows::Grid(g) => g.len(),
        }
    }

    /// Whether there are no key rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The keys and values of a cross-attention call: `[batch, kv_seq, embed]` each, from
/// another sequence (of its own length).
#[derive(Debug)]
pub struct Cross<'a, F> {
    pub key: &'a [F],
    pub value: &'a [F],
    pub rows: KeyRows,
}

// Borrows only: copyable whatever `F` is (a derive would ask `F: Copy`).
impl<F> Clone for Cross<'_, F> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<F> Copy for Cross<'_, F> {}

impl<F> Clone for Call<'_, F> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<F> Copy for Call<'_, F> {}

impl<'a, F> Cross<'a, F> {
    /// Keys and values of `kv_seq` rows.
    pub fn new(key: &'a [F], value: &'a [F], kv_seq: usize) -> Self {
        Cross { key, value, rows: KeyRows::Seq(kv_seq) }
    }

    /// Keys and values over the row-major tokens of `grid` (an `OrderedAttention` orders
    /// them along its curve on that grid).
    pub fn on_grid(key: &'a [F], value: &'a [F], grid: Grid) -> Self {
        Cross { key, value, rows: KeyRows::Grid(grid) }
    }

    /// The key rows.
    pub fn kv_seq(&self) -> usize {
        self.rows.len()
    }
}

/// One forward call: `batch` and `seq` (the rows of `x`, the queries), the mode
/// (inference, or training with dropout), the masks, cross-attention inputs and the
/// rows a ring rank holds. [`Call::new`] is self-attention in [`Mode::Eval`] without masks.
#[derive(Debug)]
pub struct Call<'a, F> {
    pub batch: usize,
    pub seq: usize,
    pub mode: Mode,
    /// Key padding (`[batch, kv rows]`, `true` = padding, as
    /// `torch.nn.MultiheadAttention`'s `key_padding_mask`; with a ring backend, this
    /// rank's rows), packed sequences (`cu_seqlens`, batch 1, self-attention) and a
    /// block mask.
    pub masks: Masks<'a>,
    /// Keys and values from another sequence; `None` is self-attention.
    pub cross: Option<Cross<'a, F>>,
    pub rows: RankRows,
}

impl<'a, F> Call<'a, F> {
    /// Self-attention over `[batch, seq, embed]` in [`Mode::Eval`], no masks.
    pub fn new(batch: usize, seq: usize) -> Self {
        Call { batch, seq, mode: Mode::Eval, masks: Masks::NONE, cross: None, rows: RankRows::Whole }
    }

    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    pub fn masks(mut self, masks: Masks<'a>) -> Self {
        self.masks = masks;
        self
    }

    /// Cross-attention to `cross`'s keys and values.
    pub fn cross(mut self, cross: Cross<'a, F>) -> Self {
        self.cross = Some(cross);
        self
    }

    pub fn rows(mut self, rows: RankRows) -> Self {
        self.rows = rows;
        self
    }

    /// The key rows: the cross-attention keys', else `seq`.
    pub fn kv_seq(&self) -> usize {
        self.cross.map_or(self.seq, |c| c.kv_seq())
    }

    /// The same call with another mode (a stack's layer `i` draws its own dropout masks).
    pub(crate) fn with_mode(&self, mode: Mode) -> Self {
        Call { mode, ..*self }
    }

    /// `Unsupported` on `layer` (its name) when the call is cross-attention.
    pub(crate) fn self_attention_only(&self, layer: &'static str) -> Result<()> {
        match self.cross {
            None => Ok(()),
            Some(_) => Err(AttnError::Unsupported { backend: layer, feature: Feature::CrossAttention }),
        }
    }

    /// `Unsupported` on `layer` (its name) when the call has masks.
    pub(crate) fn no_masks(&self, layer: &'static str) -> Result<()> {
        let feature = match self.masks {
            Masks { key_padding: Some(_), .. } => Feature::KeyPadding,
            Masks { packing: Some(_), .. } => Feature::Packing,
            Masks { block: Some(_), .. } => Feature::BlockMask,
            _ => return Ok(()),
        };
        Err(AttnError::Unsupported { backend: layer, feature })
    }
}
