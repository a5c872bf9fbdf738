//! A counting global allocator for attack tests: live bytes, peak live bytes and the
//! largest single request since the last reset, for the process and per thread.
//!
//! A test binary installs it with `#[global_allocator]`; tests that read the counters
//! hold [`exclusive`] so that no other test of the binary allocates meanwhile. Every
//! block carries a small header naming the thread (slot) that allocated it and the
//! thread epoch, so a free on another thread (a message handed to the next ring rank)
//! is charged back to the allocating thread: a thread's figure is "bytes it allocated
//! that nobody has freed yet", the per-rank figure when ranks are in-process threads
//! (the bench reads it per rank). This is the only module of the crate
//! with `unsafe` (the `GlobalAlloc` impl and the header reads and writes); every block
//! comes from [`System`].
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

static LIVE: AtomicI64 = AtomicI64::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static EXCLUSIVE: Mutex<()> = Mutex::new(());

/// Per-thread slots; threads beyond the last share it.
pub const MAX_SLOTS: usize = 64;
/// Header bytes before every user block (at least the block's alignment).
const MIN_HEADER: usize = 16;

struct Slot {
    live: AtomicI64,
    peak: AtomicI64,
}

static SLOTS: [Slot; MAX_SLOTS] = [const { Slot { live: AtomicI64::new(0), peak: AtomicI64::new(0) } }; MAX_SLOTS];
static EPOCH: AtomicU32 = AtomicU32::new(1);
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// `(epoch << 32) | slot` of this thread; a stale epoch means "no slot yet".
    static TAG: Cell<u64> = const { Cell::new(0) };
    /// Allocations (reallocations included) this thread has made since it started.
    static THREAD_ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

