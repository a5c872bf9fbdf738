//! The tensor-level entry points: a burn 0.22 [`Tensor`] carries its backend at run time,
//! so the call finds the backend of q among those implementing
//! [`DilatedAttentionBackend`] (`Autodiff<Flex>` with either checkpointing strategy,
//! `Flex`), runs the extension there, and refuses any other backend with a typed error.
//! [`attention_on`] computes through a backend the caller hands over (a ring rank).

use std::sync::Arc;

use attn_core::{AttnError, Feature, Result, TensorName};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
use burn_dispatch::DispatchKindConversion;
use burn_flex::Flex;
use burn_tensor::{DispatchTensor, PrimitiveConversionError, Tensor};

use crate::backend::{AttnPrimitives, DilatedAttentionBackend};
use crate::compute::{Compute, HostAttention};
use crate::options::AttnOptions;

/// The backends the op computes on, for messages.
pub const SUPPORTED_BACKENDS: &str =
    "burn-flex tensors (f32, f64, bf16, f16), with or without autodiff; other backends are not supported";

/// The output and LSE of one call.
#[derive(Debug, Clone)]
pub struct AttnOutput {
    /// `[batch, seq, heads, head_dim]`, q's dtype, differentiable in q, k and v.
    pub out: Tensor<4>,
    /// `[batch, seq, heads]`, f32, differentiable in q, k and v too (rows without a key
    /// hold `-inf` and pass no gradient).
    pub lse: Tensor<3>,
}

/// Dilated attention of q `[batch, seq, heads, head_dim]` and k, v `[batch, kv_seq,
/// kv_heads, head_dim]`, differentiable in q, k and v under autodiff.
pub fn dilated_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, options: &AttnOptions) -> Result<Tensor<4>> {
    Ok(dilated_attention_with_lse(q, k, v, options)?.out)
}

/// [`dilated_attention`] returning the LSE too.
pub fn dilated_attention_with_lse(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: &AttnOptions,
) -> Result<AttnOutput> {
    route([q, k, v], options, &Compute::Kernels)
}

/// Dilated attention of burn-flex tensors computed by `backend`, with the LSE: with an
/// `attn_ring::RingBackend` (one per rank, over any communicator) each rank passes its
/// own rows (`RingBackend::positions`) and gets the single-device rows back under the
/// backend's layout and `attn_ring::Strategy`, gradients included: the backward is the
/// ring's collective backward, so every rank runs `backward()` on a loss reaching the
/// same results (output, LSE or both) of the call. A key padding mask then covers the
/// rank's rows; `cu_seqlens` and a block mask are global.
pub fn attention_on(
    backend: Arc<dyn HostAttention>,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: &AttnOptions,
) -> Result<AttnOutput> {
    route([q, k, v], options, &Compute::On(backend))
}

/// The call on the backend q lives on, computed where `compute` says.
pub(crate) fn route(qkv: [Tensor<4>; 3], options: &AttnOptions, compute: &Compute) -> Result<AttnOutput> {
    if let Some(r) = attend_on::<Autodiff<Flex, NoCheckpointing>>(&qkv, options, compute) {
        return r;
    }
    if let Some(r) = attend_on::<Autodiff<Flex, BalancedCheckpointing>>(&qkv, options, compute) {
        return r;
    }
    if let Some(r) = attend_on::<Flex>(&qkv, options, compute) {
        return r;
    }
    Err(AttnError::Unsupported { backend: "burn", feature: Feature::Other(SUPPORTED_BACKENDS) })
}

/// The call on backend `B`, or `None` when q does not live there.
fn attend_on<B: DilatedAttentionBackend>(
    qkv: &[Tensor<4>; 3],
    options: &AttnOptions,
    compute: &Compute,
) -> Option<Result<AttnOutput>>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    let [q, k, v] = qkv;
    let q = match q.clone().try_into_primitive::<B>() {
        Ok(q) => q,
        Err(PrimitiveConversionError::BackendMismatch(_)) => return None,
        Err(PrimitiveConversionError::KindMismatch(got)) => {
            return Some(Err(AttnError::DTypeMismatch { tensor: TensorName::Query, expected: "a float tensor", got }));
        }
    };
    Some(attend_with::<B>(q, [k, v], options, compute))
}

fn attend_with<B: DilatedAttentionBackend>(
    q: <B as burn_backend::BackendTypes>::FloatTensorPrimitive,
    [k, v]: [&Tensor<4>; 2],
    options: &AttnOptions,
    compute: &Compute,
) -> Result<AttnOutput>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    let same_backend = |name: TensorName, t: &Tensor<4>| {
        t.clone().try_into_primitive::<B>().map_err(|e| {
            let got = match e {
                PrimitiveConversionError::BackendMismatch(m) | PrimitiveConversionError::KindMismatch(m) => m,
            };
            AttnError::InvalidArgument(format!("{name} is not on q's backend and autodiff context: {got}"))
        })
    };
    let k = same_backend(TensorName::Key, k)?;
    let v = same_backend(TensorName::Value, v)?;
    let AttnPrimitives { out, lse } = B::dilated_attention_with_lse(q, k, v, options, compute)?;
    Ok(AttnOutput { out: Tensor::from_primitive::<B>(out), lse: Tensor::from_primitive::<B>(lse) })
}
