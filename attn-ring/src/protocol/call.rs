//! Shared entry and exit of the public calls: local input checks, the handshake,
//! the plan, conversion of this rank's rows, and the completion round.

use attn_core::FiniteCheck;
use attn_core::error::TensorName;
use attn_core::{AttnError, Element, MemoryBudget, Pass, Result, Shape4, TensorView, check_finite};

use crate::comm::{CommStats, Communicator};
use crate::compute::rank_rows::Local;
use crate::plan::{Plan, RingProblem};
use crate::protocol::completion::complete;
use crate::protocol::handshake::{Refusal, fingerprint, handshake};

/// Opt-in checks of a ring call, decided by every rank together in the handshake
/// (before anything proportional to the problem is allocated or sent).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingOptions {
    /// Refuse the call with `AttnError::OverBudget` on every rank when
    /// [`Plan::max_workspace_bytes`] exceeds this budget (on any rank).
    pub budget: MemoryBudget,
    /// Check q, k, v (and grad_out in the backward) for NaN and infinities first: one
    /// anywhere is `AttnError::NonFinite` on every rank, naming the tensor and the flat
    /// index of the value in the GLOBAL `[batch, seq, heads, head_dim]` tensor. A
    /// gradient into the LSE is checked on the rows that attend something, known only
    /// after the exchanges: the rank holding the value returns `NonFinite` (global
    /// `[batch, seq, heads]` index) and every other rank a `Comm` error naming that rank.
    pub check_finite: bool,
    /// Threads this rank computes with: in the all-gather forward each received piece
    /// (split by runs of query rows) and its own keys after the completion round
    /// (chunk by chunk; the bulk of the work when most segments sit inside one rank),
    /// and in the ring-pass forward and in the backward every block (own rows,
    /// gathered and visiting blocks) split by (batch, head). Messages are sent and
    /// received by the calling thread. 0 or 1: the calling thread only. A local
    /// choice (ranks may differ); results are bit-identical for any value. Each worker
    /// beyond the first adds its own kernel scratch (about `2 * 1024 * D * 4` bytes)
    /// and, in the all-gather forward, chunk buffers (`3 * 512 * (D + 1) * 4` bytes),
    /// in the ring-pass forward's last hop one (batch, pair)'s decoded k/v rows; none
    /// of which [`crate::Plan::workspace_bytes`] counts.
    pub threads: usize,
}

impl RingOptions {
    /// Set the memory budget.
    pub fn with_budget(mut self, budget: MemoryBudget) -> Self {
        self.budget = budget;
        self
    }
    /// Switch the finite-input check on or off.
    pub fn with_check_finite(mut self, check: FiniteCheck) -> Self {
        self.check_finite = check == FiniteCheck::Inputs;
        self
    }
    /// Set the compute threads of this rank (see [`RingOptions::threads`]).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads;
        self
    }
}

/// What one call sent from this rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingStats {
    /// Payload bytes of the attention data messages (what [`crate::expected_bytes`] predicts).
    pub data_bytes_sent: u64,
    /// Data messages sent.
    pub data_messages: u64,
    /// All bytes sent during the call, frame headers, handshake and completion round included.
    pub total_bytes_sent: u64,
}

pub(crate) struct Prepared<'a, T> {
    pub plan: Plan,
    pub local: Local<'a, T>,
    pub start: (CommStats, CommStats),
}

/// The local shape a tensor of `rank` must have: q, out, grad_out and dq with the query
/// heads, k, v, dk and dv with the key/value heads.
pub(crate) fn local_shape(problem: &RingProblem, rank: usize, tensor: TensorName) -> [usize; 4] {
    let rows = problem.layout.rows(problem.seq, problem.world, rank);
    let kv = matches!(tensor, TensorName::Key | TensorName::Value | TensorName::GradKey | TensorName::GradValue);
    [problem.batch, rows, if kv { problem.kv_heads } else { problem.heads }, problem.head_dim]
}

/// Check output shapes against `q`; the message is shared through the handshake.
pub(crate) fn check_out(
    problem: &RingProblem,
    rank: usize,
    outs: &[(TensorName, Shape4)],
    lse: Option<(TensorName, usize)>,
) -> Option<String> {
    for (name, s) in outs {
        let want = local_shape(problem, rank, *name);
        if s.dims() != want {
            return Some(format!("{name} has shape {:?}, expected {want:?}", s.dims()));
        }
    }
    let want = local_shape(problem, rank, TensorName::Output);
    let lse_want = want[0] * want[1] * want[2];
    match lse {
        Some((name, len)) if len != lse_want => Some(format!("{name} has {len} elements, expected {lse_want}")),
        _ => None,
    }
}

