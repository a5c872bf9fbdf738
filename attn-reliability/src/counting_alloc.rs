//! A counting global allocator for attack tests: live bytes, peak live bytes and the
//! largest single request since the last reset.
//!
//! A test binary installs it with `#[global_allocator]`; tests that read the counters
//! hold [`exclusive`] so that no other test of the binary allocates meanwhile. This is
//! the only module of the crate with `unsafe` (the `GlobalAlloc` impl, which forwards
//! every call unchanged to [`System`]).
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

static LIVE: AtomicI64 = AtomicI64::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static EXCLUSIVE: Mutex<()> = Mutex::new(());

/// The allocator: `#[global_allocator] static A: CountingAlloc = CountingAlloc;`.
#[derive(Debug)]
pub struct CountingAlloc;

fn grew(size: usize) {
    let live = LIVE.fetch_add(size as i64, Ordering::Relaxed) + size as i64;
    PEAK.fetch_max(live, Ordering::Relaxed);
    LARGEST.fetch_max(size, Ordering::Relaxed);
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
}

fn shrank(size: usize) {
    LIVE.fetch_sub(size as i64, Ordering::Relaxed);
}

// SAFETY: every method forwards its arguments unchanged to `System`, which upholds the
// `GlobalAlloc` contract; the counters are plain atomics and never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same layout as the caller's, which satisfies `alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout (every block above does).
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr`/`layout` came from `System`; the caller guarantees `new_size` is valid.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        p
    }
}

/// Counters at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocSnapshot {
    /// Bytes allocated and not yet freed (process-wide, since start).
    pub live: i64,
    /// Highest `live` since the last [`reset_peaks`].
    pub peak: i64,
    /// Largest single request since the last [`reset_peaks`].
    pub largest: usize,
    /// Number of allocations since start.
    pub allocations: usize,
}

/// Read the counters.
pub fn snapshot() -> AllocSnapshot {
    AllocSnapshot {
        live: LIVE.load(Ordering::Relaxed),
        peak: PEAK.load(Ordering::Relaxed),
        largest: LARGEST.load(Ordering::Relaxed),
        allocations: ALLOCATIONS.load(Ordering::Relaxed),
    }
}

/// Start a new measurement: peak := live, largest := 0.
pub fn reset_peaks() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    LARGEST.store(0, Ordering::Relaxed);
}

/// Serialise the tests of one binary that read the counters (poisoning is ignored:
/// a failed test must not fail the others).
pub fn exclusive() -> MutexGuard<'static, ()> {
    EXCLUSIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Run `f` alone and return its result with the peak extra live bytes and the largest
/// single allocation it made. Only meaningful with [`CountingAlloc`] installed.
pub fn measure<R>(f: impl FnOnce() -> R) -> (R, Measured) {
    let before = snapshot();
    reset_peaks();
    let r = f();
    let after = snapshot();
    let m = Measured {
        peak_extra: (after.peak - before.live).max(0) as usize,
        largest: after.largest,
        live_delta: after.live - before.live,
        allocations: after.allocations - before.allocations,
    };
    (r, m)
}

/// What [`measure`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measured {
    /// Highest live bytes above the starting point during the call.
    pub peak_extra: usize,
    /// Largest single allocation during the call.
    pub largest: usize,
    /// Live bytes after minus before (includes what the result holds).
    pub live_delta: i64,
    /// Number of allocations during the call.
    pub allocations: usize,
}
