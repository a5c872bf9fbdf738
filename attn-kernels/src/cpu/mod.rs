//! The CPU backend in three layers, each importing only the ones below it: `schedule`
//! (whole calls and ring blocks cut into work units and pieces), `tiles` (the
//! flash-style tile loops of one piece) and `isa` (the primitives those loops call,
//! dispatched to AVX-512, AVX2 or portable Rust, and the bf16 pair engines).

pub mod isa;
pub(crate) mod schedule;
pub(crate) mod tiles;
