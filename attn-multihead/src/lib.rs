//! Multihead dilated attention for model authors: `MultiheadDilatedAttention` (fused QKV
//! projection, dilated attention on any backend, sub-LayerNorm, output projection) with
//! forward and backward through one entry point per pass (`forward(x, &Call)`,
//! `forward_into`, `forward_train`, `backward`; the `Call` carries mode, masks,
//! cross-attention keys), safetensors weights with PyTorch names, MAGNETO init, the
//! LongNet encoder layer and stack, a ring-parallel layer, and the Hilbert option
//! (curve-ordered grid tokens) on one device and on the ring, reached from the layer
//! with `with_token_order` / `with_ring_token_order`.
//!
//! ```
//! use std::sync::Arc;
//! use attn_kernels::CpuBackend;
//! use attn_core::DilatedConfig;
//! use attn_multihead::{Call, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, load_file, save_file};
//! # fn main() -> attn_core::Result<()> {
//! let config = MultiheadConfig::new(32, 4, DilatedConfig::new(&[8, 16], &[1, 2])?); // embed 32, 4 heads
//! // A checkpoint with PyTorch names (`q_proj.weight`, ..., `out_proj.bias`).
//! let path = std::env::temp_dir().join(format!("attn-doc-{}.safetensors", std::process::id()));
//! save_file(&MultiheadWeights::<f32>::magneto(&config, 7), &path, None)?;
//!
//! let mut weights = MultiheadWeights::<f32>::magneto(&config, 0);
//! load_file(&mut weights, &path)?;
//! let layer = MultiheadDilatedAttention::from_weights(config, weights, Arc::new(CpuBackend::new(1)?))?;
//! let (batch, seq) = (1, 16);
//! let x: Vec<f32> = (0..batch * seq * 32).map(|i| (i as f32 * 0.05).sin()).collect();
//! let y = layer.forward(&x, &Call::new(batch, seq))?; // [batch, seq, embed], Mode::Eval
//! assert_eq!(y.len(), x.len());
//! # std::fs::remove_file(&path).ok();
//! # Ok(()) }
//! ```
//!
//! # Structure
//!
//! The MAGNETO/LongNet layer over any `Arc<dyn Attention<F>>`
//! (reference, `CpuBackend`, `RingBackend`; the layer asks `placement()` whether it
//! sees the whole sequence, and `query_positions` only for dropout masks on a shard).
//! It depends on core, hilbert and kernels; attn-ring and the ring glue
//! (`ring_layer`, `OrderedRing`) only with the `ring` feature. One fused QKV projection writes
//! `[b, s, 3, h, d]`, attention reads it through strided views; on one device
//! with head groups (`sparse_projection`) each group projects only the rows its
//! pattern selects (the rest stay zero; the backward skips them too) (cross-attention
//! with its own key length goes to the kernels' cross entry points; the ring
//! refuses it with a typed error), then dropout (masks a function of seed, site
//! and GLOBAL token position, which the backend reports, so every split draws
//! the same mask), sub-LayerNorm and the output projection. Backward reverses each stage.
//! `NormLayout::QkLn` (the development line's layer) normalises q and k in the projection
//! buffers (`q_ln`, `k_ln`) and uses `q_ln` again in place of the sub-LayerNorm; the
//! row-sparse projection is off there, since `q_ln` reads every head of a row.
//! Every forward buffer lives in a `MultiheadWorkspace` (`forward_into`; `forward` makes a
//! fresh one), which remembers the selection whose unwritten projection rows are zero.
//! Inference and the self-attention backward (`layer/backward.rs`) on one device walk
//! long sequences in windows (`segment_window`: a multiple of every segment length,
//! default at least 8192 rows), so their buffers hold one window; `forward_train` keeps
//! every row, since the backward reads them. `LongNetEncoder::forward` in eval walks
//! such windows through the whole stack (`forward_windows`), feed-forward included.
//! Parameters carry PyTorch names (`NamedParams`), which drive safetensors I/O,
//! gradient checks and the ring all-reduce. `LongNetEncoder` stacks pre-LN
//! layers with MAGNETO gains; `OrderedAttention` applies a Hilbert/Z order on one
//! device (self- and cross-attention) and `OrderedRing` on the ring, both reached
//! from the layer (`with_token_order`, `with_ring_token_order`): the ring's global
//! sequence is the grid in curve order, so each rank attends over a compact
//! spatial patch while callers keep row-major tensors. `metadata` reads the layer config a
//! conformance file's metadata describes; running the files is attn-golden's.
#![deny(unsafe_code)]

pub mod call;
pub mod config;
pub mod dropout;
pub mod encoder;
pub mod float;
pub mod init;
pub mod layer;
pub mod layer_norm;
#[allow(unsafe_code)]
mod matmul;
pub mod metadata;
#[cfg(feature = "ring")]
pub mod ordered_ring;
pub mod projection;
mod qk_pre;
#[cfg(feature = "ring")]
pub mod ring_layer;
pub mod segment_window;
mod sparse_projection;
pub mod token_order;
pub mod weights;
pub mod weights_io;
pub mod workspace;

pub use attn_core::{Attention, ReferenceBackend};
pub use call::{Call, Cross, KeyRows, RankRows};
pub use config::{LayerNorms, MultiheadConfig, NormLayout};
pub use dropout::{DropoutSite, Mode, site_mask};
pub use encoder::{
    EncoderCache, EncoderConfig, EncoderLayerCache, EncoderLayerGrads, LongNetEncoder, LongNetEncoderLayer, layer_mode,
};
pub use float::LayerFloat;
pub use init::{MagnetoGains, SeededRng};
pub use layer::{InputGrads, MultiheadCache, MultiheadDilatedAttention};
pub use layer_norm::{LayerNorm, NormStats};
#[cfg(feature = "ring")]
pub use ordered_ring::{OrderedRing, OrderedRingCache};
pub use projection::{Bias, Linear};
#[cfg(feature = "ring")]
pub use ring_layer::{all_reduce_grads, ring_layer};
pub use segment_window::DEFAULT_WINDOW_ROWS;
pub use token_order::{OrderedAttention, OrderedCache};
pub use weights::{MultiheadWeights, NamedParams, Param, ParamMut};
pub use weights_io::{
    ExtraTensors, F32Tensors, TensorSource, load_bytes, load_file, load_params, save_bytes, save_file,
};
pub use workspace::MultiheadWorkspace;
