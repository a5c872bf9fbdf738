//! `GroupedComm`: framed exchanges over a rendezvous transport that only offers
//! blocking *grouped* point-to-point rounds with NCCL's semantics (the real
//! [`NcclComm`](super::NcclComm) and the in-process [`EmulatedNccl`](super::EmulatedNccl)).
//!
//! # Transport model ([`GroupedP2p`])
//! One call of [`GroupedP2p::group`] posts some sends and some receives of known
//! lengths and returns only once every one of them has been matched and completed
//! (or fails with `Timeout`). Sends and receives between an ordered pair of ranks
//! match in issue order, whatever group they are in; a send is not complete until the
//! peer has posted the matching receive, possibly in one of its later groups, and the
//! byte counts of a matched pair must be equal.
//!
//! # Protocol
//! An exchange that receives, or an explicit send-only [`Communicator::exchange_frames`],
//! runs two groups: group 1 sends the 8-byte length of every outgoing frame and
//! receives the length of every incoming one; group 2 sends the frame bytes and
//! receives them into buffers of the now-known lengths. Frames given to
//! [`Communicator::post_frames`] are only queued (in order) and travel first in this
//! rank's next exchange, which is how a ring rank "sends early" without blocking.
//! Frames for this rank itself never touch the transport (a local queue).
//!
//! # Deadlock freedom
//! Number the exchanges of a protocol by *level*, the same sequence on every rank (a
//! rank may skip a level where it neither sends, receives nor holds queued frames). If
//! every frame is received at the level at which it travels (its exchange, or for a
//! posted frame the sender's next exchange), with the same number of frames per ordered
//! pair, no run can deadlock: once every rank is done with the levels before `L`, each
//! group 1 of level `L` only needs peers' groups 1 of level `L`, which are posted, and
//! then the same holds for groups 2. The attn-ring protocols are written that way (see
//! `forward_core`, `backward_core`, `completion`). Two designs that look simpler are not
//! deadlock-free: sending a frame together with its length in group 1 (the length
//! receive has to finish before the frame receive can be posted, so in any ring shift
//! each rank's group 1 waits for its successor's group 2: a cycle), and blocking
//! send-only rounds when the receiver only posts its receive in a later exchange (every
//! ring rank blocks in its send: the bug this module replaces).
//!
//! Queued frames that no later exchange carries are lost when the communicator is
//! dropped: `Drop` does not communicate (a blocking NCCL round there could stall for the
//! whole timeout and could not report an error). Call [`Communicator::flush`] to send them.

use std::collections::VecDeque;
use std::time::Duration;

use attn_core::{AttnError, Result};

use super::{Communicator, Framing};

/// A transport of blocking grouped point-to-point rounds (NCCL semantics, see the module docs).
pub trait GroupedP2p {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// How long one group may wait.
    fn timeout(&self) -> Duration;
    /// Change the timeout.
    fn set_timeout(&mut self, timeout: Duration);
    /// Post every send `(peer, bytes)` and every receive `(peer, length)` as one group and
    /// wait until all of them are complete; returns the received bytes in `recvs` order.
    /// Errors: `Timeout` when some operation is still unmatched after the timeout, `Comm`
    /// on a transport failure. Peers are never this rank.
    fn group(&mut self, sends: &[(usize, &[u8])], recvs: &[(usize, usize)]) -> Result<Vec<Vec<u8>>>;
}

/// A [`Communicator`] over a [`GroupedP2p`] transport (see the module docs for the protocol).
#[derive(Debug)]
pub struct GroupedComm<G> {
    p2p: G,
    framing: Framing,
    /// Frames posted and not yet sent, in order.
    queued: Vec<(usize, Vec<u8>)>,
    /// Frames this rank sent to itself, not yet received.
    to_self: VecDeque<Vec<u8>>,
}

