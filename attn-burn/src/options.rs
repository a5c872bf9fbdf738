//! [`AttnOptions`]: the config and owned masks of one call, shared with every front door
//! (defined in `attn-core`).

pub use attn_core::AttnOptions;
