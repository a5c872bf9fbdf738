//! [`AttnOptions`]: what one attention call computes beyond q, k and v: the
//! [`DilatedConfig`] (patterns or a window, mixing, causality, scale), a key padding
//! mask, packed sequences and a block mask, owned so that the candle op can keep them
//! for its backward.

use attn_core::{AttnError, BlockMaskBuf, DilatedConfig, KeyPaddingMask, Masks, OwnedMasks, Result, TensorName};
use candle_core::Tensor;

/// A key padding mask from a `[batch, key_seq]` candle tensor of any dtype; non-zero
/// marks padding.
pub fn key_padding_from_tensor(mask: &Tensor) -> candle_core::Result<KeyPaddingMask> {
    let (batch, seq) = match *mask.dims() {
        [b, s] => (b, s),
        ref d => {
            return crate::error::fail(AttnError::ShapeMismatch {
                tensor: TensorName::KeyPaddingMask,
                expected: vec![2],
                got: vec![d.len()],
            });
        }
    };
    let flags = mask.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    KeyPaddingMask::new(flags.into_iter().map(|x| x != 0.0).collect(), batch, seq).map_err(crate::error::to_candle)
}

/// The config and masks of an attention call. Grouped key/value heads need no option:
/// they follow from k and v having fewer heads than q.
#[derive(Debug, Clone)]
pub struct AttnOptions {
    pub config: DilatedConfig,
    /// Key padding, packed variable-length sequences (`[0, n0, n0 + n1, ..., total]`,
    /// batch 1) and a block mask, owned so that the op keeps them for its backward.
    pub masks: OwnedMasks,
}

impl AttnOptions {
    /// `config` without masks.
    pub fn new(config: DilatedConfig) -> Self {
        AttnOptions { config, masks: OwnedMasks::none() }
    }

    /// With a key padding mask.
    pub fn with_key_padding(mut self, mask: KeyPaddingMask) -> Self {
        self.masks = self.masks.with_key_padding(mask);
        self
    }

    /// With packed sequences (checked when the op runs against q's length).
    pub fn with_cu_seqlens(mut self, cu_seqlens: Vec<usize>) -> Result<Self> {
        self.masks = self.masks.with_cu_seqlens(cu_seqlens)?;
        Ok(self)
    }

    /// With a block mask (which (query block, key block) tiles each head keeps; its fit
    /// to q and k is checked when the op runs). The CPU kernels compute it; the CUDA
    /// path refuses it as `Unsupported`.
    pub fn with_block_mask(mut self, mask: BlockMaskBuf) -> Self {
        self.masks = self.masks.with_block_mask(mask);
        self
    }

    /// With the given masks.
    pub fn with_masks(mut self, masks: OwnedMasks) -> Self {
        self.masks = masks;
        self
    }

    /// The masks as the backends take them.
    pub fn masks(&self) -> Masks<'_> {
        self.masks.view()
    }
}

impl From<DilatedConfig> for AttnOptions {
    fn from(config: DilatedConfig) -> Self {
        AttnOptions::new(config)
    }
}
