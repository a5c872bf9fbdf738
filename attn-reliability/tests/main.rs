//! The integration tests of this crate in one binary (one link and one set of generic
//! instances for all of them); each module is one test file.

mod check_finite_option;
mod common;
mod config_bytes;
mod frame_bytes;
mod fuzz_seeds;
mod nan_locality;
mod numerics;
mod ring_faults;
mod ring_plan_bytes;
