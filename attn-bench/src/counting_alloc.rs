//! The counting global allocator: live and peak heap bytes, for the process and per thread.
//!
//! Every allocation carries a small header recording which thread (slot) made it and
//! in which measurement epoch, so a free on another thread (a K/V block handed to the
//! next ring rank) is charged back to the thread that allocated it. Per-thread peaks
//! are therefore "peak bytes this thread had allocated and not yet freed", which is
//! the per-rank figure when ranks are in-process threads. The only `unsafe` of the
//! crate lives here: the `GlobalAlloc` impl and the header reads and writes.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicUsize, Ordering};

/// Number of per-thread slots; threads beyond the last share it.
pub const MAX_SLOTS: usize = 64;

/// Header size (bytes) before every user block; at least the block's alignment.
const MIN_HEADER: usize = 16;

struct SlotStats {
    live: AtomicI64,
    peak: AtomicI64,
}

static SLOTS: [SlotStats; MAX_SLOTS] =
    [const { SlotStats { live: AtomicI64::new(0), peak: AtomicI64::new(0) } }; MAX_SLOTS];
static LIVE: AtomicI64 = AtomicI64::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);
static EPOCH: AtomicU32 = AtomicU32::new(1);
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// `(epoch << 32) | slot` of this thread; 0 means "not assigned yet".
    static TAG: Cell<u64> = const { Cell::new(0) };
}

/// The allocator installed by `main.rs` with `#[global_allocator]`.
#[derive(Debug)]
pub struct CountingAlloc;

fn header_for(layout: Layout) -> usize {
    layout.align().max(MIN_HEADER)
}

/// This thread's tag for the current epoch, assigning a fresh slot if needed.
fn current_tag() -> u64 {
    let epoch = EPOCH.load(Ordering::Relaxed) as u64;
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
    }
    if (tag >> 32) as u32 == EPOCH.load(Ordering::Relaxed) {
        let slot = &SLOTS[(tag & 0xffff_ffff) as usize];
        let l = slot.live.fetch_add(delta, Ordering::Relaxed) + delta;
        if delta > 0 {
            slot.peak.fetch_max(l, Ordering::Relaxed);
        }
    }
}

// SAFETY: every block handed out is a `System` block of `size + header` bytes with
// the caller's alignment (or more), offset by `header` bytes, which is a multiple of
// the alignment, so the user pointer is aligned and `size` bytes are in bounds.
// `dealloc`/`realloc` undo the same offset with the same header size (a function of
// the layout only), so `System` always sees the layout it allocated with.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let h = header_for(layout);
        let Ok(full) = Layout::from_size_align(layout.size() + h, layout.align().max(MIN_HEADER)) else {
            return std::ptr::null_mut();
        };
        // SAFETY: `full` has non-zero size (h >= 16).
        let base = unsafe { System.alloc(full) };
        if base.is_null() {
            return base;
        }
        let tag = current_tag();
        // SAFETY: `base` is valid for `full.size() >= h >= 8` bytes and 16-aligned, so
        // the u64 header at the start is in bounds and aligned; `base + h` is in bounds.
        unsafe {
            (base as *mut u64).write(tag);
            charge(tag, layout.size() as i64);
            base.add(h)
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let h = header_for(layout);
        // SAFETY: `ptr` came from `alloc`/`realloc` above with this layout, so
        // `ptr - h` is the System block start holding our tag, allocated with `full`.
        unsafe {
            let base = ptr.sub(h);
            let tag = (base as *const u64).read();
            charge(tag, -(layout.size() as i64));
            let full = Layout::from_size_align_unchecked(layout.size() + h, layout.align().max(MIN_HEADER));
            System.dealloc(base, full);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let h = header_for(layout);
        let Some(new_full) = new_size.checked_add(h) else {
            return std::ptr::null_mut();
        };
        // SAFETY: as in `dealloc`, `ptr - h` is the start of a System block of
        // `layout.size() + h` bytes; System.realloc keeps the alignment and copies
        // the header along with the data. The new size is non-zero.
        unsafe {
            let base = ptr.sub(h);
            let tag = (base as *const u64).read();
            let full = Layout::from_size_align_unchecked(layout.size() + h, layout.align().max(MIN_HEADER));
            let nb = System.realloc(base, full, new_full);
            if nb.is_null() {
                return nb;
            }
            charge(tag, new_size as i64 - layout.size() as i64);
            nb.add(h)
        }
    }
}

/// Bytes currently allocated by the whole process (user sizes, headers excluded).
pub fn live_bytes() -> i64 {
    LIVE.load(Ordering::Relaxed)
}

/// Highest `live_bytes` since the last [`reset_peaks`].
pub fn peak_bytes() -> i64 {
    PEAK.load(Ordering::Relaxed)
}

/// Start a new measurement epoch: the process peak restarts at the current live
/// bytes, and per-thread slots restart at zero (threads get fresh slots on their next
/// allocation; blocks from earlier epochs are only charged to the process counters).
pub fn reset_peaks() {
    EPOCH.fetch_add(1, Ordering::SeqCst);
    for s in &SLOTS {
        s.live.store(0, Ordering::SeqCst);
        s.peak.store(0, Ordering::SeqCst);
    }
    NEXT_SLOT.store(0, Ordering::SeqCst);
    PEAK.store(LIVE.load(Ordering::SeqCst), Ordering::SeqCst);
}

/// The calling thread's slot in the current epoch (assigning one if needed).
pub fn my_slot() -> usize {
    (current_tag() & 0xffff_ffff) as usize
}

/// Peak bytes of every slot assigned in the current epoch, by slot index.
pub fn slot_peaks() -> Vec<i64> {
    let n = NEXT_SLOT.load(Ordering::SeqCst).min(MAX_SLOTS);
    SLOTS[..n].iter().map(|s| s.peak.load(Ordering::SeqCst)).collect()
}
