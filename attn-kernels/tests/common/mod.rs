//! Shared test helpers: element conversions.
#![allow(dead_code)]

use attn_core::Element;

pub fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

pub fn conv<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

pub fn back<T: Element>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}