/// The global flat index of local flat index `i` of a `[batch, rows, heads, d]` view
/// holding this rank's rows.
pub(crate) fn global_index(problem: &RingProblem, rank: usize, local: Shape4, i: usize) -> usize {
    let (d, h, nl) = (local.head_dim, local.heads, local.seq);
    let (e, hh, s, b) = (i % d, (i / d) % h, (i / (d * h)) % nl, i / (d * h * nl));
    let pos = problem.layout.ranges(problem.seq, problem.world, rank).into_iter().flatten().nth(s).unwrap_or(s);
    ((b * problem.seq + pos) * h + hh) * d + e
}

/// The local checks whose failure every rank must share: shapes (`err`), then the
/// budget, then finite values.
fn local_refusal<T: Element>(
    problem: &RingProblem,
    rank: usize,
    plan: &Result<Plan>,
    opts: &RingOptions,
    inputs: &[(TensorName, TensorView<'_, T>)],
    backward: bool,
    err: Option<String>,
) -> Option<Refusal> {
    if let Some(e) = err {
        return Some(Refusal::Inputs(e));
    }
    let plan = plan.as_ref().ok()?;
    if let Some(budget) = opts.budget.bytes {
        let pass = if backward { Pass::Backward } else { Pass::Forward };
        let needed = plan.max_workspace_bytes(T::DTYPE, pass);
        if needed > budget as u64 {
            return Some(Refusal::OverBudget { needed, budget: budget as u64 });
        }
    }
    if opts.check_finite {
        for (name, t) in inputs {
            if let Err(AttnError::NonFinite { tensor, index }) = check_finite(*name, t) {
                return Some(Refusal::NonFinite { tensor, index: global_index(problem, rank, t.shape(), index) });
            }
        }
    }
    None
}

/// Check inputs (and, as `opts` asks, the budget and finite values), run the
/// handshake, derive the plan and convert the rows. `grad_out` is the backward's.
pub(crate) fn prepare<'a, C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    op: &str,
    problem: &RingProblem,
    opts: &RingOptions,
    qkv: [TensorView<'a, T>; 3],
    grad_out: Option<TensorView<'_, T>>,
    extra: Option<String>,
) -> Result<Prepared<'a, T>> {
    let before = comm.stats();
    let (rank, world) = (comm.rank(), comm.world_size());
    if rank >= world {
        // No handshake is possible: the communicator itself is invalid.
        return Err(AttnError::InvalidArgument(format!("communicator has rank {rank} in a world of {world} ranks")));
    }
    let mut err = extra;
    if problem.world != world {
        err = Some(format!("problem is for {} ranks but the communicator has {world}", problem.world));
    }
    let mut inputs = vec![(TensorName::Query, qkv[0]), (TensorName::Key, qkv[1]), (TensorName::Value, qkv[2])];
    for (name, t) in &inputs {
        let want = local_shape(problem, rank, *name);
        if err.is_none() && t.shape().dims() != want {
            err = Some(format!("{name} has shape {:?}, expected {want:?}", t.shape().dims()));
        }
    }
    inputs.extend(grad_out.map(|g| (TensorName::GradOutput, g)));
    // The plan is derived from `problem` alone (identical on every rank, which the
    // handshake confirms); its error, if any, is returned after the handshake. Not for
    // a world other than the communicator's (its tables grow as world^2): that refusal
    // is already shared, so the placeholder error is never returned.
    let plan = if problem.world == world {
        Plan::new(problem.clone())
    } else {
        Err(AttnError::InvalidArgument("problem and communicator disagree on the world size".into()))
    };
    let refusal = local_refusal(problem, rank, &plan, opts, &inputs, grad_out.is_some(), err);
    handshake(comm, &fingerprint(op, problem, T::DTYPE), refusal)?;
    let plan = plan?;
    let pos = problem.layout.positions(problem.seq, problem.world, rank);
    let [q, k, v] = qkv;
    let local = Local::new(pos, q, k, v);
    let start = comm.stats();
    Ok(Prepared { plan, local, start: (before, start) })
}

/// Completion rounds ([`crate::protocol::completion`]): every rank confirms success before anyone writes outputs.
pub(crate) fn finish<C: Communicator + ?Sized>(comm: &mut C, start: (CommStats, CommStats)) -> Result<RingStats> {
    finish_with(comm, start, Ok(()))
}

/// [`finish`] with this rank's own verdict on its inputs (`local`), which every rank
/// then shares.
pub(crate) fn finish_with<C: Communicator + ?Sized>(
    comm: &mut C,
    start: (CommStats, CommStats),
    local: Result<()>,
) -> Result<RingStats> {
    let data_end = comm.stats();
    complete(comm, local)?;
    let end = comm.stats();
    Ok(RingStats {
        data_bytes_sent: data_end.payload_bytes_sent - start.1.payload_bytes_sent,
        data_messages: data_end.messages_sent - start.1.messages_sent,
        total_bytes_sent: end.frame_bytes_sent - start.0.frame_bytes_sent,
    })
}
