//! [`InProcessTransport`]: ranks as threads of one process handing a step's buffers
//! themselves to their receiver by channel (no copy; device buffers stay where they are,
//! k/v shared while the sender still computes with them), so ranks sharing one GPU never
//! stage rows through the host. The head strategies' all-to-all hands each member its
//! parcel the same way. Every hand-over is counted as the host-staged message it replaces
//! (header, rows in `T`, accumulators in f32; [`ChunkTransport::moved`]), so a call's
//! statistics are the same over either transport.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};

use attn_core::{AttnError, Element, Result};

use super::transport::{Awaited, check_members, check_travel, out_of_order, payload_bytes};
use super::{Arrived, ChunkCompute, ChunkTransport, Exchange, Parcel, ParcelShapes, Travel};
use crate::comm::{CommStats, Communicator};
use crate::plan::{MSG_HEADER_BYTES, RingProblem};
use crate::protocol::wire::MsgKind;

/// One step's buffers with what they are: (kind, owner, step).
type Msg<R, A> = ((MsgKind, usize, usize), Arrived<R, A>);

/// One rank's end of an in-process ring: its control communicator, a channel to every
/// rank and one from every rank (indexed by that rank).
#[derive(Debug)]
pub struct InProcessTransport<C, R, A> {
    comm: C,
    to: Vec<Sender<Msg<R, A>>>,
    from: Vec<Receiver<Msg<R, A>>>,
    awaited: Option<Awaited>,
    moved: CommStats,
}

impl<C: Communicator, R, A> InProcessTransport<C, R, A> {
    /// Endpoints for the ranks of `comms` (rank `i` at index `i`).
    pub fn world(comms: Vec<C>) -> Result<Vec<Self>> {
        let p = comms.len();
        if let Some((i, c)) = comms.iter().enumerate().find(|(i, c)| c.rank() != *i || c.world_size() != p) {
            return Err(AttnError::InvalidArgument(format!(
                "communicator {i} is rank {} of {} in a list of {p}",
                c.rank(),
                c.world_size()
            )));
        }
        // Channel (i, j) carries rank i's travels to rank j.
        let mut to: Vec<Vec<Sender<Msg<R, A>>>> = (0..p).map(|_| Vec::with_capacity(p)).collect();
        let mut from: Vec<Vec<Receiver<Msg<R, A>>>> = (0..p).map(|_| Vec::with_capacity(p)).collect();
        for senders in to.iter_mut() {
            for receivers in from.iter_mut() {
                let (tx, rx) = channel();
                senders.push(tx);
                receivers.push(rx);
            }
        }
        Ok(comms
            .into_iter()
            .zip(to.into_iter().zip(from))
            .map(|(comm, (to, from))| InProcessTransport { comm, to, from, awaited: None, moved: CommStats::default() })
            .collect())
    }
}

impl<C: Communicator, R, A> InProcessTransport<C, R, A> {
    /// The next buffers from rank `peer`, within the control communicator's timeout.
    fn receive(&self, peer: usize) -> Result<Msg<R, A>> {
        let rank = self.comm.rank();
        let timeout = self.comm.timeout();
        self.from[peer].recv_timeout(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => {
                AttnError::Timeout { rank, peer, timeout_ms: timeout.as_millis().try_into().unwrap_or(u64::MAX) }
            }
            RecvTimeoutError::Disconnected => {
                AttnError::Comm { rank, message: format!("rank {peer} has left the ring") }
            }
        })
    }

    /// Hand `msg` to rank `peer`, counted as a host-staged message of `payload` bytes after
    /// its header (a hand-over to this rank itself is not a message, as over a communicator).
    fn send(&mut self, peer: usize, msg: Msg<R, A>, payload: usize) -> Result<()> {
        let rank = self.comm.rank();
        self.to[peer]
            .send(msg)
            .map_err(|_| AttnError::Comm { rank, message: format!("rank {peer} has left the ring") })?;
        if peer != rank {
            let bytes = MSG_HEADER_BYTES + payload as u64;
            self.moved.payload_bytes_sent += bytes;
            self.moved.frame_bytes_sent += bytes;
            self.moved.messages_sent += 1;
        }
        Ok(())
    }
}

