//! attn-burn's integration tests: the op against the float64 reference and against a
//! plain burn composition of the definition, gradients included; typed errors.

mod common;
mod composition;
mod errors;
mod reference;