impl<G: GroupedP2p> GroupedComm<G> {
    /// Wrap a transport.
    pub fn with_transport(p2p: G) -> Self {
        let framing = Framing::new(p2p.rank(), p2p.world_size());
        GroupedComm { p2p, framing, queued: Vec::new(), to_self: VecDeque::new() }
    }

    /// Change the timeout of every group.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.p2p.set_timeout(timeout);
    }

    /// Frames posted and not yet sent.
    pub fn queued_frames(&self) -> usize {
        self.queued.len()
    }

    /// The transport.
    pub fn transport(&self) -> &G {
        &self.p2p
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        let world = self.p2p.world_size();
        if peer >= world {
            return Err(AttnError::InvalidArgument(format!("peer {peer} outside a world of {world} ranks")));
        }
        Ok(())
    }
}

impl<G: GroupedP2p> Communicator for GroupedComm<G> {
    fn rank(&self) -> usize {
        self.p2p.rank()
    }
    fn world_size(&self) -> usize {
        self.p2p.world_size()
    }
    fn timeout(&self) -> Duration {
        self.p2p.timeout()
    }

    fn exchange_frames(&mut self, sends: Vec<(usize, Vec<u8>)>, recv_from: &[usize]) -> Result<Vec<Vec<u8>>> {
        let rank = self.p2p.rank();
        for &p in sends.iter().map(|(p, _)| p).chain(recv_from) {
            self.check_peer(p)?;
        }
        let mut out = std::mem::take(&mut self.queued);
        out.extend(sends);
        let (mine, out): (Vec<_>, Vec<_>) = out.into_iter().partition(|(p, _)| *p == rank);
        self.to_self.extend(mine.into_iter().map(|(_, f)| f));
        let remote: Vec<usize> = recv_from.iter().copied().filter(|&p| p != rank).collect();
        let mut got = if out.is_empty() && remote.is_empty() {
            Vec::new()
        } else {
            // Group 1: lengths; group 2: the frames.
            let lens: Vec<[u8; 8]> = out.iter().map(|(_, f)| (f.len() as u64).to_le_bytes()).collect();
            let len_sends: Vec<(usize, &[u8])> = out.iter().zip(&lens).map(|((p, _), l)| (*p, &l[..])).collect();
            let len_recvs: Vec<(usize, usize)> = remote.iter().map(|&p| (p, 8)).collect();
            let got = self.p2p.group(&len_sends, &len_recvs)?;
            let mut frame_recvs = Vec::with_capacity(remote.len());
            for (&p, b) in remote.iter().zip(&got) {
                let n = b.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).ok_or_else(|| {
                    AttnError::Comm { rank, message: format!("length word from rank {p} has {} bytes", b.len()) }
                })?;
                let n = usize::try_from(n)
                    .ok()
                    .filter(|&n| n <= isize::MAX as usize)
                    .ok_or_else(|| AttnError::Comm { rank, message: format!("rank {p} announced {n} bytes") })?;
                frame_recvs.push((p, n));
            }
            let frame_sends: Vec<(usize, &[u8])> = out.iter().map(|(p, f)| (*p, &f[..])).collect();
            self.p2p.group(&frame_sends, &frame_recvs)?
        }
        .into_iter();
        let mut frames = Vec::with_capacity(recv_from.len());
        for &p in recv_from {
            let f = if p == rank { self.to_self.pop_front() } else { got.next() };
            frames.push(f.ok_or_else(|| AttnError::Comm { rank, message: format!("no frame from rank {p}") })?);
        }
        Ok(frames)
    }

    fn post_frames(&mut self, sends: Vec<(usize, Vec<u8>)>) -> Result<()> {
        for (p, _) in &sends {
            self.check_peer(*p)?;
        }
        self.queued.extend(sends);
        Ok(())
    }

    fn framing_mut(&mut self) -> &mut Framing {
        &mut self.framing
    }
    fn framing(&self) -> &Framing {
        &self.framing
    }
}
