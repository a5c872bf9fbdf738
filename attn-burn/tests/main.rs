//! attn-burn's integration tests: the op against the float64 reference, the conformance
//! files, and against a plain burn composition of the definition, gradients included;
//! typed errors; the nn modules against the multihead files and `attn-multihead`, on one
//! device and on ring ranks; the bench's composition from burn's `attention` op against
//! the op.

mod bench_composition;
mod common;
mod composition;
mod dropout;
mod errors;
mod golden;
mod nn;
mod reference;
mod ring;
mod ring_nn;
