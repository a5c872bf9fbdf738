//! `Feature`: what a call may use beyond plain dilated attention, the unit backends
//! declare support in ([`crate::Supported`]) and errors name.

/// A feature a call may use beyond dilated attention of queries over keys of their own
/// length, whole batch rows and one key/value head per query head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Feature {
    /// Fewer key/value heads than query heads (grouped-query attention).
    GroupedKv,
    /// A key padding mask.
    KeyPadding,
    /// Packed variable-length sequences (`cu_seqlens`).
    Packing,
    /// A sliding window config.
    Window,
    /// Keys and values with a sequence length of their own (`kv_seq != q_seq`).
    CrossAttention,
    /// A block mask (block-sparse attention).
    BlockMask,
    /// A capability outside the attention features (a device, a gradient path), by name;
    /// never in a [`Supported`](crate::Supported) set.
    Other(&'static str),
}

impl Feature {
    /// The features [`AttnInputs::features`](crate::AttnInputs::features) detects, in the order it reports them.
    pub const CHECKED: [Feature; 6] = [
        Feature::GroupedKv,
        Feature::KeyPadding,
        Feature::Packing,
        Feature::Window,
        Feature::CrossAttention,
        Feature::BlockMask,
    ];

    /// The feature's bit in a [`Supported`](crate::Supported) set (none for [`Feature::Other`]).
    pub(crate) const fn bit(self) -> u16 {
        match self {
            Feature::GroupedKv => 1,
            Feature::KeyPadding => 1 << 1,
            Feature::Packing => 1 << 2,
            Feature::Window => 1 << 3,
            Feature::CrossAttention => 1 << 4,
            Feature::BlockMask => 1 << 5,
            Feature::Other(_) => 0,
        }
    }
}

impl std::fmt::Display for Feature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Feature::GroupedKv => "grouped key/value heads",
            Feature::KeyPadding => "key padding masks",
            Feature::Packing => "packed sequences",
            Feature::Window => "sliding windows",
            Feature::CrossAttention => "cross-attention with kv_seq != q_seq",
            Feature::BlockMask => "block masks",
            Feature::Other(name) => name,
        })
    }
}
