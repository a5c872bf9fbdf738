//! Dilated attention for burn: a backend extension with the exact backward.
//!
//! [`dilated_attention`] and [`dilated_attention_with_lse`] compute the function of
//! `docs/definition.md` on burn tensors `[batch, seq, heads, head_dim]` (q) and
//! `[batch, kv_seq, kv_heads, head_dim]` (k, v). On burn-flex, burn's maintained CPU
//! backend, the workspace's CPU kernels compute it in f32, f64, bf16 and f16, reading
//! flex's host storage in place where the layout allows; under autodiff the backward
//! node runs the kernels' exact backward from the output and LSE the forward kept,
//! for gradients into the output, the LSE or both.
//!
//! # Backend extension
//! [`DilatedAttentionBackend`] is the extension trait (burn's documented pattern: a
//! trait over `Backend` on the backend's float primitives), implemented for
//! `burn_flex::Flex` and for `burn_autodiff::Autodiff<B, C>` over any backend that
//! implements it. The tensor-level functions route a burn 0.22 `Tensor` (which carries
//! its backend at run time) to `Autodiff<Flex>` (either checkpointing strategy) or
//! `Flex`; tensors of any other backend get [`attn_core::AttnError::Unsupported`] naming
//! the supported ones.
//!
//! # Features
//! Grouped key/value heads follow from k and v having fewer heads than q; key padding,
//! packed sequences (`cu_seqlens`), block masks, windows, mixing and causality come in
//! [`AttnOptions`] (its [`attn_core::DilatedConfig`] and [`attn_core::OwnedMasks`]).
//!
//! # Ring attention
//! [`attention_on`] computes through any backend that has every dtype flex stores
//! ([`HostAttention`]). With an `attn_ring::RingBackend` (one per rank, over any
//! communicator: in-process `ThreadComm`, MPI) each rank passes its own rows as a burn
//! tensor and gets the single-device rows back under the backend's layout and
//! `attn_ring::Strategy`; under autodiff the backward is the ring's collective backward,
//! so every rank runs `backward()`. The extension's methods take the same choice as a
//! [`Compute`].
//!
//! # Modules
//! [`nn`] holds burn modules (`#[derive(Module)]`) over the op: the multihead layer and
//! the LongNet encoder, with `attn-multihead`'s PyTorch parameter names, MAGNETO
//! initialisation and safetensors loading. Their `forward_on` takes a [`Compute`]: with a
//! ring rank each rank passes its own rows, dropout masks are drawn at the rows' global
//! positions, and the ranks' rows (and parameter gradients summed over the ranks) are the
//! single-device module's.
//!
//! # Benchmark
//! `cargo run --release -p attn-burn --example burn_attention_bench` times the op
//! against the same dilated pattern composed from burn's own `attention` op, forward
//! and forward plus backward at seq 8192 (results in BENCHMARKS.md).
//!
//! # Errors
//! Every failure is an [`attn_core::AttnError`]: mixed dtypes, a rank other than 4,
//! shapes that disagree, masks that do not fit, tensors of an unsupported backend. No
//! panic on bad input.

mod autodiff;
mod backend;
mod compute;
mod flex;
pub mod nn;
mod options;
mod route;

pub use attn_core::{KeyPaddingMask, OwnedMasks};
pub use backend::{AttnPrimitives, DilatedAttentionBackend, InputGrads, SavedForward, Upstream};
pub use compute::{Compute, HostAttention};
pub use options::AttnOptions;
pub use route::{AttnOutput, SUPPORTED_BACKENDS, attention_on, dilated_attention, dilated_attention_with_lse};
