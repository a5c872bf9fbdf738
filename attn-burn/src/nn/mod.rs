//! burn modules over the op (`#[derive(Module)]`): the MAGNETO/LongNet
//! [`MultiheadDilatedAttention`] layer, the pre-LN [`LongNetEncoderLayer`] and the
//! [`LongNetEncoder`] stack, with the PyTorch parameter names of `attn-multihead`
//! (`q_proj.weight` `[out, in]`, ..., `norm.*`; `layers.{i}.norm1.*`, `self_attn.*`,
//! `norm2.*`, `linear1.*`, `norm3.*`, `linear2.*`). Their parameters come from
//! `attn-multihead`'s containers: drawn by its MAGNETO initialisation from a seed, or read
//! from the same safetensors state_dicts it loads. `forward` is the evaluation function;
//! `forward_mode` with `Mode::Train { seed }` adds `attn-multihead`'s seeded dropout where
//! the module trains ([`SiteDropout`]). Gradients reach every parameter and input through
//! burn's autodiff and the op's exact backward.

mod dropout;
mod encoder;
mod layers;
mod multihead;
mod named;
mod params;

pub use attn_multihead::Mode;
pub use dropout::SiteDropout;
pub use encoder::{LongNetEncoder, LongNetEncoderLayer};
pub use layers::{LayerNorm, Linear};
pub use multihead::MultiheadDilatedAttention;
pub use named::{param_grads, param_values};
pub use params::ParamSource;
