//! `MpiComm`: ranks are MPI processes (rsmpi, feature `mpi`). Sends are
//! non-blocking and stay pending until MPI completes them; receives poll with
//! `MPI_Improbe` until the timeout, so a silent peer is a `Timeout`, not a hang.
//!
//! This module holds the crate's only `unsafe` for MPI: returning a send buffer
//! to the allocator once MPI has completed the send.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use attn_core::{AttnError, Result};
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator as _, SimpleCommunicator};

use super::{Communicator, DEFAULT_TIMEOUT, Framing};

type Pending = (usize, &'static [u8], Request<'static, [u8], StaticScope>);

/// One MPI process of a communicator (usually `universe.world()`).
pub struct MpiComm {
    comm: SimpleCommunicator,
    rank: usize,
    world: usize,
    timeout: Duration,
    framing: Framing,
    pending: Vec<Pending>,
    /// `early[p]`: frames from rank `p` already received by [`Communicator::peek_frame`].
    early: Vec<VecDeque<Vec<u8>>>,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm").field("rank", &self.rank).field("world", &self.world).finish_non_exhaustive()
    }
}

/// Give a completed send's buffer back to the allocator.
fn release(buf: &'static [u8]) {
    // SAFETY: `buf` was produced by `Box::leak` in `exchange_frames` and was only
    // shared with MPI through a request that has now completed, so nothing else
    // refers to it; rebuilding the box frees it exactly once.
    unsafe { drop(Box::from_raw(buf as *const [u8] as *mut [u8])) }
}

impl MpiComm {
    /// Wrap an MPI communicator with the default timeout.
    pub fn new(comm: SimpleCommunicator) -> Self {
        Self::with_timeout(comm, DEFAULT_TIMEOUT)
    }

    /// Wrap an MPI communicator with a receive timeout.
    pub fn with_timeout(comm: SimpleCommunicator, timeout: Duration) -> Self {
        let (rank, world) = (comm.rank() as usize, comm.size() as usize);
        let early = (0..world).map(|_| VecDeque::new()).collect();
        MpiComm { comm, rank, world, timeout, framing: Framing::new(rank, world), pending: Vec::new(), early }
    }

    /// Complete whatever sends MPI has finished.
    fn progress(&mut self) {
        let mut still = Vec::with_capacity(self.pending.len());
        for (peer, buf, req) in self.pending.drain(..) {
            match req.test() {
                Ok(_) => release(buf),
                Err(req) => still.push((peer, buf, req)),
            }
        }
        self.pending = still;
    }

    /// Wait (up to the timeout) until every pending send has completed.
    pub fn flush(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        loop {
            self.progress();
            match self.pending.first() {
                None => return Ok(()),
                Some((peer, _, _)) if Instant::now() > deadline => {
                    let timeout_ms = self.timeout.as_millis() as u64;
                    return Err(AttnError::Timeout { rank: self.rank, peer: *peer, timeout_ms });
                }
                Some(_) => std::thread::sleep(Duration::from_micros(20)),
            }
        }
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if self.flush().is_err() {
            // MPI still owns these buffers: cancel, and leak them rather than free memory MPI may read.
            for (_, _, req) in self.pending.drain(..) {
                req.cancel();
                std::mem::forget(req);
            }
        }
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn exchange_frames(&mut self, sends: Vec<(usize, Vec<u8>)>, recv_from: &[usize]) -> Result<Vec<Vec<u8>>> {
        for (peer, frame) in sends {
            let buf: &'static [u8] = Box::leak(frame.into_boxed_slice());
            let req = self.comm.process_at_rank(peer as i32).immediate_send(StaticScope, buf);
            self.pending.push((peer, buf, req));
        }
        let mut out = Vec::with_capacity(recv_from.len());
        for &peer in recv_from {
            if let Some(f) = self.early.get_mut(peer).and_then(VecDeque::pop_front) {
                out.push(f);
                continue;
            }
            let deadline = Instant::now() + self.timeout;
            let mut spins = 0u32;
            loop {
                if let Some(m) = self.comm.process_at_rank(peer as i32).immediate_matched_probe() {
                    out.push(m.matched_receive_vec::<u8>().0);
                    break;
                }
                self.progress();
                if Instant::now() > deadline {
                    let timeout_ms = self.timeout.as_millis() as u64;
                    return Err(AttnError::Timeout { rank: self.rank, peer, timeout_ms });
                }
                spins += 1;
                if spins > 64 {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
        }
        self.progress();
        Ok(out)
    }

    fn peek_frame(&mut self, peer: usize) -> Result<Option<&[u8]>> {
        if peer >= self.world || peer == self.rank {
            return Err(AttnError::Comm { rank: self.rank, message: format!("no channel from rank {peer}") });
        }
        if self.early[peer].is_empty()
            && let Some(m) = self.comm.process_at_rank(peer as i32).immediate_matched_probe()
        {
            self.early[peer].push_back(m.matched_receive_vec::<u8>().0);
        }
        Ok(self.early[peer].front().map(Vec::as_slice))
    }

    fn framing_mut(&mut self) -> &mut Framing {
        &mut self.framing
    }
    fn framing(&self) -> &Framing {
        &self.framing
    }
}
