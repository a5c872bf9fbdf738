//! Dilated and ring attention as candle operations and candle-nn modules.
//!
//! [`dilated_attention`] computes the function of `docs/definition.md` on candle
//! tensors `[batch, seq, heads, head_dim]` (f32, bf16, f16) through the workspace's
//! CPU kernels, and its exact backward is wired into candle's autograd, so
//! `loss.backward()` yields dq, dk, dv.
//!
//! # How the LSE reaches the backward
//! The op is a [`candle_core::CustomOp3`] ([`DilatedAttentionOp`]). Candle keeps the op
//! object itself (behind an `Arc`) in the graph node of the output and hands it the
//! inputs, the output and the upstream gradient in `bwd`. The forward writes the LSE
//! (`[batch, seq, heads]` f32) into a cell the op object owns, so the backward reads
//! it from there: no forward is recomputed and no second output is needed. A custom
//! op has one output tensor, so the alternative, returning the LSE as a second
//! output, would need a second op and a split; the cell is simpler and costs one
//! `f32` per (query, head). [`dilated_attention_with_lse`] also hands the LSE to the
//! caller, differentiable: a second op over the output adds zeros to it and, in its
//! `bwd` (which candle runs before the output's), hands the gradient that reached the LSE
//! to the attention's backward, so partial results merged by their LSEs get exact
//! gradients from one backward.
//!
//! # Layouts
//! Any strides candle hands over are accepted. When head_dim has unit stride (a
//! contiguous BSHD tensor, a transposed BHSD tensor from `.transpose(1, 2)`, a
//! narrowed fused projection), the kernels read candle's storage in place; otherwise
//! the input is first made contiguous (a copy, with candle's own gradient).
//!
//! # Features
//! Grouped key/value heads follow from k and v having fewer heads than q; key
//! padding, packed sequences (`cu_seqlens`), a block mask (on a CUDA device uploaded
//! and read by the row kernels), windows, mixing and causality come in [`AttnOptions`] and
//! its [`attn_core::DilatedConfig`].
//!
//! # Ring attention
//! [`attention_on`] takes any backend computing f32, bf16 and f16 ([`AnyAttention`]).
//! With an `attn_ring::RingBackend` (one per rank, over any communicator: in-process
//! `ThreadComm`, MPI, NCCL) each rank passes its own rows (`RingBackend::positions`)
//! and gets the single-device rows back under the backend's `attn_ring::Strategy` (the
//! ring or all-gather row plan, Ulysses, the hybrid, or `Auto`'s pick), gradients included: the backward is the
//! ring's collective backward, so every rank calls `backward()` on its loss. A key
//! padding mask then covers the rank's rows; `cu_seqlens` are global.
//!
//! # Errors and devices
//! Every failure is a candle error wrapping the workspace's [`attn_core::AttnError`]
//! with its message: mixed dtypes, f64 or integer inputs, a rank other than 4, shapes
//! that disagree, and tensors on a device the op cannot compute on. No panic on bad input.
//!
//! # CUDA
//! With the feature `cuda` (which turns on candle's own), [`dilated_attention`] on tensors
//! of a CUDA device runs the workspace's CUDA kernels (`attn_kernels::cuda`) on candle's
//! device memory, in place, queued on candle's stream: forward, LSE (kept on the device)
//! and backward. Without the feature such tensors are `NotCompiled`; with a host backend
//! ([`attention_on`]) they are `Unsupported`. candle's `cuda` builds its own kernels with
//! `nvcc`, so this feature needs a CUDA toolkit at build time; the workspace's kernels
//! still compile at run time (NVRTC).

mod buffers;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
mod host;
pub mod nn;
mod op;
mod options;

pub use attn_core::{KeyPaddingMask, OwnedMasks};
pub use buffers::{BufferRun, InputLayout, leaf, run_buffers, run_buffers_on};
pub use error::to_candle;
pub use host::{AnyAttention, HostElement};
pub use op::{AttnOutput, DilatedAttentionOp, LseCell, attention_on};
pub use options::{AttnOptions, key_padding_from_tensor};

use std::sync::Arc;

use candle_core::Tensor;

/// The process-wide CPU backend (one thread per core), built on first use.
pub fn default_backend() -> candle_core::Result<Arc<dyn AnyAttention>> {
    static CPU: std::sync::OnceLock<Arc<dyn AnyAttention>> = std::sync::OnceLock::new();
    if let Some(b) = CPU.get() {
        return Ok(b.clone());
    }
    let backend: Arc<dyn AnyAttention> = Arc::new(attn_kernels::CpuBackend::new(0).map_err(to_candle)?);
    Ok(CPU.get_or_init(|| backend).clone())
}

/// Dilated attention of q `[batch, seq, heads, head_dim]` and k, v `[batch, kv_seq,
/// kv_heads, head_dim]`, differentiable in q, k and v: host tensors on the CPU kernels,
/// tensors on a CUDA device on the CUDA kernels (feature `cuda`).
pub fn dilated_attention(q: &Tensor, k: &Tensor, v: &Tensor, options: &AttnOptions) -> candle_core::Result<Tensor> {
    let op = DilatedAttentionOp::new(default_backend()?, Arc::new(options.clone())).with_cuda_kernels();
    op::attend_output(op, q, k, v)
}

/// [`dilated_attention`] returning the LSE too.
pub fn dilated_attention_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: &AttnOptions,
) -> candle_core::Result<AttnOutput> {
    let op = DilatedAttentionOp::new(default_backend()?, Arc::new(options.clone())).with_cuda_kernels();
    op::attend(op, q, k, v)
}
