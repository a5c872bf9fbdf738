//! The integration tests of this crate in one binary (one link and one set of generic
//! instances for all of them); each module is one test file.

mod common;
mod conformance;
#[cfg(feature = "cuda")]
mod cuda;
mod encoder;
mod errors;
mod nn;
mod nn_init;
mod nn_low_precision;
mod nn_qkln;
mod op;
mod ring;
