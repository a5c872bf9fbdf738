//! Helpers shared by the ring attack tests (kept out of the library so that the fuzz
//! targets do not depend on `attn-ring`).
#![allow(dead_code)]

pub mod ring_harness;
