//! [`DilatedAttentionBackend`]: the backend extension, burn's way of adding an operation
//! to a backend: a trait over [`Backend`] with the forward (output and LSE) and the
//! exact backward (gradients into the output and the LSE) on the backend's float
//! primitives, implemented for burn-flex on the
//! workspace's CPU kernels ([`crate::flex`]) and for `Autodiff<B>` over any backend that
//! has it ([`crate::autodiff`]), whose backward node runs the backward from the saved
//! output and LSE.

use attn_core::Result;
use burn_backend::Backend;
use burn_backend::tensor::FloatTensor;

use crate::compute::Compute;
use crate::options::AttnOptions;

/// The output and LSE of one forward, as primitives of backend `B`.
#[derive(Debug, Clone)]
pub struct AttnPrimitives<B: Backend> {
    /// `[batch, seq, heads, head_dim]`, q's dtype.
    pub out: FloatTensor<B>,
    /// `[batch, seq, heads]`, f32: `log(sum(exp(score)))` of each query row's kept keys
    /// (`-inf` for a row that keeps none).
    pub lse: FloatTensor<B>,
}

/// What the backward reads besides the upstream gradient: the inputs and what the forward
/// produced.
#[derive(Debug, Clone)]
pub struct SavedForward<B: Backend> {
    pub q: FloatTensor<B>,
    pub k: FloatTensor<B>,
    pub v: FloatTensor<B>,
    pub out: FloatTensor<B>,
    pub lse: FloatTensor<B>,
}

/// The gradients flowing into one call's results; `None` stands for zero.
#[derive(Debug, Clone)]
pub struct Upstream<B: Backend> {
    /// Into the output, `[batch, seq, heads, head_dim]`, q's dtype.
    pub grad_out: Option<FloatTensor<B>>,
    /// Into the LSE, `[batch, seq, heads]`, f32 (rows whose LSE is `-inf` take none).
    pub grad_lse: Option<FloatTensor<B>>,
}

/// dq, dk, dv of one backward.
#[derive(Debug, Clone)]
pub struct InputGrads<B: Backend> {
    pub dq: FloatTensor<B>,
    pub dk: FloatTensor<B>,
    pub dv: FloatTensor<B>,
}

/// Dilated attention (`docs/definition.md`) on `[batch, seq, heads, head_dim]` float
/// primitives: q `[batch, seq, heads, head_dim]`, k and v `[batch, kv_seq, kv_heads,
/// head_dim]` (`kv_heads` dividing `heads`), computed where `compute` says (the CPU
/// kernels, or a backend such as a ring rank). Bad input is an `AttnError`, never a panic.
pub trait DilatedAttentionBackend: Backend {
    /// The output and the LSE.
    fn dilated_attention_with_lse(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: &AttnOptions,
        compute: &Compute,
    ) -> Result<AttnPrimitives<Self>>;

    /// The output alone.
    fn dilated_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: &AttnOptions,
        compute: &Compute,
    ) -> Result<FloatTensor<Self>> {
        Ok(Self::dilated_attention_with_lse(q, k, v, options, compute)?.out)
    }

    /// The gradients of `sum(out * grad_out) + sum(lse * grad_lse)` in q, k and v, from
    /// the saved forward (the forward is not recomputed).
    fn dilated_attention_backward(
        saved: SavedForward<Self>,
        upstream: Upstream<Self>,
        options: &AttnOptions,
        compute: &Compute,
    ) -> Result<InputGrads<Self>>;
}
