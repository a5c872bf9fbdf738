//! CPU backend of `attn`: flash-style fused dilated attention (forward and backward,
//! f32/bf16/f16 with f32 accumulation) and the block-level entry points the ring uses.
#![deny(unsafe_code)]

pub mod block;
pub mod isa;
mod piece;

/// CUDA backend (feature `cuda`; without it, a stub returning `AttnError::NotCompiled`).
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda/stub.rs"]
pub mod cuda;

pub use block::{BlockRows, attend_block, attend_block_backward};
pub use isa::Isa;
