//! The bf16 pair forward where it cannot exist (not x86-64): neither engine is ever
//! supported, so none of these is ever reached.

use super::layout::{Geometry, RowState};

pub(super) mod pair_tiles_avx512 {
    use attn_core::Element;
    pub(in super::super) fn available() -> bool {
        false
    }
    pub(in super::super) fn key_group<T: Element>(_: &[&[T]], _: usize, _: usize, _: &mut [u32], _: usize) -> bool {
        unreachable!("never available on this target")
    }
    pub(in super::super) fn value_pair<T: Element>(
        _: &[T],
        _: Option<&[T]>,
        _: usize,
        _: usize,
        _: &mut [u32],
    ) -> bool {
        unreachable!("never available on this target")
    }
}
pub(super) mod dot {
    use super::super::layout::Geometry;
    pub(in super::super) fn scores(_: &Geometry, _: usize, _: usize, _: &[u16], _: &[u32], _: &mut [f32]) {}
    pub(in super::super) fn values(_: &Geometry, _: usize, _: usize, _: &[u16], _: &[u32], _: &mut [f32]) {}
}
pub(super) fn prefetch(_: *const i8, _: usize) {}
pub(super) fn with_tiles<R>(_f: impl FnOnce() -> R) -> R {
    unreachable!("AMX is never reported as supported on this target")
}
pub(super) fn scores(_: &Geometry, _: usize, _: usize, _: &[u16], _: &[u32], _: &mut [f32]) {}
pub(super) fn load_output(_: &Geometry, _: &[f32]) {}
pub(super) fn store_output(_: &Geometry, _: &mut [f32]) {}
pub(super) fn values(_: &Geometry, _: usize, _: usize, _: &[u16], _: &[u32], _: &mut [f32]) {}
pub(super) fn softmax_row(_: &[f32], _: std::ops::Range<usize>, _: f32, _: &mut RowState, _: &mut [u16]) -> f32 {
    1.0
}
