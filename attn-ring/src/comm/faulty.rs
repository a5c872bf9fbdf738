//! `FaultyComm`: wraps a communicator and injects faults into the frames this
//! rank sends (drop, delay, duplicate, reorder, truncate, corrupt) or kills the
//! rank. Used to prove that every fault ends in a typed error, never a wrong
//! answer or a hang.

use std::time::Duration;

use attn_core::{AttnError, Result};

use super::{Communicator, Framing};

/// One injected fault; `nth` counts the frames this rank sends, from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The frame is never sent.
    Drop { nth: u64 },
    /// The frame is sent after sleeping (a stalled peer when longer than the timeout).
    Delay { nth: u64, delay: Duration },
    /// The frame is sent twice.
    Duplicate { nth: u64 },
    /// The frame is held back and sent after the next frame to the same peer.
    Reorder { nth: u64 },
    /// The frame loses its last byte.
    Truncate { nth: u64 },
    /// One payload (or header) bit of the frame flips.
    Corrupt { nth: u64 },
    /// The rank dies instead of sending the frame: its channels close.
    Kill { nth: u64 },
}

impl Fault {
    fn nth(&self) -> u64 {
        match *self {
            Fault::Drop { nth }
            | Fault::Delay { nth, .. }
            | Fault::Duplicate { nth }
            | Fault::Reorder { nth }
            | Fault::Truncate { nth }
            | Fault::Corrupt { nth }
            | Fault::Kill { nth } => nth,
        }
    }
}

/// A communicator whose outgoing frames suffer the listed faults.
#[derive(Debug)]
pub struct FaultyComm<C> {
    inner: Option<C>,
    rank: usize,
    world: usize,
    timeout: Duration,
    faults: Vec<Fault>,
    sent: u64,
    held: Option<(usize, Vec<u8>)>,
    framing: Framing,
}

impl<C: Communicator> FaultyComm<C> {
    /// Wrap `inner`; `faults` apply to this rank's outgoing frames.
    pub fn new(inner: C, faults: Vec<Fault>) -> Self {
        let (rank, world, timeout) = (inner.rank(), inner.world_size(), inner.timeout());
        let framing = inner.framing().clone();
        FaultyComm { inner: Some(inner), rank, world, timeout, faults, sent: 0, held: None, framing }
    }

    /// Whether the rank has been killed.
    pub fn is_dead(&self) -> bool {
        self.inner.is_none()
    }

    fn dead(&self) -> AttnError {
        killed(self.rank)
    }

    /// The wrapped communicator, or the killed-rank error.
    fn live(&mut self) -> Result<&mut C> {
        let (rank, inner) = (self.rank, self.inner.as_mut());
        inner.ok_or_else(|| killed(rank))
    }

    /// The frames that actually go out for `sends` (faults applied, in order).
    fn inject(&mut self, sends: Vec<(usize, Vec<u8>)>) -> Result<Vec<(usize, Vec<u8>)>> {
        if self.inner.is_none() {
            return Err(self.dead());
        }
        let mut out: Vec<(usize, Vec<u8>)> = Vec::new();
        for (peer, mut frame) in sends {
            let n = self.sent;
            self.sent += 1;
            let fault = self.faults.iter().find(|f| f.nth() == n).copied();
            match fault {
                None => out.push((peer, frame)),
                Some(Fault::Drop { .. }) => {}
                Some(Fault::Delay { delay, .. }) => {
                    std::thread::sleep(delay);
                    out.push((peer, frame));
                }
                Some(Fault::Duplicate { .. }) => {
                    out.push((peer, frame.clone()));
                    out.push((peer, frame));
                }
                Some(Fault::Reorder { .. }) => {
                    self.held = Some((peer, frame));
                    continue;
                }
                Some(Fault::Truncate { .. }) => {
                    frame.pop();
                    out.push((peer, frame));
                }
                Some(Fault::Corrupt { .. }) => {
                    let i = frame.len() - 1 - (n as usize % frame.len().max(1));
                    frame[i] ^= 0x10;
                    out.push((peer, frame));
                }
                Some(Fault::Kill { .. }) => {
                    self.inner = None;
                    return Err(self.dead());
                }
            }
            // A held frame goes out right after the next frame to its peer.
            if let Some((hp, _)) = &self.held
                && *hp == peer
                && let Some(h) = self.held.take()
            {
                out.push(h);
            }
        }
        Ok(out)
    }
}

/// The error of a rank that fault injection killed.
fn killed(rank: usize) -> AttnError {
    AttnError::Comm { rank, message: "rank was killed by fault injection".into() }
}

impl<C: Communicator> Communicator for FaultyComm<C> {
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
        let out = self.inject(sends)?;
        let inner = self.live()?;
        inner.exchange_frames(out, recv_from)
    }

    fn post_frames(&mut self, sends: Vec<(usize, Vec<u8>)>) -> Result<()> {
        let out = self.inject(sends)?;
        let inner = self.live()?;
        inner.post_frames(out)
    }

    fn flush(&mut self) -> Result<()> {
        let inner = self.live()?;
        inner.flush()
    }

    fn peek_frame(&mut self, peer: usize) -> Result<Option<&[u8]>> {
        match self.inner.as_mut() {
            Some(inner) => inner.peek_frame(peer),
            None => Err(AttnError::Comm { rank: self.rank, message: "rank was killed by fault injection".into() }),
        }
    }

    fn framing_mut(&mut self) -> &mut Framing {
        &mut self.framing
    }
    fn framing(&self) -> &Framing {
        &self.framing
    }
}
