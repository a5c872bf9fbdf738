//! `EmulatedNccl`: an in-process model of NCCL point-to-point semantics, so the
//! [`GroupedComm`] protocol that [`NcclComm`](super::NcclComm) runs can be tested
//! (ring forward, backward, faults) on machines without a GPU.
//!
//! What it models, faithfully to `ncclGroupStart; ncclSend/ncclRecv...; ncclGroupEnd`
//! followed by a host wait on the stream: a group posts all its operations at once and
//! returns only when every one of them has been matched and completed; a send is *not*
//! complete until the peer has posted the matching receive (no eager buffering); sends
//! and receives of an ordered pair of ranks match in issue order across groups; a
//! matched pair with different byte counts is an error (undefined behaviour in NCCL).
//! A group still incomplete at the timeout is `AttnError::Timeout`; like a real NCCL
//! communicator after a hang, the rank's unmatched operations stay posted.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use attn_core::{AttnError, Result};

use super::DEFAULT_TIMEOUT;
use super::grouped::{GroupedComm, GroupedP2p};

/// A rank of the emulated NCCL world, as a framed [`Communicator`](super::Communicator).
pub type EmulatedNcclComm = GroupedComm<EmulatedNccl>;

/// Posted operations of the whole world.
#[derive(Debug, Default)]
struct State {
    /// Unmatched sends per ordered pair `src * world + dst`: (operation id, bytes).
    sends: Vec<VecDeque<(u64, Vec<u8>)>>,
    /// Unmatched receives per ordered pair `src * world + dst`: (operation id, length).
    recvs: Vec<VecDeque<(u64, usize)>>,
    /// Completed operations: the received bytes (empty for a send), or why it failed.
    done: HashMap<u64, std::result::Result<Vec<u8>, String>>,
    next_id: u64,
    /// Groups completed so far, per rank.
    groups: Vec<u64>,
}

impl State {
    /// Match the heads of one ordered pair's queues, in issue order.
    fn match_pair(&mut self, pair: usize) {
        while !self.sends[pair].is_empty() && !self.recvs[pair].is_empty() {
            let (Some((sid, bytes)), Some((rid, len))) = (self.sends[pair].pop_front(), self.recvs[pair].pop_front())
            else {
                return;
            };
            if bytes.len() == len {
                self.done.insert(sid, Ok(Vec::new()));
                self.done.insert(rid, Ok(bytes));
            } else {
                let why = format!("send of {} bytes matched a receive of {len} bytes", bytes.len());
                self.done.insert(sid, Err(why.clone()));
                self.done.insert(rid, Err(why));
            }
        }
    }
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

/// One rank's grouped point-to-point transport in an emulated NCCL world.
#[derive(Debug)]
pub struct EmulatedNccl {
    rank: usize,
    world: usize,
    timeout: Duration,
    shared: Arc<Shared>,
}

impl EmulatedNccl {
    /// `p` connected transports (rank `i` at index `i`).
    pub fn transports(p: usize, timeout: Duration) -> Result<Vec<EmulatedNccl>> {
        if p == 0 {
            return Err(AttnError::InvalidArgument("world size must be at least 1".into()));
        }
        let state = State {
            sends: (0..p * p).map(|_| VecDeque::new()).collect(),
            recvs: (0..p * p).map(|_| VecDeque::new()).collect(),
            groups: vec![0; p],
            ..State::default()
        };
        let shared = Arc::new(Shared { state: Mutex::new(state), changed: Condvar::new() });
        Ok((0..p).map(|rank| EmulatedNccl { rank, world: p, timeout, shared: shared.clone() }).collect())
    }

    /// `p` connected framed communicators with the default timeout.
    pub fn world(p: usize) -> Result<Vec<EmulatedNcclComm>> {
        Self::world_with_timeout(p, DEFAULT_TIMEOUT)
    }

    /// `p` connected framed communicators.
    pub fn world_with_timeout(p: usize, timeout: Duration) -> Result<Vec<EmulatedNcclComm>> {
        Ok(Self::transports(p, timeout)?.into_iter().map(GroupedComm::with_transport).collect())
    }

