//! Attack tests for `attn` live in `tests/`; this library holds what they share: a
//! counting allocator, a watchdog, the pattern-math ground truth of who reads what,
//! and the bodies of the fuzz targets (also used by `fuzz/`).
#![deny(unsafe_code)]

pub mod byte_cursor;
pub mod counting_alloc;
pub mod fuzz_targets;
pub mod readers;
pub mod ring_fuzz;
pub mod watchdog;
