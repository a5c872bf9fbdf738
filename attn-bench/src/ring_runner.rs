//! Ring cases: `P` in-process ranks, one persistent thread each, running
//! `attn_ring::ring_forward` / `ring_backward` over `ThreadComm`.
//!
//! Each rank allocates its own rows (never the global tensors) on its own thread, so
//! the counting allocator's per-thread peaks are per-rank peaks. A call is timed from
//! the moment every rank is told to start until the last rank reports back.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

use attn_core::error::TensorName;
use attn_core::{AttnError, DType, Element, OwnedMasks, Result, Shape4, TensorView, TensorViewMut};
use attn_kernels::zeroed_buffer;
use attn_ring::{BackwardOutputs, RingProblem, RingStats, ThreadComm};
use half::{bf16, f16};

use crate::case::CaseSpec;
use crate::inputs::normal_vec;
use crate::runner::{RunStats, Runner};

/// How long the driver waits for a rank's answer before calling the case failed.
const RANK_ANSWER_TIMEOUT: Duration = Duration::from_secs(900);

/// Build the ring runner for `spec` in its dtype.
pub fn ring(spec: &CaseSpec) -> Result<Box<dyn Runner>> {
    match spec.dtype {
        DType::F32 => Ok(Box::new(RingRunner::new::<f32>(spec)?)),
        DType::BF16 => Ok(Box::new(RingRunner::new::<bf16>(spec)?)),
        DType::F16 => Ok(Box::new(RingRunner::new::<f16>(spec)?)),
        other => Err(AttnError::InvalidArgument(format!("dtype {} is not benchmarked on the ring", other.as_str()))),
    }
}

/// The ring problem of `spec` (strategy `auto` and layout `contiguous` where unset;
/// k and v with `kv_heads` heads; the block-sparse rows' mask on every rank).
pub fn problem(spec: &CaseSpec) -> Result<RingProblem> {
    if spec.varlen.is_some() || spec.repeat_kv {
        return Err(AttnError::InvalidArgument(
            "ring cases take grouped heads and windows; variable-length sequences and repeated K/V run on one rank"
                .into(),
        ));
    }
    let (strategy, layout) = (spec.strategy.unwrap_or_default(), spec.layout.unwrap_or_default());
    layout.check(spec.seq_len, spec.world_size)?;
    let problem = RingProblem::new(&spec.config()?, spec.attn_shape()?, layout, strategy, spec.world_size);
    Ok(match spec.block_sparse {
        Some(b) => problem.with_masks(OwnedMasks::none().with_block_mask(crate::block_sparse::mask(&b, spec.seq_len)?)),
        None => problem,
    })
}

struct RingRunner {
    slots: Vec<usize>,
    go: Vec<Sender<()>>,
    done: Receiver<(usize, Result<RingStats>)>,
    handles: Vec<JoinHandle<()>>,
}

/// One rank's state: its communicator and its own rows.
struct Rank<T> {
    comm: ThreadComm,
    problem: RingProblem,
    shape: Shape4,
    /// The shape of this rank's k and v rows (`kv_heads` heads).
    kv_shape: Shape4,
    backward: bool,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    grad_out: Vec<T>,
}

impl<T: Element> Rank<T> {
    fn call(&mut self) -> Result<RingStats> {
        let (s, kvs) = (self.shape, self.kv_shape);
        let view = |name, x, shape| TensorView::contiguous(name, x, shape);
        let (q, k, v) = (
            view(TensorName::Query, &self.q, s)?,
            view(TensorName::Key, &self.k, kvs)?,
            view(TensorName::Value, &self.v, kvs)?,
        );
        if self.backward {
            let (n, nk) = (s.numel(), kvs.numel());
            let (mut dq, mut dk, mut dv) = (zeroed_buffer(n)?, zeroed_buffer(nk)?, zeroed_buffer(nk)?);
            let outs = BackwardOutputs {
                dq: &mut TensorViewMut::contiguous(TensorName::GradQuery, &mut dq, s)?,
                dk: &mut TensorViewMut::contiguous(TensorName::GradKey, &mut dk, kvs)?,
                dv: &mut TensorViewMut::contiguous(TensorName::GradValue, &mut dv, kvs)?,
            };
            let g = view(TensorName::GradOutput, &self.grad_out, s)?;
            attn_ring::ring_backward(&mut self.comm, &self.problem, [q, k, v], g, outs)
        } else {
            let mut out = zeroed_buffer(s.numel())?;
            let mut lse = vec![0.0f32; s.lse_len()];
            let mut ov = TensorViewMut::contiguous(TensorName::Output, &mut out, s)?;
            attn_ring::ring_forward(&mut self.comm, &self.problem, [q, k, v], &mut ov, &mut lse)
        }
    }
}

