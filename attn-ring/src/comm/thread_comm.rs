//! `ThreadComm`: in-process ranks joined by channels, one per ordered pair.
//!
//! Sends never block (unbounded channels), so matching exchanges cannot deadlock.
//! The frames one exchange sends to one peer travel as one batch, so a receiver
//! that has a frame also holds every frame sent with it (duplicates included).
//! A dropped peer disconnects its channels: the others get `AttnError::Comm` at
//! once; a silent peer gives `AttnError::Timeout` after the timeout.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError, channel};
use std::time::Duration;

use attn_core::{AttnError, Result};

use super::{Communicator, DEFAULT_TIMEOUT, Framing};

/// The frames one exchange sends to one peer, in order.
type Batch = Vec<Vec<u8>>;

/// One in-process rank. Create a whole group with [`ThreadComm::world`].
#[derive(Debug)]
pub struct ThreadComm {
    rank: usize,
    world: usize,
    timeout: Duration,
    /// `to[p]`: channel to rank `p` (`None` for self).
    to: Vec<Option<Sender<Batch>>>,
    /// `from[p]`: channel from rank `p` (`None` for self).
    from: Vec<Option<Receiver<Batch>>>,
    /// `early[p]`: frames from rank `p` already taken off the channel, not yet delivered.
    early: Vec<VecDeque<Vec<u8>>>,
    framing: Framing,
}

impl ThreadComm {
    /// `p` connected communicators (rank `i` at index `i`), to be moved into `p` threads.
    pub fn world(p: usize) -> Result<Vec<ThreadComm>> {
        Self::world_with_timeout(p, DEFAULT_TIMEOUT)
    }

    /// Like [`ThreadComm::world`] with a receive timeout.
    pub fn world_with_timeout(p: usize, timeout: Duration) -> Result<Vec<ThreadComm>> {
        if p == 0 {
            return Err(AttnError::InvalidArgument("world size must be at least 1".into()));
        }
        let mut to: Vec<Vec<Option<Sender<Batch>>>> = (0..p).map(|_| (0..p).map(|_| None).collect()).collect();
        let mut from: Vec<Vec<Option<Receiver<Batch>>>> = (0..p).map(|_| (0..p).map(|_| None).collect()).collect();
        for (src, row) in to.iter_mut().enumerate() {
            for (dst, slot) in row.iter_mut().enumerate() {
                if src != dst {
                    let (tx, rx) = channel();
                    *slot = Some(tx);
                    from[dst][src] = Some(rx);
                }
            }
        }
        Ok(to
            .into_iter()
            .zip(from)
            .enumerate()
            .map(|(rank, (to, from))| {
                let early = (0..p).map(|_| VecDeque::new()).collect();
                ThreadComm { rank, world: p, timeout, to, from, early, framing: Framing::new(rank, p) }
            })
            .collect())
    }

    /// Change the receive timeout.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }
}

impl Communicator for ThreadComm {
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
        let rank = self.rank;
        let mut batches: Vec<(usize, Batch)> = Vec::new();
        for (peer, frame) in sends {
            match batches.iter_mut().find(|(p, _)| *p == peer) {
                Some((_, b)) => b.push(frame),
                None => batches.push((peer, vec![frame])),
            }
        }
        for (peer, batch) in batches {
            let tx = self
                .to
                .get(peer)
                .and_then(Option::as_ref)
                .ok_or_else(|| AttnError::Comm { rank, message: format!("no channel to rank {peer}") })?;
            tx.send(batch).map_err(|_| AttnError::Comm { rank, message: format!("rank {peer} has gone away") })?;
        }
        let mut out = Vec::with_capacity(recv_from.len());
        for &peer in recv_from {
            if let Some(f) = self.early.get_mut(peer).and_then(VecDeque::pop_front) {
                out.push(f);
                continue;
            }
            let rx = self
                .from
                .get(peer)
                .and_then(Option::as_ref)
                .ok_or_else(|| AttnError::Comm { rank, message: format!("no channel from rank {peer}") })?;
            match rx.recv_timeout(self.timeout) {
                Ok(batch) => {
                    let mut batch = batch.into_iter();
                    let first = batch.next().ok_or_else(|| AttnError::Comm { rank, message: "empty batch".into() })?;
                    out.push(first);
                    self.early[peer].extend(batch);
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(AttnError::Timeout { rank, peer, timeout_ms: self.timeout.as_millis() as u64 });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(AttnError::Comm { rank, message: format!("rank {peer} has gone away") });
                }
            }
        }
        Ok(out)
    }

    fn peek_frame(&mut self, peer: usize) -> Result<Option<&[u8]>> {
        let rank = self.rank;
        let rx = self
            .from
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| AttnError::Comm { rank, message: format!("no channel from rank {peer}") })?;
        let early = &mut self.early[peer];
        while early.is_empty() {
            match rx.try_recv() {
                Ok(batch) => early.extend(batch),
                // A peer that has finished and gone away has nothing more to send.
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        Ok(early.front().map(Vec::as_slice))
    }

    fn framing_mut(&mut self) -> &mut Framing {
        &mut self.framing
    }
    fn framing(&self) -> &Framing {
        &self.framing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_all_gather_and_dropped_peer() {
        let comms = ThreadComm::world_with_timeout(3, Duration::from_secs(5)).unwrap();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || {
                    let r = c.rank() as u8;
                    let got = c.ring_sendrecv(vec![r; 3]).unwrap();
                    assert_eq!(got, vec![c.prev() as u8; 3]);
                    let all = c.all_gather(vec![r]).unwrap();
                    assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
                    c.barrier().unwrap();
                    c
                })
            })
            .collect();
        let mut comms: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        drop(comms.pop());
        let mut c0 = comms.remove(0);
        assert!(matches!(c0.sendrecv(1, vec![], 2), Err(AttnError::Comm { rank: 0, .. })));
        let mut c1 = comms.remove(0);
        c1.set_timeout(Duration::from_millis(20));
        assert!(c1.sendrecv(0, vec![], 0).is_ok());
        assert!(matches!(c1.sendrecv(0, vec![], 0), Err(AttnError::Timeout { rank: 1, peer: 0, .. })));
    }
}