fn count_thread_allocation() {
    // A thread being torn down has no locals left; its allocations go uncounted here
    // (they still count in the process counters).
    let _ = THREAD_ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

/// The allocator: `#[global_allocator] static A: CountingAlloc = CountingAlloc;`.
#[derive(Debug)]
pub struct CountingAlloc;

fn header_for(layout: Layout) -> usize {
    layout.align().max(MIN_HEADER)
}

/// The full System layout of a user block of `layout` (header in front).
fn full_layout(layout: Layout) -> Option<Layout> {
    Layout::from_size_align(layout.size().checked_add(header_for(layout))?, layout.align().max(MIN_HEADER)).ok()
}

/// This thread's tag in the current epoch, assigning a fresh slot if needed.
fn current_tag() -> u64 {
    let epoch = u64::from(EPOCH.load(Ordering::Relaxed));
    TAG.try_with(|t| {
        let tag = t.get();
        if tag >> 32 == epoch {
            return tag;
        }
        let slot = NEXT_SLOT.fetch_add(1, Ordering::Relaxed).min(MAX_SLOTS - 1) as u64;
        let tag = (epoch << 32) | slot;
        t.set(tag);
        tag
    })
    .unwrap_or((epoch << 32) | (MAX_SLOTS as u64 - 1))
}

fn charge(tag: u64, delta: i64) {
    let live = LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
    if delta > 0 {
        PEAK.fetch_max(live, Ordering::Relaxed);
        LARGEST.fetch_max(delta as usize, Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
    if (tag >> 32) as u32 == EPOCH.load(Ordering::Relaxed) {
        let slot = &SLOTS[(tag & 0xffff_ffff) as usize];
        let l = slot.live.fetch_add(delta, Ordering::Relaxed) + delta;
        if delta > 0 {
            slot.peak.fetch_max(l, Ordering::Relaxed);
        }
    }
}

// SAFETY: every block handed out is a `System` block of `size + header` bytes aligned
// to `max(align, 16)`, offset by `header` bytes (a multiple of the alignment), so the
// user pointer is aligned with `size` bytes in bounds. `dealloc`/`realloc` undo the
// same offset with the same header size (a function of the layout only), so `System`
// always sees the layout it allocated with. The counters are atomics and never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(full) = full_layout(layout) else {
            return std::ptr::null_mut();
        };
        // SAFETY: `full` has a non-zero size (the header is at least 16 bytes).
        let base = unsafe { System.alloc(full) };
        if base.is_null() {
            return base;
        }
        let tag = current_tag();
        charge(tag, layout.size() as i64);
        count_thread_allocation();
        // SAFETY: `base` is valid for at least 16 bytes and 16-aligned, so the u64 tag
        // at its start is in bounds and aligned; `base + header` stays inside the block.
        unsafe {
            (base as *mut u64).write(tag);
            base.add(header_for(layout))
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc`/`realloc` above with this layout, so
        // `ptr - header` is the start of the System block (holding our tag), which was
        // allocated with `full_layout(layout)` (valid, or `alloc` would have failed).
        unsafe {
            let base = ptr.sub(header_for(layout));
            charge((base as *const u64).read(), -(layout.size() as i64));
            let full =
                Layout::from_size_align_unchecked(layout.size() + header_for(layout), layout.align().max(MIN_HEADER));
            System.dealloc(base, full);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let h = header_for(layout);
        let Some(new_full) = new_size.checked_add(h) else {
            return std::ptr::null_mut();
        };
        // SAFETY: as in `dealloc`, `ptr - h` starts a System block of `size + h` bytes
        // with alignment `max(align, 16)`; System.realloc keeps the alignment and copies
        // the header (the tag) with the data; the new size is non-zero.
        unsafe {
            let base = ptr.sub(h);
            let tag = (base as *const u64).read();
            let full = Layout::from_size_align_unchecked(layout.size() + h, layout.align().max(MIN_HEADER));
            let nb = System.realloc(base, full, new_full);
            if nb.is_null() {
                return nb;
            }
            charge(tag, -(layout.size() as i64));
            charge(tag, new_size as i64);
            count_thread_allocation();
            nb.add(h)
        }
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

/// Run `f` on the calling thread and return its result with the number of allocations
/// (reallocations included) this thread made during `f`. Unlike
/// [`Measured::allocations`], other threads (a test harness printing a finished test's
/// result) cannot add to it.
pub fn thread_allocations_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let count = || THREAD_ALLOCATIONS.try_with(Cell::get).unwrap_or(0);
    let start = count();
    let r = f();
    (r, count() - start)
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

/// Start a new thread epoch: every thread gets a fresh slot (at zero) at its next
/// allocation; blocks from earlier epochs count only in the process counters.
pub fn new_thread_epoch() {
    EPOCH.fetch_add(1, Ordering::SeqCst);
    for s in &SLOTS {
        s.live.store(0, Ordering::SeqCst);
        s.peak.store(0, Ordering::SeqCst);
    }
    NEXT_SLOT.store(0, Ordering::SeqCst);
}

/// The calling thread's slot in the current thread epoch (assigning one if needed).
pub fn my_slot() -> usize {
    (current_tag() & 0xffff_ffff) as usize
}

/// Peak bytes of every slot assigned in the current thread epoch, by slot index.
pub fn slot_peaks() -> Vec<i64> {
    let n = NEXT_SLOT.load(Ordering::SeqCst).min(MAX_SLOTS);
    SLOTS[..n].iter().map(|s| s.peak.load(Ordering::SeqCst)).collect()
}

/// Run `f` on the calling thread and return its result with the peak bytes this thread
/// allocated during `f` that nobody had freed yet (frees on other threads included),
/// above its level when `f` started. Call [`new_thread_epoch`] before spawning the
/// threads of one measurement so that each has a slot of its own.
pub fn measure_thread<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let slot = &SLOTS[(current_tag() & 0xffff_ffff) as usize];
    let start = slot.live.load(Ordering::SeqCst);
    slot.peak.store(start, Ordering::SeqCst);
    let r = f();
    let peak = slot.peak.load(Ordering::SeqCst);
    (r, (peak - start).max(0) as usize)
}
