//! The conformance runner's library: `kind=multihead` cases (a file's metadata and tensors) run through `attn-multihead`'s layer, forward and backward, on one device or on in-process ring ranks.
//!
//! The `attn-golden` binary checks every file of a directory with these; tests of
//! the layer against the files use them too.
#![forbid(unsafe_code)]

pub mod multihead_case;
pub mod multihead_grad;

pub use multihead_case::{PreparedCase, RingSplit, forward_case, forward_case_ring, prepare_case};
pub use multihead_grad::{CaseGrads, backward_case, backward_case_ring};
