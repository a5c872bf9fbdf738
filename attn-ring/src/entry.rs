//! Shared entry and exit of the public calls: local input checks, the handshake,
//! the plan, conversion of this rank's rows, and the completion round.

use attn_core::error::TensorName;
use attn_core::{Element, Result, Shape4, TensorView};

use crate::comm::{CommStats, Communicator};
use crate::completion::complete;
use crate::handshake::{fingerprint, handshake};
use crate::local::Local;
use crate::plan::{Plan, RingProblem};

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

/// The local shape every input of `rank` must have.
pub(crate) fn local_shape(problem: &RingProblem, rank: usize) -> [usize; 4] {
    let rows = problem.layout.rows(problem.seq, problem.world, rank);
    [problem.batch, rows, problem.heads, problem.head_dim]
}

/// Check output shapes against `q`; the message is shared through the handshake.
pub(crate) fn check_out(
    problem: &RingProblem,
    rank: usize,
    outs: &[(TensorName, Shape4)],
    lse_len: usize,
) -> Option<String> {
    let want = local_shape(problem, rank);
    for (name, s) in outs {
        if s.dims() != want {
            return Some(format!("{name} has shape {:?}, expected {want:?}", s.dims()));
        }
    }
    let lse_want = want[0] * want[1] * want[2];
    if lse_len != lse_want && lse_len != usize::MAX {
        return Some(format!("lse has {lse_len} elements, expected {lse_want}"));
    }
    None
}

/// Check inputs, run the handshake, derive the plan and convert the rows.
pub(crate) fn prepare<'a, C: Communicator + ?Sized, T: Element>(
    comm: &mut C,
    op: &str,
    problem: &RingProblem,
    qkv: [TensorView<'a, T>; 3],
    extra: Option<String>,
) -> Result<Prepared<'a, T>> {
    let before = comm.stats();
    let rank = comm.rank();
    let want = local_shape(problem, rank);
    let mut err = extra;
    if problem.world != comm.world_size() {
        err = Some(format!("problem is for {} ranks but the communicator has {}", problem.world, comm.world_size()));
    }
    for (name, t) in [(TensorName::Query, qkv[0]), (TensorName::Key, qkv[1]), (TensorName::Value, qkv[2])] {
        if err.is_none() && t.shape().dims() != want {
            err = Some(format!("{name} has shape {:?}, expected {want:?}", t.shape().dims()));
        }
    }
    handshake(comm, &fingerprint(op, problem, T::DTYPE), err)?;
    let plan = Plan::new(problem.clone())?;
    let pos = problem.layout.positions(problem.seq, problem.world, rank);
    let [q, k, v] = qkv;
    let local = Local::new(pos, q, k, v);
    let start = comm.stats();
    Ok(Prepared { plan, local, start: (before, start) })
}

/// Completion rounds ([`crate::completion`]): every rank confirms success before anyone writes outputs.
pub(crate) fn finish<C: Communicator + ?Sized>(comm: &mut C, start: (CommStats, CommStats)) -> Result<RingStats> {
    let data_end = comm.stats();
    complete(comm)?;
    let end = comm.stats();
    Ok(RingStats {
        data_bytes_sent: data_end.payload_bytes_sent - start.1.payload_bytes_sent,
        data_messages: data_end.messages_sent - start.1.messages_sent,
        total_bytes_sent: end.frame_bytes_sent - start.0.frame_bytes_sent,
    })
}
