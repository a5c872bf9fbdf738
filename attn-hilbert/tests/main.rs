//! The integration tests of this crate in one binary (one link and one set of generic
//! instances for all of them); each module is one test file.

mod attention;
mod continuity;
mod generation_work;
mod locality;
mod permutations;
