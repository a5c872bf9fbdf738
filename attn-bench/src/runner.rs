//! `Runner`: one prepared case, called repeatedly by the measurement loop, and the
//! `RunStats` each call reports besides its time.

use attn_core::Result;

/// What one call reports besides its time.
#[derive(Debug, Clone, Default)]
pub struct RunStats {
    /// Bytes each rank sent (ring cases).
    pub bytes_sent: Vec<u64>,
    /// Bytes and count of each rank's attention data messages (ring cases).
    pub data_bytes_sent: Vec<u64>,
    pub data_messages: Vec<u64>,
    /// The counting allocator slot of each rank's thread (ring cases).
    pub rank_slots: Vec<usize>,
    /// Device memory the call held (CUDA cases), see `Measurement::device_bytes`.
    pub device_bytes: Option<u64>,
}

/// One prepared case: inputs allocated, ready to be called repeatedly.
pub trait Runner {
    /// One forward (or forward + backward) call.
    fn run(&mut self) -> Result<RunStats>;
}
