//! Memory measurement: counting-allocator windows per case and per rank, and peak RSS.
//!
//! Method (also printed in every report): a case's peak is the highest number of
//! heap bytes live during the case minus those live before its inputs were
//! allocated, so it counts inputs, outputs and workspace. Per-rank peaks come from
//! the allocator's per-thread slots: a rank's figure is the peak of bytes its thread
//! allocated and had not yet freed, with blocks passed to another rank still charged
//! to the sender until freed. The process peak RSS (VmHWM, reset through
//! /proc/self/clear_refs where the kernel allows it) is the cross-check.

use attn_reliability::counting_alloc;

/// One measurement window over the counting allocator.
#[derive(Debug)]
pub struct MemoryWindow {
    base_live: i64,
    rss_reset: bool,
    rss_base: Option<u64>,
}

/// What a window saw.
#[derive(Debug, Clone, Default)]
pub struct MemoryReading {
    /// Peak live heap bytes above the window's start.
    pub peak_bytes: u64,
    /// Peak live heap bytes of each thread slot that allocated in the window.
    pub slot_peaks: Vec<u64>,
    /// Process peak RSS (bytes) since the window started, if it could be reset;
    /// else the process-lifetime peak.
    pub peak_rss_bytes: Option<u64>,
    /// Whether `peak_rss_bytes` covers only this window.
    pub rss_windowed: bool,
    /// Process RSS (VmRSS) when the window started.
    pub rss_base_bytes: Option<u64>,
}

impl MemoryWindow {
    /// Start a window: reset the allocator peaks and (best effort) the RSS peak.
    pub fn start() -> Self {
        counting_alloc::new_thread_epoch();
        counting_alloc::reset_peaks();
        trim_heap();
        let rss_reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
        let rss_base = status_kb("VmRSS:");
        MemoryWindow { base_live: counting_alloc::snapshot().live, rss_reset, rss_base }
    }

    /// Read the window (it stays open; read again for a later peak).
    pub fn read(&self) -> MemoryReading {
        let peak = counting_alloc::snapshot().peak - self.base_live;
        MemoryReading {
            peak_bytes: peak.max(0) as u64,
            slot_peaks: counting_alloc::slot_peaks().into_iter().map(|p| p.max(0) as u64).collect(),
            peak_rss_bytes: peak_rss_bytes(),
            rss_windowed: self.rss_reset,
            rss_base_bytes: self.rss_base,
        }
    }
}

/// The calling thread's allocator slot in the current window.
pub fn my_slot() -> usize {
    counting_alloc::my_slot()
}

/// Process peak resident set size (VmHWM) in bytes, from /proc/self/status.
pub fn peak_rss_bytes() -> Option<u64> {
    status_kb("VmHWM:")
}

/// A `kB` line of /proc/self/status, in bytes.
fn status_kb(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Return free heap pages to the kernel (glibc), so the next window's RSS growth counts
/// the pages its allocations touch.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_heap() {
    // SAFETY: `malloc_trim` only releases memory malloc holds as free; it takes no
    // pointers and is thread-safe (it locks each arena while trimming it).
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_heap() {}

/// Serialises tests that open memory windows (a window resets process-wide peaks).
#[cfg(test)]
pub static TEST_WINDOW_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_sees_a_known_allocation_and_per_thread_slots() {
        let _guard = TEST_WINDOW_LOCK.lock();
        // Process-wide figures move with other tests' frees running in parallel; this
        // thread's own slot does not.
        let w = MemoryWindow::start();
        let v = vec![1u8; 3 << 20];
        let r = w.read();
        let mine = r.slot_peaks.get(my_slot()).copied().unwrap_or(0);
        assert!(mine >= 3 << 20, "own slot peak {mine}");
        drop(v);
        // A block allocated on one thread and freed on another stays charged to its
        // allocator until freed, and to no one after.
        let w = MemoryWindow::start();
        let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
        let t = std::thread::spawn(move || {
            let slot = my_slot();
            tx.send(vec![7u8; 5 << 20]).ok();
            slot
        });
        let got = rx.recv().ok();
        let sender = t.join().unwrap_or(usize::MAX);
        drop(got);
        let r = w.read();
        assert!(r.slot_peaks.get(sender).copied().unwrap_or(0) >= 5 << 20, "{:?}", r.slot_peaks);
    }
}
