//! Typed errors: every invalid input names what is wrong, and nothing panics.

use std::fmt;

use crate::feature::Feature;

/// Result alias used across the workspace.
pub type Result<T, E = AttnError> = std::result::Result<T, E>;

/// A boxed error from a backend (CUDA, MPI, NCCL); keeps foreign types out of
/// [`AttnError`].
pub type BoxedError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Which tensor an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorName {
    Query,
    Key,
    Value,
    Output,
    Lse,
    GradOutput,
    GradLse,
    GradQuery,
    GradKey,
    GradValue,
    KeyPaddingMask,
    CuSeqlens,
    Other(&'static str),
}

impl fmt::Display for TensorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            TensorName::Query => "q",
            TensorName::Key => "k",
            TensorName::Value => "v",
            TensorName::Output => "out",
            TensorName::Lse => "lse",
            TensorName::GradOutput => "grad_out",
            TensorName::GradLse => "grad_lse",
            TensorName::GradQuery => "dq",
            TensorName::GradKey => "dk",
            TensorName::GradValue => "dv",
            TensorName::KeyPaddingMask => "key_padding_mask",
            TensorName::CuSeqlens => "cu_seqlens",
            TensorName::Other(s) => s,
        };
        f.write_str(s)
    }
}

/// Every way a call into `attn` can fail.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttnError {
    #[error("segment_lengths and dilation_rates are empty: at least one pattern is required")]
    EmptyPatterns,
    #[error("segment_lengths has {segments} entries but dilation_rates has {rates}")]
    PatternCountMismatch { segments: usize, rates: usize },
    #[error("segment length {index} is zero")]
    ZeroSegmentLength { index: usize },
    #[error("dilation rate {index} is zero")]
    ZeroDilationRate { index: usize },
    #[error("dilation rate {index} ({rate}) is larger than its segment length ({segment})")]
    RateExceedsSegment { index: usize, rate: usize, segment: usize },
    #[error("{heads} heads cannot be split into {groups} head groups (need heads >= groups)")]
    TooFewHeads { heads: usize, groups: usize },
    #[error("a sliding window and segment lengths or dilation rates were both given: window mode has no segments")]
    WindowWithSegments,
    #[error(
        "mixing `{mixing}` does not match the window setting: a window needs mixing `window` and mixing `window` needs a window"
    )]
    WindowMixing { mixing: &'static str },
    #[error("{heads} query heads cannot share {kv_heads} key/value heads: kv_heads must divide heads")]
    KvHeadsNotDividing { heads: usize, kv_heads: usize },
    #[error("cu_seqlens is invalid: {0}")]
    InvalidCuSeqlens(String),
    #[error("packed sequences need batch 1, got batch {batch}")]
    PackedBatch { batch: usize },
    #[error("packed sequences need self-attention: k and v have their own sequence length")]
    PackedCrossAttention,
    #[error("block mask is invalid: {0}")]
    InvalidBlockMask(String),
    #[error("{backend} does not support {feature}")]
    Unsupported { backend: &'static str, feature: Feature },
    #[error("softmax scale {0} is not finite and positive")]
    InvalidScale(f64),
    #[error("dimension `{dim}` of {tensor} is zero")]
    ZeroDim { tensor: TensorName, dim: &'static str },
    #[error("shape of {tensor} overflows usize: {dims:?}")]
    ShapeOverflow { tensor: TensorName, dims: Vec<usize> },
    #[error("{tensor} has shape {got:?} but {expected:?} was expected")]
    ShapeMismatch { tensor: TensorName, expected: Vec<usize>, got: Vec<usize> },
    #[error("{tensor} has {got} dimensions but {expected} were expected")]
    RankMismatch { tensor: TensorName, expected: usize, got: usize },
    #[error("{tensor}: buffer of {len} elements is too small for a view reaching element {needed}")]
    BufferTooSmall { tensor: TensorName, len: usize, needed: usize },
    #[error("{tensor}: innermost (head_dim) stride must be 1, got {stride}")]
    NonUnitInnerStride { tensor: TensorName, stride: usize },
    #[error("{tensor}: dtype {got} where {expected} was expected")]
    DTypeMismatch { tensor: TensorName, expected: &'static str, got: String },
    #[error("workspace of {needed} bytes exceeds the memory budget of {budget} bytes")]
    OverBudget { needed: usize, budget: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("{backend} support was not compiled in (enable the `{feature}` feature)")]
    NotCompiled { backend: &'static str, feature: &'static str },
    #[error("{backend} is unavailable on this machine: {reason}")]
    BackendUnavailable { backend: &'static str, reason: String },
    #[error("{backend} error: {source}")]
    Backend {
        backend: &'static str,
        #[source]
        source: BoxedError,
    },
    #[error("communication error on rank {rank}: {message}")]
    Comm { rank: usize, message: String },
    #[error("rank {rank}: peer {peer} did not answer within {timeout_ms} ms")]
    Timeout { rank: usize, peer: usize, timeout_ms: u64 },
    #[error("ranks disagree: {0}")]
    RankDisagreement(String),
    #[error("attention scores can reach {bound:e}, beyond the f32 range: lower the scale or the input magnitude")]
    ScoreOverflow { bound: f64 },
    #[error("non-finite value in {tensor} at flat index {index}")]
    NonFinite { tensor: TensorName, index: usize },
    #[error("malformed file: {0}")]
    Format(String),
}

impl AttnError {
    /// Wrap a backend-specific error without leaking its type.
    pub fn backend(backend: &'static str, source: impl Into<BoxedError>) -> Self {
        AttnError::Backend { backend, source: source.into() }
    }
}
