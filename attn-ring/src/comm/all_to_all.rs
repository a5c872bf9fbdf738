//! All-to-all over a subset of ranks: every member sends one payload to every other
//! member and receives one from each, in one framed exchange (so it inherits the
//! transport's timeouts and typed errors: a dead or silent member is `Comm` or `Timeout`
//! on every rank waiting for it, never a hang). Built on [`Communicator::exchange`], so
//! every transport (threads, MPI, NCCL's grouped rounds) has it as paired sends.

use attn_core::{AttnError, Result};

use super::Communicator;

/// Send `payloads[i]` to `members[i]` and return the payload each member sent this rank,
/// in `members` order. `members` must list this rank (its own payload is handed back
/// without travelling), and every member must call it with the same list.
pub fn all_to_all<C: Communicator + ?Sized>(
    comm: &mut C,
    members: &[usize],
    payloads: Vec<Vec<u8>>,
) -> Result<Vec<Vec<u8>>> {
    let rank = comm.rank();
    if payloads.len() != members.len() {
        return Err(AttnError::InvalidArgument(format!(
            "all-to-all over {} members with {} payloads",
            members.len(),
            payloads.len()
        )));
    }
    if !members.contains(&rank) {
        return Err(AttnError::InvalidArgument(format!("rank {rank} is not a member of its all-to-all {members:?}")));
    }
    let sends = members.iter().copied().zip(payloads).collect();
    comm.exchange(sends, members)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::comm::{Fault, FaultyComm, ThreadComm};

    /// Every rank of each group of two sends `[rank, member]`, all at once.
    fn run(world: usize, faults: impl Fn(usize) -> Vec<Fault>) -> Vec<Result<Vec<Vec<u8>>>> {
        let comms = ThreadComm::world_with_timeout(world, Duration::from_millis(400)).unwrap();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let r = c.rank();
                let mut c = FaultyComm::new(c, faults(r));
                std::thread::spawn(move || {
                    let r = c.rank();
                    let members: Vec<usize> = (r / 2 * 2..r / 2 * 2 + 2).collect();
                    let payloads = members.iter().map(|&m| vec![r as u8, m as u8]).collect();
                    all_to_all(&mut c, &members, payloads)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn each_member_gets_what_was_sent_to_it() {
        for (r, got) in run(4, |_| Vec::new()).into_iter().enumerate() {
            let g = r / 2 * 2;
            assert_eq!(got.unwrap(), vec![vec![g as u8, r as u8], vec![g as u8 + 1, r as u8]]);
        }
    }

    #[test]
    fn a_dead_member_is_a_typed_error_on_its_peer() {
        // Rank 1 dies at its first frame: rank 0 (its group) fails, typed; group 2-3 is unaffected.
        let got = run(4, |r| if r == 1 { vec![Fault::Kill { nth: 0 }] } else { Vec::new() });
        assert!(
            matches!(got[0], Err(AttnError::Comm { rank: 0, .. } | AttnError::Timeout { rank: 0, .. })),
            "{:?}",
            got[0]
        );
        assert!(got[1].is_err());
        assert!(got[2].is_ok() && got[3].is_ok());
    }

    #[test]
    fn a_payload_count_off_the_members_is_refused() {
        let mut c = ThreadComm::world(1).unwrap().pop().unwrap();
        assert!(matches!(all_to_all(&mut c, &[0], Vec::new()), Err(AttnError::InvalidArgument(_))));
        assert!(matches!(all_to_all(&mut c, &[1], vec![Vec::new()]), Err(AttnError::InvalidArgument(_))));
        assert_eq!(all_to_all(&mut c, &[0], vec![vec![7]]).unwrap(), vec![vec![7]]);
    }
}
