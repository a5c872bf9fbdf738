//! The tensor-level entry points: a burn 0.22 [`Tensor`] carries its backend at run time,
//! so the call finds the backend of q among those implementing
//! [`DilatedAttentionBackend`] (`Autodiff<Flex>` with either checkpointing strategy,
//! `Flex`), runs the extension there, and refuses any other backend with a typed error.

use attn_core::{AttnError, Feature, Result, TensorName};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
use burn_dispatch::DispatchKindConversion;
use burn_flex::Flex;
use burn_tensor::{DispatchTensor, PrimitiveConversionError, Tensor};

use crate::backend::{AttnPrimitives, DilatedAttentionBackend};
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
    let qkv = [q, k, v];
    if let Some(r) = attend_on::<Autodiff<Flex, NoCheckpointing>>(&qkv, options) {
        return r;
    }
    if let Some(r) = attend_on::<Autodiff<Flex, BalancedCheckpointing>>(&qkv, options) {
        return r;
    }
    if let Some(r) = attend_on::<Flex>(&qkv, options) {
        return r;
    }
    Err(AttnError::Unsupported { backend: "burn", feature: Feature::Other(SUPPORTED_BACKENDS) })
}

/// The call on backend `B`, or `None` when q does not live there.
fn attend_on<B: DilatedAttentionBackend>(qkv: &[Tensor<4>; 3], options: &AttnOptions) -> Option<Result<AttnOutput>>
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
    Some(attend_with::<B>(q, [k, v], options))
}

fn attend_with<B: DilatedAttentionBackend>(
    q: <B as burn_backend::BackendTypes>::FloatTensorPrimitive,
    [k, v]: [&Tensor<4>; 2],
    options: &AttnOptions,
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
    let AttnPrimitives { out, lse } = B::dilated_attention_with_lse(q, k, v, options)?;
    Ok(AttnOutput { out: Tensor::from_primitive::<B>(out), lse: Tensor::from_primitive::<B>(lse) })
}
