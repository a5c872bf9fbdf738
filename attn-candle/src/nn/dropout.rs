//! Dropout as `attn-multihead` draws it: in training, the seeded inverted-dropout mask of
//! one site over the rows' global positions, so a candle module in training mode
//! computes what the native layer computes with the same seed.

use attn_multihead::{DropoutSite, Mode, site_mask};
use candle_core::{Result, Tensor};

/// `x` `[batch, seq, width]` times the mask of `site` (rows at `positions`), or `x`
/// itself in evaluation or with `p == 0`.
pub(crate) fn dropout(x: &Tensor, mode: Mode, p: f64, site: DropoutSite, positions: &[usize]) -> Result<Tensor> {
    let (batch, seq, width) = x.dims3()?;
    if positions.len() != seq {
        return Err(crate::to_candle(attn_core::AttnError::InvalidArgument(format!(
            "dropout over {seq} rows was given {} positions",
            positions.len()
        ))));
    }
    match site_mask::<f32>(mode, p, site, batch, positions, width) {
        None => Ok(x.clone()),
        Some(mask) => x.mul(&Tensor::from_vec(mask, (batch, seq, width), x.device())?.to_dtype(x.dtype())?),
    }
}