    /// Groups this rank has completed.
    pub fn groups_completed(&self) -> u64 {
        self.lock().map(|s| s.groups[self.rank]).unwrap_or(0)
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.shared.state.lock().map_err(|_| AttnError::Comm { rank: self.rank, message: "emulator poisoned".into() })
    }
}

impl GroupedP2p for EmulatedNccl {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn group(&mut self, sends: &[(usize, &[u8])], recvs: &[(usize, usize)]) -> Result<Vec<Vec<u8>>> {
        let (rank, world) = (self.rank, self.world);
        if let Some(p) = sends.iter().map(|s| s.0).chain(recvs.iter().map(|r| r.0)).find(|&p| p >= world) {
            return Err(AttnError::InvalidArgument(format!("peer {p} outside a world of {world} ranks")));
        }
        let deadline = Instant::now() + self.timeout;
        let mut st = self.lock()?;
        // ncclGroupEnd: every operation of the group is posted at once.
        let mut ids = Vec::with_capacity(sends.len() + recvs.len());
        for &(peer, bytes) in sends {
            let id = st.next_id;
            st.next_id += 1;
            st.sends[rank * world + peer].push_back((id, bytes.to_vec()));
            ids.push((id, peer));
        }
        for &(peer, len) in recvs {
            let id = st.next_id;
            st.next_id += 1;
            st.recvs[peer * world + rank].push_back((id, len));
            ids.push((id, peer));
        }
        for &(peer, _) in sends {
            st.match_pair(rank * world + peer);
        }
        for &(peer, _) in recvs {
            st.match_pair(peer * world + rank);
        }
        self.shared.changed.notify_all();
        // The host waits for the stream: every operation matched and complete.
        while let Some(&(_, peer)) = ids.iter().find(|(id, _)| !st.done.contains_key(id)) {
            let now = Instant::now();
            if now >= deadline {
                return Err(AttnError::Timeout { rank, peer, timeout_ms: self.timeout.as_millis() as u64 });
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, deadline - now)
                .map_err(|_| AttnError::Comm { rank, message: "emulator poisoned".into() })?
                .0;
        }
        st.groups[rank] += 1;
        let mut out = Vec::with_capacity(recvs.len());
        for (i, (id, peer)) in ids.into_iter().enumerate() {
            match st.done.remove(&id) {
                Some(Ok(bytes)) if i >= sends.len() => out.push(bytes),
                Some(Ok(_)) => {}
                Some(Err(why)) => {
                    return Err(AttnError::Comm { rank, message: format!("NCCL p2p with {peer}: {why}") });
                }
                None => return Err(AttnError::Comm { rank, message: "operation vanished".into() }),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Communicator;

    const SHORT: Duration = Duration::from_millis(300);

    /// Run `f` on every item, one thread each.
    fn on_ranks<X: Send, T: Send>(items: Vec<X>, f: impl Fn(X) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let f = &f;
            let hs: Vec<_> = items.into_iter().map(|x| s.spawn(move || f(x))).collect();
            hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    /// The replaced protocol: a length round then a frame round, each with sends,
    /// run by every call including send-only ones.
    fn old_exchange(t: &mut EmulatedNccl, sends: &[(usize, Vec<u8>)], from: &[usize]) -> Result<Vec<Vec<u8>>> {
        let lens: Vec<[u8; 8]> = sends.iter().map(|(_, f)| (f.len() as u64).to_le_bytes()).collect();
        let out: Vec<(usize, &[u8])> = sends.iter().zip(&lens).map(|((p, _), l)| (*p, &l[..])).collect();
        let got = t.group(&out, &from.iter().map(|&p| (p, 8)).collect::<Vec<_>>())?;
        let sizes: Vec<(usize, usize)> =
            from.iter().zip(&got).map(|(&p, b)| (p, u64::from_le_bytes(b[..8].try_into().unwrap()) as usize)).collect();
        let out: Vec<(usize, &[u8])> = sends.iter().map(|(p, f)| (*p, &f[..])).collect();
        t.group(&out, &sizes)
    }

    /// A frame sent together with its length in group 1, frames received in group 2.
    fn send_with_length(t: &mut EmulatedNccl, sends: &[(usize, Vec<u8>)], from: &[usize]) -> Result<Vec<Vec<u8>>> {
        let lens: Vec<[u8; 8]> = sends.iter().map(|(_, f)| (f.len() as u64).to_le_bytes()).collect();
        let mut out: Vec<(usize, &[u8])> = Vec::new();
        for ((p, f), l) in sends.iter().zip(&lens) {
            out.push((*p, &l[..]));
            out.push((*p, &f[..]));
        }
        let got = t.group(&out, &from.iter().map(|&p| (p, 8)).collect::<Vec<_>>())?;
        let sizes: Vec<(usize, usize)> =
            from.iter().zip(&got).map(|(&p, b)| (p, u64::from_le_bytes(b[..8].try_into().unwrap()) as usize)).collect();
        t.group(&[], &sizes)
    }

    #[test]
    fn old_protocol_times_out_on_the_ring_pattern() {
        // Every rank: send-only to next, then receive-only from prev (forward_core's ring).
        let res = on_ranks(EmulatedNccl::transports(3, SHORT).unwrap(), |mut t| {
            let (r, next, prev) = (t.rank(), (t.rank() + 1) % 3, (t.rank() + 2) % 3);
            old_exchange(&mut t, &[(next, vec![r as u8; 40])], &[])?;
            old_exchange(&mut t, &[], &[prev])
        });
        for (r, x) in res.iter().enumerate() {
            assert!(matches!(x, Err(AttnError::Timeout { rank, .. }) if *rank == r), "rank {r}: {x:?}");
        }
    }

    #[test]
    fn frame_beside_its_length_times_out_on_all_gather() {
        let res = on_ranks(EmulatedNccl::transports(2, SHORT).unwrap(), |mut t| {
            let peer = 1 - t.rank();
            send_with_length(&mut t, &[(peer, vec![7; 33])], &[peer])
        });
        assert!(res.iter().all(|x| matches!(x, Err(AttnError::Timeout { .. }))), "{res:?}");
    }

    #[test]
    fn new_protocol_runs_the_ring_pattern_and_collectives() {
        let res = on_ranks(EmulatedNccl::world_with_timeout(4, Duration::from_secs(10)).unwrap(), |mut c| {
            let (r, next, prev) = (c.rank(), c.next(), c.prev());
            // Ring: post early, receive later (two laps, so posted frames pile up once).
            c.post(vec![(next, vec![r as u8; 3 + r])])?;
            assert_eq!(c.transport().groups_completed(), 0, "a post does not communicate");
            let a = c.exchange(Vec::new(), &[prev])?.remove(0);
            c.post(vec![(next, a.clone())])?;
            let b = c.exchange(Vec::new(), &[prev])?.remove(0);
            // An asymmetric send-only exchange (rank 0 to 1) at its own level.
            let sends = if r == 0 { vec![(1, vec![42])] } else { Vec::new() };
            let got = c.exchange(sends, if r == 1 { &[0] } else { &[] })?;
            let all = c.all_gather(vec![r as u8])?;
            c.barrier()?;
            // Frames to itself never touch the transport.
            let own = c.exchange(vec![(r, vec![5]), (next, vec![6])], &[r, prev])?;
            Ok::<_, AttnError>((a, b, got, all, own))
        });
        for (r, x) in res.into_iter().enumerate() {
            let (a, b, got, all, own) = x.unwrap();
            let prev = (r + 3) % 4;
            assert_eq!(a, vec![prev as u8; 3 + prev]);
            let pp = (r + 2) % 4;
            assert_eq!(b, vec![pp as u8; 3 + pp]);
            assert_eq!(got, if r == 1 { vec![vec![42]] } else { vec![] });
            assert_eq!(all, vec![vec![0], vec![1], vec![2], vec![3]]);
            assert_eq!(own, vec![vec![5], vec![6]]);
        }
    }

    #[test]
    fn queued_frames_go_out_with_flush_and_mismatched_counts_are_errors() {
        let res = on_ranks(EmulatedNccl::world_with_timeout(2, Duration::from_secs(10)).unwrap(), |mut c| {
            if c.rank() == 0 {
                c.post(vec![(1, vec![1, 2, 3])])?;
                c.flush()?;
                Ok(Vec::new())
            } else {
                c.exchange(Vec::new(), &[0])
            }
        });
        assert_eq!(res[1].as_ref().unwrap(), &vec![vec![1, 2, 3]]);
        assert!(res[0].is_ok());
        let res = on_ranks(EmulatedNccl::transports(2, SHORT).unwrap(), |mut t| {
            if t.rank() == 0 { t.group(&[(1, &[1, 2][..])], &[]) } else { t.group(&[], &[(0, 3)]) }
        });
        assert!(res.iter().all(|x| matches!(x, Err(AttnError::Comm { .. }))), "{res:?}");
    }
}
