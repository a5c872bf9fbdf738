//! candle-nn modules over the op: the MAGNETO/LongNet [`MultiheadDilatedAttention`]
//! layer and the [`LongNetEncoder`] stack, built from a `VarBuilder` under the same
//! PyTorch names as `attn-multihead` (`q_proj.weight` `[out, in]`, ..., `norm.*`;
//! `layers.{i}.norm1.*`, `self_attn.*`, `norm2.*`, `linear1.*`, `norm3.*`, `linear2.*`),
//! so a checkpoint saved from the Python library loads unchanged. Their [`LayerNorm`]
//! is differentiable (candle-nn's fused one has no backward). `Module::forward` computes
//! the evaluation function; the layer's `forward_with` takes a [`LayerCall`] (masks,
//! cross-attention inputs, mode) and the encoders' `forward_with_mode` a mode, where
//! `Mode::Train { seed }` applies the config's dropout with `attn-multihead`'s masks. Parameters a `VarMap` creates are
//! drawn with the definition's MAGNETO initialisation. `with_backend` computes the
//! attention through another backend, such as a ring rank.

mod dropout;
mod encoder;
mod layer_norm;
mod multihead;

pub use attn_multihead::Mode;
pub use encoder::{LongNetEncoder, LongNetEncoderLayer};
pub use layer_norm::LayerNorm;
pub use multihead::{LayerCall, MultiheadDilatedAttention};
