//! The integration tests of this crate in one binary (one link and one set of generic
//! instances for all of them); each module is one test file.

mod block_files;
mod hostile_golden;
mod planted_errors;
