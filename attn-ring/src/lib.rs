//! Sequence parallelism for dilated attention: the sequence is split over `p`
//! ranks (contiguous or zigzag, any length) and each rank computes exactly the
//! rows the single-device function would, by exchanging only the selected k/v
//! rows of segments that span ranks (ring pass or direct all-gather), with an
//! exact backward whose dk/dv travel back to their owners. The chunk ring
//! ([`chunk_ring`]) instead sends whole k/v slices over a `ChunkTransport`, with CPU or
//! CUDA block compute. The head strategies ([`Strategy::Ulysses`], [`Strategy::Hybrid`])
//! split heads instead: an all-to-all gives each rank whole sequences (or its group's
//! rows) of its share of the heads, and a second one returns the outputs.
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
//!
//! # Structure
//!
//! Sequence parallelism, in five parts. `RingBackend` (top level) is one
//! rank behind the `Attention` interface (placement `Shard`, its rows from the layout);
//! `in_process` runs a whole problem over in-process ranks.
//! - `comm/`: `Communicator` (paired sendrecv, all-gather, `all_to_all` over a group of
//!   ranks (one framed exchange, so every transport has it), barrier, timeouts, framed
//!   messages with sequence, length and checksum; `framing()` reads the framing state,
//!   `framing_mut()` changes it) with `ThreadComm`, `MpiComm` (feature `mpi`),
//!   `NcclComm` (feature `nccl`: `GroupedComm` over grouped NCCL rounds, where a send
//!   waits for its receive, so frames `post`ed without a receive travel with the rank's
//!   next exchange; the communicator is non-blocking (`nccl_handle`, the only raw NCCL
//!   calls, through the functions `nccl_library` reads from the libnccl it finds:
//!   `ATTN_NCCL_PATH`, `libnccl.so.2`, `libnccl.so`, added and toolkit directories),
//!   every step polled against one deadline by `nccl_progress` and aborted on
//!   failure or timeout; the protocol is tested on the in-process `EmulatedNccl`, and the
//!   real `NcclComm` code without a GPU against stand-in `libcuda`/`libnccl` libraries,
//!   `tests/stand_in_gpu/stand_in_gpu.c`) and the fault-injecting `FaultyComm`.
//! - `plan/`: `Layout` (contiguous, zigzag; any length, packed sequences split by
//!   token); `RingProblem` (global shapes, k/v heads, the global key padding and
//!   `cu_seqlens`); `Plan`/`Strategy` (up to `MAX_WORLD` = 4096 ranks and `MAX_PAIRS`
//!   = 2^20 (pattern, head) pairs: its tables grow as world^2 and list each pair;
//!   per-pattern row counts come from `head_counts` in O(1)) choosing segment-local,
//!   ring pass or all-gather per pattern, and under `Auto` whether a head strategy runs
//!   instead (`choose`: a cost model of bytes, messages and workspace per rank); the rows that travel are the owner's keys in
//!   a receiver's segments within its queries' band, once per (pattern, key/value head)
//!   pair; `heads_split` (the head strategies: groups of `U` consecutive ranks, slot `j`
//!   of a group attending query heads `slot_heads(j)`, the first `heads % U` slots one more,
//!   with the key/value heads they read; `heads < U` is `Unsupported`; `heads_bytes`, their
//!   bytes per rank) and `heads_place` (a rank's group, slot, members and rows in that
//!   split, for the host path and the chunk ring alike); `ring_route` (a ring block goes to the next rank, the previous one or both
//!   ways, split where it reaches its receivers in the fewest hops, so a two-sided window
//!   moves one hop each way); `workspace`
//!   (`Plan::workspace_bytes`, `forward_buffer_bytes`: a rank's memory from the plan
//!   alone).
//! - `protocol/`: `handshake` (config, shapes, dtype, budget and finite checks, the same
//!   verdict on every rank; a gradient into the LSE is judged after the exchanges and its
//!   verdict shared in `completion`), `wire` (byte encoding of data messages), `call` (the shared
//!   entry and exit of the public calls, `RingOptions`: a per-rank `MemoryBudget`,
//!   `check_finite`, and `threads`, a rank's compute threads) and `completion` (the
//!   two-round step: per-peer frame-count tables, then every rank's verdict, before any
//!   output is written).
//! - `compute/`: `rank_rows` (a rank's rows with their positions, and the key blocks it
//!   exchanges), `kernel_bridge` (the kernels' block entry on those rows), `forward`
//!   (`ring_forward`: local patterns, all-gathered and ring-pass blocks LSE-merged),
//!   `allgather_forward` (the forward when no pattern uses the ring pass: pieces of one
//!   (pattern, head), an eighth of the smallest such message, 128 to 1024 rows, spread
//!   evenly over the rounds a pair of ranks shares and posted one round ahead, attended on
//!   arrival into compact f32 partials and dropped; then each (batch, head) over its own
//!   keys in 512-row chunks, so per-rank memory stays proportional to n/p; a test
//!   measures the buffers within 10% of `forward_buffer_bytes`), `backward` (recomputes
//!   the forward, keeps only its LSE and `delta = grad_out . out - grad_lse`, reads grad_out in
//!   place and holds f32 dq, dk, dv until the completion step), `head_work` (work
//!   split by (batch, head) over a rank's threads) and the head strategies: `ulysses` (the
//!   all-to-all into the group's rows of a slot's heads, the ring of one slot over the
//!   groups passing each group's keys and values (in the backward with their dk/dv, then
//!   home), the all-to-all of out and lse, or of dq, dk and dv) and `ulysses_attend` (a
//!   slot's heads on one group's keys at a time through the same block kernels, LSE-merged
//!   forward and backward).
//! - `chunk_ring/`: the chunk ring, one protocol generic over where blocks are computed
//!   (`ChunkCompute`: `CpuChunks` on the CPU block kernels, `CudaChunks` (feature `cuda`) on
//!   the CUDA block entries, with pieces, partials, lse, delta and accumulators in device
//!   memory, each counted in the rank's `DeviceMeter`) and how rows move (`ChunkTransport`:
//!   `HostTransport` stages a step's buffers as one checked data message over any
//!   `Communicator`; `InProcessTransport` hands the buffers themselves to the next rank's
//!   thread, counting each hand-over as the message it replaces (`ChunkTransport::moved`),
//!   so a call's statistics equal host staging's; `NcclDeviceTransport` (features `nccl` + `cuda`) sends a `DeviceBuffers`
//!   compute's device buffers by NCCL on a stream of its own after a checked header over
//!   the control communicator; its communicator and stream, an `NcclDeviceLink`, can be
//!   joined once and lent to many calls). A shift is started, then finished: the forward computes a
//!   step's blocks with the k/v slices it is sending in between. A rank's rows are pieces, one per contiguous range of its layout; the k/v rows
//!   travel around the ring in `ChunkOptions::rounds` rounds, each carrying one slice of
//!   every piece, only to the ranks whose queries reach them (`reach::chunk_trips`, by
//!   the problem's strategy: `Ring`, a trip each way routed as the plan ring routes a
//!   block: none when segments sit inside ranks, one step for a causal window, one each
//!   way for a two-sided one; `AllGather`, straight to the rank each needed distance on;
//!   `Auto`, straight where that takes fewer messages), the backward's dk/dv with them and
//!   then straight home (`Travel::hop` ranks on), reusing the handshake (which includes the
//!   rounds) and completion rounds. It sends whole slices, not the plan's selected rows;
//!   where nothing travels, each rank attends its own pieces whole in one round. The
//!   backward takes an optional gradient into the LSE, one per-row piece per query piece,
//!   checked before the handshake and folded into each row's delta. An explicit
//!   `Ulysses` or `Hybrid` runs `chunk_ring/heads` instead: the transport's all-to-all
//!   (`ChunkTransport::all_to_all`: host-staged, in process, or by `NcclDeviceTransport`
//!   as one grouped NCCL round between device buffers after a checked header from each
//!   member) hands each member of a
//!   group its slot's heads of every piece (the host path's `HeadSplit` and `HeadPlace`),
//!   blocks attend a `HeadSlot` of heads, the slot's ranks pass their groups' k/v as
//!   travels of `U` ranks (the backward's dk/dv with them, then home), and a second
//!   all-to-all returns out and lse, or dq, dk and dv; the bytes are `expected_bytes`'.
//!   The CPU compute attends slots; the CUDA compute refuses the head strategies with
//!   `Unsupported` (its kernels attend every head).
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
    MAX_PAIRS, MAX_WORLD, PatternStrategy, Plan, RingProblem, Strategy, Traffic, expected_bytes, expected_traffic,
    forward_buffer_bytes,
};
pub use protocol::call::{RingOptions, RingStats};
