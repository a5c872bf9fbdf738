//! Disjoint writes from worker threads into one output buffer: each work unit owns a
//! fixed set of rows (a `(batch, head, position chunk)` of a strided view), so the
//! writes never overlap and the result does not depend on scheduling.
#![allow(unsafe_code)]

use std::marker::PhantomData;

/// A mutable buffer shared by workers that write disjoint ranges.
#[derive(Debug)]
pub(crate) struct DisjointSlice<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: the only access is `range_mut`, whose contract forbids overlapping ranges
// across threads, so sharing the pointer is like handing out disjoint `&mut` chunks.
unsafe impl<T: Send> Send for DisjointSlice<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for DisjointSlice<'_, T> {}

impl<'a, T> DisjointSlice<'a, T> {
    pub fn new(data: &'a mut [T]) -> Self {
        DisjointSlice { ptr: data.as_mut_ptr(), len: data.len(), _borrow: PhantomData }
    }

    /// The elements `start .. start + len` (bounds-checked).
    ///
    /// # Safety
    /// While the returned slice lives, no other call (on any thread) may return a range
    /// overlapping it.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range_mut(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start <= self.len && len <= self.len - start, "disjoint range out of bounds");
        // SAFETY: in bounds of the original exclusive borrow (checked above); no overlap
        // with other live ranges by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}
