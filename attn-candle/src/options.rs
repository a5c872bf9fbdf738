//! [`AttnOptions`]: what one attention call computes beyond q, k and v: the
//! [`DilatedConfig`] (patterns or a window, mixing, causality, scale), a key padding
//! mask and packed sequences, owned so that the candle op can keep them for its
//! backward.

use attn_core::{AttnError, DilatedConfig, KeyPadding, Masks, PackedSequences, Result, TensorName};
use candle_core::Tensor;

/// A key padding mask, `[batch, key_seq]`, `true` marking a padded key (PyTorch's
/// convention).
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

    /// A mask from a `[batch, key_seq]` candle tensor of any dtype; non-zero marks padding.
    pub fn from_tensor(mask: &Tensor) -> candle_core::Result<Self> {
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
        Self::new(flags.into_iter().map(|x| x != 0.0).collect(), batch, seq).map_err(crate::error::to_candle)
    }

    fn view(&self) -> Result<KeyPadding<'_>> {
        KeyPadding::new(&self.flags, self.batch, self.seq)
    }
}

/// The config and masks of an attention call. Grouped key/value heads need no option:
/// they follow from k and v having fewer heads than q.
#[derive(Debug, Clone)]
pub struct AttnOptions {
    pub config: DilatedConfig,
    pub key_padding: Option<KeyPaddingMask>,
    /// Packed variable-length sequences (`[0, n0, n0 + n1, ..., total]`, batch 1).
    pub cu_seqlens: Option<Vec<usize>>,
}

impl AttnOptions {
    /// `config` without masks.
    pub fn new(config: DilatedConfig) -> Self {
        AttnOptions { config, key_padding: None, cu_seqlens: None }
    }

    /// With a key padding mask.
    pub fn with_key_padding(mut self, mask: KeyPaddingMask) -> Self {
        self.key_padding = Some(mask);
        self
    }

    /// With packed sequences (checked when the op runs against q's length).
    pub fn with_cu_seqlens(mut self, cu_seqlens: Vec<usize>) -> Result<Self> {
        PackedSequences::new(&cu_seqlens)?;
        self.cu_seqlens = Some(cu_seqlens);
        Ok(self)
    }

    /// The masks as the backends take them.
    pub fn masks(&self) -> Result<Masks<'_>> {
        let key_padding = self.key_padding.as_ref().map(KeyPaddingMask::view).transpose()?;
        let packing = self.cu_seqlens.as_deref().map(PackedSequences::new).transpose()?;
        Ok(Masks { key_padding, packing })
    }
}

impl From<DilatedConfig> for AttnOptions {
    fn from(config: DilatedConfig) -> Self {
        AttnOptions::new(config)
    }
}