impl<T, X, C> ChunkTransport<T, X> for InProcessTransport<C, X::Rows, X::Acc>
where
    T: Element,
    X: ChunkCompute<T>,
    C: Communicator,
{
    type Control = C;

    fn control(&mut self) -> &mut C {
        &mut self.comm
    }

    fn start(&mut self, compute: &X, _problem: &RingProblem, travel: Travel<X::Rows, X::Acc>) -> Result<()> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        check_travel(&travel, rank)?;
        if self.awaited.is_some() {
            return Err(out_of_order(rank, "a shift started while another is in flight"));
        }
        let awaited = Awaited::of(&travel, rank, world)?;
        let Travel { kind, owner, step, k, v, dk, dv, .. } = travel;
        // The receiver reads the buffers on its own stream: what was queued on them here
        // (the copy that made them, the blocks that wrote dk/dv) finishes first.
        compute.sync()?;
        let bytes = payload_bytes::<T, X>(compute, k.iter().chain(&v).map(|r| &**r), dk.iter().chain(&dv));
        self.send(awaited.to, ((kind.msg_kind(), owner, step), Arrived { k, v, dk, dv }), bytes)?;
        self.awaited = Some(awaited);
        Ok(())
    }

    fn finish(&mut self, compute: &X, _problem: &RingProblem) -> Result<Arrived<X::Rows, X::Acc>> {
        let rank = self.comm.rank();
        let want = self.awaited.take().ok_or_else(|| out_of_order(rank, "a finish with no shift started"))?;
        let prev = want.from;
        let (got, arrived) = self.receive(prev)?;
        let expected = (want.kind.msg_kind(), want.owner, want.step);
        if got != expected {
            return Err(AttnError::Comm {
                rank,
                message: format!(
                    "unexpected buffers from rank {prev}: {got:?} (kind, owner, step), wanted {expected:?}"
                ),
            });
        }
        let shapes: Vec<_> = arrived.k.iter().map(|x| compute.shape_of(x)).collect();
        let rows_ok = !want.kind.has_rows() || shapes == want.arriving;
        let grads_ok = !want.kind.has_grads() || arrived.dk.len() == want.arriving.len();
        if !(rows_ok && grads_ok) {
            return Err(AttnError::Comm {
                rank,
                message: format!(
                    "rank {prev} sent k/v slices {shapes:?} and {} dk slices, wanted {:?}",
                    arrived.dk.len(),
                    want.arriving
                ),
            });
        }
        Ok(arrived)
    }

    fn moved(&self) -> CommStats {
        self.moved
    }

    fn all_to_all(
        &mut self,
        compute: &X,
        kind: Exchange,
        members: &[usize],
        parcels: Vec<Parcel<X::Rows, X::Acc>>,
        expect: &[ParcelShapes],
    ) -> Result<Vec<Parcel<X::Rows, X::Acc>>> {
        let rank = self.comm.rank();
        let me = check_members(rank, members, parcels.len(), expect.len())?;
        if self.awaited.is_some() {
            return Err(out_of_order(rank, "an all-to-all while a shift is in flight"));
        }
        // The receivers read the buffers on their own streams: what made them finishes first.
        compute.sync()?;
        let header = (kind.msg_kind(), rank, 0);
        let mut own = None;
        for (i, (p, &m)) in parcels.into_iter().zip(members).enumerate() {
            match i == me {
                true => own = Some(p),
                false => {
                    let bytes = payload_bytes::<T, X>(compute, p.rows.iter().map(|r| &**r), &p.accs);
                    let msg = Arrived { k: p.rows, v: Vec::new(), dk: p.accs, dv: Vec::new() };
                    self.send(m, (header, msg), bytes)?
                }
            }
        }
        let mut got = Vec::with_capacity(members.len());
        for (i, (&m, want)) in members.iter().zip(expect).enumerate() {
            if i == me {
                got.push(own.take().ok_or_else(|| out_of_order(rank, "an all-to-all without its own parcel"))?);
                continue;
            }
            let (head, a) = self.receive(m)?;
            let shapes: Vec<_> = a.k.iter().map(|x| compute.shape_of(x)).collect();
            let expected = (kind.msg_kind(), m, 0);
            if head != expected || shapes != want.rows || a.dk.len() != want.accs.len() || !a.v.is_empty() {
                return Err(AttnError::Comm {
                    rank,
                    message: format!(
                        "unexpected parcel from rank {m}: {head:?} (kind, owner, step) with rows {shapes:?} and {} \
                         accumulators, wanted {expected:?} with rows {:?} and {}",
                        a.dk.len(),
                        want.rows,
                        want.accs.len()
                    ),
                });
            }
            got.push(Parcel { rows: a.k, accs: a.dk });
        }
        Ok(got)
    }
}
