//! The `Communicator` trait: rank, world size, framed paired exchanges with
//! timeouts, ring neighbours, all-gather and barrier; and its backends.
//!
//! Backends implement one primitive, [`Communicator::exchange_frames`] (send some
//! raw frames, receive one raw frame from each listed peer, within the timeout,
//! without deadlocking when peers post matching exchanges). Framing, sequence
//! checks, byte accounting and the collectives are provided on top of it.
//!
//! [`Communicator::post`] sends without receiving: buffered transports (threads,
//! MPI) send at once, a rendezvous transport (NCCL, see [`grouped`]) queues the
//! frames until this rank's next exchange. Protocols therefore post a frame only
//! where the receiver receives it at the sender's next exchange (or
//! [`Communicator::flush`]).

pub mod all_to_all;
pub mod faulty;
pub mod frame;
pub mod grouped;
#[cfg(feature = "mpi")]
pub mod mpi_comm;
pub mod nccl_comm;
pub mod nccl_emu;
#[cfg(feature = "nccl")]
pub(crate) mod nccl_handle;
#[cfg(feature = "nccl")]
pub mod nccl_library;
mod nccl_progress;
pub mod thread_comm;

use std::time::Duration;

use attn_core::{AttnError, Result};

pub use faulty::{Fault, FaultyComm};
pub use frame::{CommStats, Framing, HEADER_BYTES};
pub use grouped::{GroupedComm, GroupedP2p};
#[cfg(feature = "mpi")]
pub use mpi_comm::MpiComm;
#[cfg(feature = "nccl")]
pub use nccl_comm::NcclP2p;
pub use nccl_comm::{NCCL_ID_BYTES, NcclComm, nccl_available};
pub use nccl_emu::{EmulatedNccl, EmulatedNcclComm};
pub use thread_comm::ThreadComm;

/// Default time a rank waits for one message before giving up.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// A rank's view of the group it computes with.
pub trait Communicator {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// How long one receive may wait.
    fn timeout(&self) -> Duration;
    /// Send each `(peer, frame)` and receive one frame from each peer of `recv_from`
    /// (in that order). Peers are never this rank. Errors are `Comm` or `Timeout`.
    fn exchange_frames(&mut self, sends: Vec<(usize, Vec<u8>)>, recv_from: &[usize]) -> Result<Vec<Vec<u8>>>;
    /// Send raw frames without receiving. Buffered transports send at once (the
    /// default); a rendezvous transport may queue them until this rank's next
    /// `exchange_frames` (or `flush`), which then sends them first, in order.
    fn post_frames(&mut self, sends: Vec<(usize, Vec<u8>)>) -> Result<()> {
        self.exchange_frames(sends, &[]).map(|_| ())
    }
    /// Send every frame still queued by `post_frames` (a no-op on buffered transports).
    fn flush(&mut self) -> Result<()> {
        self.exchange_frames(Vec::new(), &[]).map(|_| ())
    }
    /// The framing state (sequence numbers, byte counters).
    fn framing_mut(&mut self) -> &mut Framing;
    /// Read-only framing state.
    fn framing(&self) -> &Framing;
    /// Non-blocking look at the next raw frame already waiting from `peer`; the frame
    /// stays queued for the next receive. Transports that cannot look ahead return
    /// `None` (the default), which only weakens duplicate detection at completion.
    fn peek_frame(&mut self, _peer: usize) -> Result<Option<&[u8]>> {
        Ok(None)
    }

    /// Bytes and messages this rank has sent so far.
    fn stats(&self) -> CommStats {
        self.framing().stats()
    }

    /// Rank that follows this one on the ring.
    fn next(&self) -> usize {
        (self.rank() + 1) % self.world_size()
    }
    /// Rank that precedes this one on the ring.
    fn prev(&self) -> usize {
        (self.rank() + self.world_size() - 1) % self.world_size()
    }

