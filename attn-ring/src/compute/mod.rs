//! What a rank computes: its rows and the key blocks it exchanges (`rank_rows`), the
//! bridge to the kernels' block entry (`kernel_bridge`), the ring-pass forward and the
//! all-gather forward, the exact backward, the per-(batch, head) compute threads, and the head strategies
//! (`ulysses`: the all-to-alls; `ulysses_attend`: a slot's compute).

pub(crate) mod allgather_forward;
pub(crate) mod backward;
pub(crate) mod forward;
pub(crate) mod head_work;
pub(crate) mod kernel_bridge;
pub(crate) mod rank_rows;
pub(crate) mod ulysses;
pub(crate) mod ulysses_attend;
