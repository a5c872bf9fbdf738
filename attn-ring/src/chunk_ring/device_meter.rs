//! Per-rank accounting of device memory: ranks sharing one GPU cannot tell their memory
//! apart through the driver, so each rank's compute counts the buffers it holds
//! ([`Metered`]) in its own [`DeviceMeter`], live and peak.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Live and peak bytes of the device buffers one rank holds.
#[derive(Debug, Default)]
pub struct DeviceMeter {
    live: AtomicU64,
    peak: AtomicU64,
}

impl DeviceMeter {
    fn add(&self, bytes: u64) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn sub(&self, bytes: u64) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Bytes held now.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    /// The most bytes held at once since the meter was made (or [`DeviceMeter::reset_peak`]).
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Start a new peak from what is held now.
    pub fn reset_peak(&self) {
        self.peak.store(self.live(), Ordering::Relaxed);
    }
}

/// A buffer counted in a rank's meter for as long as it lives.
#[derive(Debug)]
pub struct Metered<B> {
    buf: B,
    bytes: u64,
    meter: Arc<DeviceMeter>,
}

impl<B> Metered<B> {
    /// Count `buf` (`bytes` of device memory) in `meter` until it drops.
    pub fn new(buf: B, bytes: u64, meter: &Arc<DeviceMeter>) -> Self {
        meter.add(bytes);
        Metered { buf, bytes, meter: meter.clone() }
    }

    /// The bytes counted for this buffer.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl<B> Deref for Metered<B> {
    type Target = B;
    fn deref(&self) -> &B {
        &self.buf
    }
}

impl<B> DerefMut for Metered<B> {
    fn deref_mut(&mut self) -> &mut B {
        &mut self.buf
    }
}

impl<B> Drop for Metered<B> {
    fn drop(&mut self) {
        self.meter.sub(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_meter_follows_live_buffers_and_keeps_the_peak() {
        let m = Arc::new(DeviceMeter::default());
        let a = Metered::new((), 100, &m);
        {
            let _b = Metered::new((), 50, &m);
            assert_eq!((m.live(), m.peak()), (150, 150));
        }
        assert_eq!((m.live(), m.peak()), (100, 150));
        m.reset_peak();
        assert_eq!(m.peak(), 100);
        drop(a);
        assert_eq!(m.live(), 0);
    }
}