impl RingRunner {
    fn new<T: Element>(spec: &CaseSpec) -> Result<Self> {
        let problem = problem(spec)?;
        let p = spec.world_size;
        let comms = ThreadComm::world(p)?;
        let (done_tx, done) = channel();
        let (slot_tx, slot_rx) = channel();
        let (mut go, mut handles) = (Vec::with_capacity(p), Vec::with_capacity(p));
        for (rank, comm) in comms.into_iter().enumerate() {
            let (go_tx, go_rx) = channel::<()>();
            let (done_tx, slot_tx) = (done_tx.clone(), slot_tx.clone());
            let (problem, backward) = (problem.clone(), spec.backward);
            let rows = problem.layout.rows(problem.seq, p, rank);
            let shape = spec.shape()?.with_seq(rows)?;
            let kv_shape = spec.attn_shape()?.kv.with_seq(rows)?;
            let handle = std::thread::Builder::new()
                .name(format!("attn-rank-{rank}"))
                .spawn(move || {
                    // The rank's rows are allocated here, on the rank's own thread.
                    let _ = slot_tx.send((rank, crate::memory::my_slot()));
                    drop(slot_tx);
                    let (n, nk) = (shape.numel(), kv_shape.numel());
                    let seed = 16 * rank as u64;
                    let mut r = Rank::<T> {
                        comm,
                        problem,
                        shape,
                        kv_shape,
                        backward,
                        q: normal_vec(seed + 1, n),
                        k: normal_vec(seed + 2, nk),
                        v: normal_vec(seed + 3, nk),
                        grad_out: if backward { normal_vec(seed + 4, n) } else { Vec::new() },
                    };
                    while go_rx.recv().is_ok() {
                        if done_tx.send((rank, r.call())).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|e| AttnError::InvalidArgument(format!("could not spawn rank {rank}: {e}")))?;
            go.push(go_tx);
            handles.push(handle);
        }
        drop(slot_tx);
        let mut slots = vec![usize::MAX; p];
        for _ in 0..p {
            let (rank, slot) = slot_rx
                .recv_timeout(RANK_ANSWER_TIMEOUT)
                .map_err(|_| AttnError::Comm { rank: usize::MAX, message: "a rank thread did not start".into() })?;
            slots[rank] = slot;
        }
        Ok(RingRunner { slots, go, done, handles })
    }
}

impl Runner for RingRunner {
    fn run(&mut self) -> Result<RunStats> {
        for g in &self.go {
            g.send(()).map_err(|_| AttnError::Comm { rank: usize::MAX, message: "a rank thread exited".into() })?;
        }
        let mut stats = vec![RingStats::default(); self.go.len()];
        let mut first_err = None;
        for _ in 0..self.go.len() {
            let (rank, res) = self.done.recv_timeout(RANK_ANSWER_TIMEOUT).map_err(|_| AttnError::Comm {
                rank: usize::MAX,
                message: "a rank did not answer (thread died or hung)".into(),
            })?;
            match res {
                Ok(s) => stats[rank] = s,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(RunStats {
                bytes_sent: stats.iter().map(|s| s.total_bytes_sent).collect(),
                data_bytes_sent: stats.iter().map(|s| s.data_bytes_sent).collect(),
                data_messages: stats.iter().map(|s| s.data_messages).collect(),
                rank_slots: self.slots.clone(),
                device_bytes: None,
            }),
        }
    }
}

impl Drop for RingRunner {
    fn drop(&mut self) {
        self.go.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}
