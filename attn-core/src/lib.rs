//! Core of `attn`: configuration, typed errors, tensor shapes and views, pattern
//! math as functions of global positions, the LSE merge, and the float64 reference.
//!
//! Everything here follows `SPEC.md`; the fast backends in `attn-kernels` and the
//! ring strategies in `attn-ring` are checked against [`reference`].
#![forbid(unsafe_code)]

pub mod config;
pub mod element;
pub mod error;
pub mod guard;
pub mod merge;
pub mod pattern;
pub mod reference;
pub mod shape;
pub mod view;

pub use config::{DilatedConfig, DilatedConfigBuilder, Mixing};
pub use element::{DType, Element};
pub use error::{AttnError, Result, TensorName};
pub use guard::{MemoryBudget, check_finite};
pub use merge::{LseMerge, OnlineSoftmax};
pub use pattern::{HeadGroups, HeadPatterns, OffsetHeads, SegmentPattern};
pub use shape::{AttnShape, Shape4};
pub use view::{TensorView, TensorViewMut};
