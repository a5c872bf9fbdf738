//! Shared test helpers: element conversions, and the ISAs an ISA-specific test runs on.
#![allow(dead_code)]

use attn_core::Element;
use attn_kernels::Isa;

/// The ISAs of `candidates` this CPU offers, for the test `test`: one it lacks is skipped
/// with the reason printed, or fails the test where `ATTN_REQUIRE_ISA` names it.
pub fn isas_here(test: &str, candidates: impl IntoIterator<Item = Isa>) -> Vec<Isa> {
    attn_testkit::isa_policy::runnable(test, candidates, Isa::as_str, Isa::is_supported)
}

pub fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

pub fn conv<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

pub fn back<T: Element>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}
