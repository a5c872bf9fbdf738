//! [`AttnOptions`]: what one attention call computes beyond q, k and v: the
//! [`DilatedConfig`] (patterns or a window, mixing, causality, scale) and the
//! [`OwnedMasks`] (key padding, packed sequences, a block mask), owned so that a
//! framework's op (candle's, burn's autodiff node) keeps them for its backward.

use crate::block_mask::BlockMaskBuf;
use crate::config::DilatedConfig;
use crate::error::Result;
use crate::masks::{KeyPaddingMask, Masks, OwnedMasks};

/// The config and masks of an attention call. Grouped key/value heads need no option:
/// they follow from k and v having fewer heads than q.
#[derive(Debug, Clone)]
pub struct AttnOptions {
    pub config: DilatedConfig,
    /// Key padding, packed variable-length sequences (`[0, n0, n0 + n1, ..., total]`,
    /// batch 1) and a block mask.
    pub masks: OwnedMasks,
}

impl AttnOptions {
    /// `config` without masks.
    pub fn new(config: DilatedConfig) -> Self {
        AttnOptions { config, masks: OwnedMasks::none() }
    }

    /// With a key padding mask (`true` marks padding).
    pub fn with_key_padding(mut self, mask: KeyPaddingMask) -> Self {
        self.masks = self.masks.with_key_padding(mask);
        self
    }

    /// With packed sequences (checked when the op runs against q's length).
    pub fn with_cu_seqlens(mut self, cu_seqlens: Vec<usize>) -> Result<Self> {
        self.masks = self.masks.with_cu_seqlens(cu_seqlens)?;
        Ok(self)
    }

    /// With a block mask (its fit to q and k is checked when the op runs).
    pub fn with_block_mask(mut self, mask: BlockMaskBuf) -> Self {
        self.masks = self.masks.with_block_mask(mask);
        self
    }

    /// With the given masks.
    pub fn with_masks(mut self, masks: OwnedMasks) -> Self {
        self.masks = masks;
        self
    }

    /// The masks as the kernels take them.
    pub fn masks(&self) -> Masks<'_> {
        self.masks.view()
    }
}

impl From<DilatedConfig> for AttnOptions {
    fn from(config: DilatedConfig) -> Self {
        AttnOptions::new(config)
    }
}
