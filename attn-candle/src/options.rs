//! [`AttnOptions`] (the config and owned masks of a call, from `attn-core`) and a key
//! padding mask read from a candle tensor.

pub use attn_core::AttnOptions;
use attn_core::{AttnError, KeyPaddingMask, TensorName};
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