    /// Send payloads to peers and receive one payload from each of `recv_from`,
    /// framed and checked. A peer equal to this rank is served locally.
    fn exchange(&mut self, sends: Vec<(usize, Vec<u8>)>, recv_from: &[usize]) -> Result<Vec<Vec<u8>>> {
        let (rank, world) = (self.rank(), self.world_size());
        let bad = |p: usize| AttnError::InvalidArgument(format!("peer {p} outside a world of {world} ranks"));
        let mut local = std::collections::VecDeque::new();
        let mut frames = Vec::with_capacity(sends.len());
        for (peer, payload) in sends {
            if peer >= world {
                return Err(bad(peer));
            }
            if peer == rank {
                local.push_back(payload);
            } else {
                frames.push((peer, self.framing_mut().seal(peer, payload)));
            }
        }
        if let Some(&p) = recv_from.iter().find(|&&p| p >= world) {
            return Err(bad(p));
        }
        let remote: Vec<usize> = recv_from.iter().copied().filter(|&p| p != rank).collect();
        let mut got = self.exchange_frames(frames, &remote)?.into_iter();
        let mut out = Vec::with_capacity(recv_from.len());
        for &p in recv_from {
            if p == rank {
                let payload = local.pop_front().ok_or_else(|| AttnError::Comm {
                    rank,
                    message: "receive from self without a matching send".into(),
                })?;
                out.push(payload);
            } else {
                let frame = got.next().ok_or_else(|| AttnError::Comm { rank, message: "missing frame".into() })?;
                out.push(self.framing_mut().open(p, frame)?);
            }
        }
        Ok(out)
    }

    /// Send payloads without receiving, framed; see [`Communicator::post_frames`] for
    /// when they travel. Peers must not be this rank.
    fn post(&mut self, sends: Vec<(usize, Vec<u8>)>) -> Result<()> {
        let (rank, world) = (self.rank(), self.world_size());
        let mut frames = Vec::with_capacity(sends.len());
        for (peer, payload) in sends {
            if peer >= world || peer == rank {
                return Err(AttnError::InvalidArgument(format!("rank {rank} cannot post to rank {peer} of {world}")));
            }
            frames.push((peer, self.framing_mut().seal(peer, payload)));
        }
        self.post_frames(frames)
    }

    /// Paired send/receive: send `payload` to `dest`, receive from `src`.
    fn sendrecv(&mut self, dest: usize, payload: Vec<u8>, src: usize) -> Result<Vec<u8>> {
        let mut v = self.exchange(vec![(dest, payload)], &[src])?;
        v.pop().ok_or_else(|| AttnError::Comm { rank: self.rank(), message: "sendrecv got nothing".into() })
    }

    /// Send to the next ring neighbour and receive from the previous one.
    fn ring_sendrecv(&mut self, payload: Vec<u8>) -> Result<Vec<u8>> {
        let (next, prev) = (self.next(), self.prev());
        self.sendrecv(next, payload, prev)
    }

    /// Every rank's payload, indexed by rank.
    fn all_gather(&mut self, payload: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let (rank, world) = (self.rank(), self.world_size());
        let peers: Vec<usize> = (0..world).filter(|&p| p != rank).collect();
        let sends = peers.iter().map(|&p| (p, payload.clone())).collect();
        let mut got = self.exchange(sends, &peers)?.into_iter();
        let mut out = Vec::with_capacity(world);
        for p in 0..world {
            if p == rank {
                out.push(payload.clone());
            } else {
                out.push(got.next().unwrap_or_default());
            }
        }
        Ok(out)
    }

    /// Returns once every rank has called it (or errors within the timeout).
    fn barrier(&mut self) -> Result<()> {
        self.all_gather(Vec::new()).map(|_| ())
    }
}

impl<C: Communicator + ?Sized> Communicator for Box<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn timeout(&self) -> Duration {
        (**self).timeout()
    }
    fn exchange_frames(&mut self, sends: Vec<(usize, Vec<u8>)>, recv_from: &[usize]) -> Result<Vec<Vec<u8>>> {
        (**self).exchange_frames(sends, recv_from)
    }
    fn post_frames(&mut self, sends: Vec<(usize, Vec<u8>)>) -> Result<()> {
        (**self).post_frames(sends)
    }
    fn flush(&mut self) -> Result<()> {
        (**self).flush()
    }
    fn framing_mut(&mut self) -> &mut Framing {
        (**self).framing_mut()
    }
    fn framing(&self) -> &Framing {
        (**self).framing()
    }
    fn peek_frame(&mut self, peer: usize) -> Result<Option<&[u8]>> {
        (**self).peek_frame(peer)
    }
}
