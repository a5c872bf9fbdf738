//! Sequence parallelism for dilated attention: the sequence is split over `p`
//! ranks (contiguous or zigzag, any length) and each rank computes exactly the
//! rows the single-device function would, by exchanging only the selected k/v
//! rows of segments that span ranks (ring pass or direct all-gather), with an
//! exact backward whose dk/dv travel back to their owners. The chunk ring
//! ([`chunk_ring`]) instead sends whole k/v slices over a `ChunkTransport`, with CPU or
//! CUDA block compute.
//!
//! Communication goes through the [`Communicator`] trait: [`ThreadComm`]
//! (in-process ranks), `MpiComm` (feature `mpi`) and [`NcclComm`] (feature
//! `nccl`); [`FaultyComm`] injects faults. Every message is framed (sequence,
//! length, checksum) and every receive has a timeout, so a fault is a typed
//! error on every live rank, never a wrong answer or a hang. Every call ends in a
//! two-round completion protocol (per-peer frame-count tables, then verdicts; see
//! `completion`), so any fault before the last round fails every rank alike.
//!
//! [`ring_workspace_bytes`] (and [`Plan::workspace_bytes`] per rank) bounds what a
//! rank allocates during a call, from the plan alone; [`ring_forward_with`] and
//! [`ring_backward_with`] take [`RingOptions`]: a memory budget and a finite-input
//! check, decided by all ranks together in the handshake, so a refused call fails
//! every rank alike (`OverBudget`, `NonFinite`) before anything large is allocated or sent.
//! A gradient into the LSE is checked only on the rows that attend something, known
//! after the exchanges: that verdict is shared in the completion step (`NonFinite` on
//! the rank holding the value, `Comm` naming it on the others).
//!
//! ```
//! use attn_core::{DilatedConfig, Shape4, TensorName, TensorView};
//! use attn_kernels::CpuBackend;
//! use attn_ring::{Layout, Strategy, run_in_process};
//! # fn main() -> attn_core::Result<()> {
//! let cfg = DilatedConfig::builder().segments(&[8, 32]).dilations(&[1, 4]).build()?;
//! let shape = Shape4::new(1, 40, 2, 8)?;
//! let x: Vec<f32> = (0..shape.numel()).map(|i| (i as f32 * 0.3).cos()).collect();
//! let view = || TensorView::contiguous(TensorName::Query, &x, shape);
//! // Three in-process ranks, zigzag layout; the result is the single-device result.
//! let ring = run_in_process(3, &cfg, Layout::Zigzag, Strategy::Auto, view()?, view()?, view()?)?;
//! let (out, _lse) = CpuBackend::new(1)?.forward_vec(&cfg, shape, &x, &x, &x)?;
//! let worst = ring.out.iter().zip(&out).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
//! assert!(worst < 1e-5, "{worst}");
//! # Ok(()) }
//! ```
// Without MPI/NCCL there is no unsafe code at all; with them, only the
// `comm::mpi_comm`, `comm::nccl_comm`, `comm::nccl_handle` and `comm::nccl_library`
// modules may opt in.
#![cfg_attr(not(any(feature = "mpi", feature = "nccl")), forbid(unsafe_code))]
#![cfg_attr(any(feature = "mpi", feature = "nccl"), deny(unsafe_code))]

mod backend;
pub mod chunk_ring;
pub mod comm;
mod compute;
mod in_process;
pub mod plan;
mod protocol;

pub use backend::{RingBackend, cross_attention_refused};
pub use comm::{CommStats, Communicator, Fault, FaultyComm, NcclComm, ThreadComm};
pub use compute::backward::{BackwardOutputs, ring_backward, ring_backward_with};
pub use compute::forward::{ring_forward, ring_forward_with};
pub use in_process::{
    BackwardResult, ForwardResult, RankBackward, RankForward, backward_on, backward_on_with, forward_on,
    forward_on_with, local_rows, problem_for, run_backward_on, run_in_process, run_in_process_backward,
    run_in_process_with_timeout, run_on, run_problem_backward_on, run_problem_on,
};
pub use plan::layout::Layout;
pub use plan::workspace::ring_workspace_bytes;
pub use plan::{
    MAX_PAIRS, MAX_WORLD, PatternStrategy, Plan, RingProblem, Strategy, expected_bytes, forward_buffer_bytes,
};
pub use protocol::call::{RingOptions, RingStats};
