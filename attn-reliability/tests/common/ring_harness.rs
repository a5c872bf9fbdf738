//! Run the ring forward or backward on in-process ranks over any communicators (e.g.
//! `FaultyComm`), returning each rank's own result: the harness of the fault and soak tests.

use std::time::Duration;

use attn_core::error::TensorName;
use attn_core::{AttnError, DilatedConfig, Result, Shape4, TensorView, TensorViewMut};
use attn_ring::{BackwardOutputs, Communicator, Fault, FaultyComm, Layout, RingProblem, Strategy, ThreadComm};
use attn_ring::{local_rows, problem_for, ring_backward, ring_forward};
use attn_testkit::rng::random_vec;

/// Which call the ranks make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `ring_forward`: each rank returns its `out` rows followed by its `lse` rows.
    Forward,
    /// `ring_backward`: each rank returns its `dq`, `dk`, `dv` rows, concatenated.
    Backward,
}

/// A global problem with seeded inputs.
#[derive(Debug, Clone)]
pub struct RingCase {
    pub problem: RingProblem,
    pub shape: Shape4,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub grad_out: Vec<f32>,
}

impl RingCase {
    /// Seeded standard-normal q, k, v, grad_out for `shape` split over `world` ranks.
    pub fn new(
        cfg: &DilatedConfig,
        shape: Shape4,
        layout: Layout,
        strategy: Strategy,
        world: usize,
        seed: u64,
    ) -> Self {
        let n = shape.numel();
        RingCase {
            problem: problem_for(cfg, shape, layout, strategy, world),
            shape,
            q: random_vec(seed, n),
            k: random_vec(seed + 1, n),
            v: random_vec(seed + 2, n),
            grad_out: random_vec(seed + 3, n),
        }
    }

    /// One rank's call on its rows.
    pub fn run_rank<C: Communicator>(&self, comm: &mut C, op: Op) -> Result<Vec<f32>> {
        let s = self.shape;
        let pr = &self.problem;
        let pos = pr.layout.positions(s.seq, pr.world, comm.rank());
        let ls = s.with_seq(pos.len().max(1))?;
        let global = |name, x: &[f32]| -> Result<Vec<f32>> { local_rows(&TensorView::contiguous(name, x, s)?, &pos) };
        let (lq, lk, lv) = (
            global(TensorName::Query, &self.q)?,
            global(TensorName::Key, &self.k)?,
            global(TensorName::Value, &self.v)?,
        );
        let view = |name, x| TensorView::contiguous(name, x, ls);
        let (qv, kv, vv) = (view(TensorName::Query, &lq)?, view(TensorName::Key, &lk)?, view(TensorName::Value, &lv)?);
        match op {
            Op::Forward => {
                let mut out = vec![0.0f32; ls.numel()];
                let mut lse = vec![0.0f32; ls.lse_len()];
                let mut ov = TensorViewMut::contiguous(TensorName::Output, &mut out, ls)?;
                ring_forward(comm, pr, [qv, kv, vv], &mut ov, &mut lse)?;
                out.extend_from_slice(&lse);
                Ok(out)
            }
            Op::Backward => {
                let lg = global(TensorName::GradOutput, &self.grad_out)?;
                let gv = view(TensorName::GradOutput, &lg)?;
                let [mut gq, mut gk, mut gv2] = [0; 3].map(|_| vec![0.0f32; ls.numel()]);
                let mut dq = TensorViewMut::contiguous(TensorName::GradQuery, &mut gq, ls)?;
                let mut dk = TensorViewMut::contiguous(TensorName::GradKey, &mut gk, ls)?;
                let mut dv = TensorViewMut::contiguous(TensorName::GradValue, &mut gv2, ls)?;
                ring_backward(comm, pr, [qv, kv, vv], gv, BackwardOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv })?;
                gq.extend_from_slice(&gk);
                gq.extend_from_slice(&gv2);
                Ok(gq)
            }
        }
    }

    /// Run every rank on its own thread over the given communicators; each rank's result
    /// in rank order (a panicking rank becomes an error naming it).
    pub fn run_on<C: Communicator + Send>(&self, comms: Vec<C>, op: Op) -> Vec<Result<Vec<f32>>> {
        std::thread::scope(|scope| {
            let handles: Vec<_> =
                comms.into_iter().map(|mut c| scope.spawn(move || self.run_rank(&mut c, op))).collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| {
                    h.join().unwrap_or_else(|_| Err(AttnError::Comm { rank, message: "rank thread panicked".into() }))
                })
                .collect()
        })
    }

    /// Run with `faults` injected into the frames rank `faulty` sends (other ranks are
    /// wrapped with no faults), every receive limited to `timeout`.
    pub fn run_faulty(&self, op: Op, faulty: usize, faults: Vec<Fault>, timeout: Duration) -> Vec<Result<Vec<f32>>> {
        let comms = match ThreadComm::world_with_timeout(self.problem.world, timeout) {
            Ok(c) => c,
            Err(e) => return vec![Err(e)],
        };
        let wrapped = comms
            .into_iter()
            .map(|c| {
                let f = if c.rank() == faulty { faults.clone() } else { Vec::new() };
                FaultyComm::new(c, f)
            })
            .collect();
        self.run_on(wrapped, op)
    }

    /// Run with `faults[rank]` injected into the frames each rank sends (a rank without
    /// an entry gets none), every receive limited to `timeout`.
    pub fn run_with_faults(&self, op: Op, faults: &[Vec<Fault>], timeout: Duration) -> Vec<Result<Vec<f32>>> {
        let comms = match ThreadComm::world_with_timeout(self.problem.world, timeout) {
            Ok(c) => c,
            Err(e) => return vec![Err(e)],
        };
        let wrapped = comms
            .into_iter()
            .map(|c| {
                let f = faults.get(c.rank()).cloned().unwrap_or_default();
                FaultyComm::new(c, f)
            })
            .collect();
        self.run_on(wrapped, op)
    }

    /// Frames each rank sends in a clean run of `op` (what a fault's `nth` ranges over).
    pub fn frames_sent(&self, op: Op, timeout: Duration) -> Result<Vec<u64>> {
        let comms = ThreadComm::world_with_timeout(self.problem.world, timeout)?;
        let counts = std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut c| {
                    scope.spawn(move || -> Result<u64> {
                        self.run_rank(&mut c, op)?;
                        Ok(c.stats().messages_sent)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(AttnError::InvalidArgument("panic".into()))))
                .collect::<Vec<_>>()
        });
        counts.into_iter().collect()
    }
}
