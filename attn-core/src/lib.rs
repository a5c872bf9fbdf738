//! Core of `attn`: configuration, typed errors, tensor shapes and views, pattern
//! math as functions of global positions, the LSE merge, and the float64 reference.
//!
//! Everything here follows the definition (`docs/definition.md` in the repository); the
//! fast backends in `attn-kernels` and the ring strategies in `attn-ring` are checked
//! against [`mod@reference`].
//!
//! ```
//! use attn_core::{AttnShape, DilatedConfig, Mixing, Shape4, reference};
//! # fn main() -> attn_core::Result<()> {
//! // Two patterns: segments of 4 rows densely, and of 8 rows every second row.
//! let cfg = DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).mixing(Mixing::LongNet).build()?;
//! let shape = Shape4::new(1, 8, 2, 4)?; // [batch, seq, heads, head_dim]
//! let x: Vec<f64> = (0..shape.numel()).map(|i| (i as f64 * 0.37).sin()).collect();
//! let fwd = reference::dilated_forward(&cfg, AttnShape::self_attn(shape), &x, &x, &x)?;
//! assert_eq!(fwd.out.len(), shape.numel());
//! assert!(fwd.lse.iter().all(|l| l.is_finite())); // every row is selected by some pattern
//!
//! // Bad values are typed errors, never panics.
//! assert!(DilatedConfig::builder().segments(&[4]).dilations(&[8]).build().is_err());
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

pub mod attention;
pub mod band;
pub mod block_mask;
pub mod causality;
pub mod config;
pub mod element;
pub mod error;
pub mod feature;
pub mod guard;
pub mod head_patterns;
pub mod masks;
pub mod merge;
mod options;
pub mod packing;
pub mod pattern;
pub mod placed;
pub mod reference;
pub mod rng;
pub mod shape;
pub mod view;

pub use attention::{Attention, AttnInputs, Feature, Grads, Pass, Placement, Saved, Supported};
pub use band::Band;
pub use block_mask::{BlockDims, BlockMask, BlockMaskBuf, BlockPattern};
pub use config::{Causality, DilatedConfig, DilatedConfigBuilder, Mixing, Window};
pub use element::{DType, Element};
pub use error::{AttnError, Result, TensorName};
pub use guard::{FiniteCheck, MemoryBudget, check_finite};
pub use head_patterns::{HeadGroups, HeadPatterns, OffsetHeads};
pub use masks::{KeyPadding, KeyPaddingMask, Masks, OwnedMasks, PackedSequences};
pub use merge::{LseMerge, OnlineSoftmax};
pub use options::AttnOptions;
pub use pattern::SegmentPattern;
pub use placed::PlacedPattern;
pub use reference::ReferenceBackend;
pub use rng::SeededRng;
pub use shape::{AttnShape, Shape4};
pub use view::{TensorView, TensorViewMut};
