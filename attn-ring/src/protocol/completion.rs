//! The completion protocol that ends every call before any output is written: two
//! rounds that give every rank the same verdict on the whole exchange.
//!
//! Round 1 (tables): every rank sends every peer its per-peer counts of frames sent
//! and accepted so far; each rank checks the whole table (`sent[i][j] == received[j][i]`
//! for every pair), then looks for extra frames already waiting from each peer (a
//! duplicate of a frame it has accepted). Round 2 (verdicts): every rank sends its
//! verdict (on the exchange, and on inputs it could judge only after it, such as a
//! gradient into the LSE); a rank succeeds only if every verdict is "ok", so a fault
//! seen by one rank fails all of them. After round 2 a rank checks once more for extra frames;
//! a duplicate of a round-2 frame can only fail the rank that receives it (no finite
//! protocol can agree on its own last message).

use attn_core::{AttnError, Result};

use crate::comm::{Communicator, HEADER_BYTES};

const TABLE_TAG: u8 = 1;
const VERDICT_TAG: u8 = 2;

/// Run both rounds; `Ok` means every rank agreed that the call succeeded. `local` is
/// this rank's own verdict on what it computed (an input it could judge only after the
/// exchanges); an `Err` there fails every rank.
pub(crate) fn complete<C: Communicator + ?Sized>(comm: &mut C, local: Result<()>) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world_size());
    if world == 1 {
        return local;
    }
    let peers: Vec<usize> = (0..world).filter(|&p| p != rank).collect();
    let sent = comm.framing().sent_counts().to_vec();
    let received = comm.framing().received_counts().to_vec();

    // Round 1: the count tables. A transport failure ends the call here (peers then
    // miss this rank's verdict and fail too); framing failures become this rank's verdict.
    let table = encode_table(&sent, &received);
    let frames: Vec<(usize, Vec<u8>)> = peers.iter().map(|&p| (p, comm.framing_mut().seal(p, table.clone()))).collect();
    let raw = comm.exchange_frames(frames, &peers)?;
    let mut tables = vec![(sent, received)];
    let mut verdict: Result<()> = Ok(());
    for (&p, frame) in peers.iter().zip(raw) {
        match comm.framing_mut().open(p, frame).and_then(|b| decode_table(rank, p, world, &b)) {
            Ok(t) => tables.push(t),
            Err(e) => {
                verdict = verdict.and(Err(e));
            }
        }
    }
    if verdict.is_ok() {
        verdict = check_tables(rank, &peers, &tables).and_then(|()| check_no_extra(comm, &peers));
    }
    verdict = local.and(verdict);

    // Round 2: the verdicts.
    let mine = match &verdict {
        Ok(()) => vec![VERDICT_TAG, 1],
        Err(e) => [&[VERDICT_TAG, 0][..], e.to_string().as_bytes()].concat(),
    };
    let sends = peers.iter().map(|&p| (p, mine.clone())).collect();
    let got = comm.exchange(sends, &peers);
    verdict?;
    for (&p, v) in peers.iter().zip(got?) {
        match v.as_slice() {
            [VERDICT_TAG, 1] => {}
            [VERDICT_TAG, 0, why @ ..] => {
                let why = String::from_utf8_lossy(why);
                return Err(AttnError::Comm { rank, message: format!("rank {p} reported a failure: {why}") });
            }
            _ => return Err(AttnError::Comm { rank, message: format!("malformed verdict from rank {p}") }),
        }
    }
    check_no_extra(comm, &peers)
}

/// Table payload: tag, then `sent[p]`, `received[p]` for every rank `p`.
fn encode_table(sent: &[u64], received: &[u64]) -> Vec<u8> {
    let mut b = Vec::with_capacity(1 + 16 * sent.len());
    b.push(TABLE_TAG);
    for (s, r) in sent.iter().zip(received) {
        b.extend_from_slice(&s.to_le_bytes());
        b.extend_from_slice(&r.to_le_bytes());
    }
    b
}

fn decode_table(rank: usize, peer: usize, world: usize, b: &[u8]) -> Result<(Vec<u64>, Vec<u64>)> {
    if b.len() != 1 + 16 * world || b[0] != TABLE_TAG {
        return Err(AttnError::Comm { rank, message: format!("malformed completion table from rank {peer}") });
    }
    let word = |i: usize| u64::from_le_bytes(b[1 + 8 * i..9 + 8 * i].try_into().unwrap_or([0; 8]));
    Ok(((0..world).map(|p| word(2 * p)).collect(), (0..world).map(|p| word(2 * p + 1)).collect()))
}

/// `tables[0]` is this rank's, `tables[1..]` follow `peers`. Every pair must agree.
fn check_tables(rank: usize, peers: &[usize], tables: &[(Vec<u64>, Vec<u64>)]) -> Result<()> {
    let owner = |i: usize| if i == 0 { rank } else { peers[i - 1] };
    for (i, (sent, _)) in tables.iter().enumerate() {
        for (j, (_, received)) in tables.iter().enumerate() {
            let (a, b) = (owner(i), owner(j));
            if a != b && sent[b] != received[a] {
                return Err(AttnError::Comm {
                    rank,
                    message: format!("rank {a} sent {} frames to rank {b}, which accepted {}", sent[b], received[a]),
                });
            }
        }
    }
    Ok(())
}

/// Fail if a peer has an extra copy of an already accepted frame waiting.
fn check_no_extra<C: Communicator + ?Sized>(comm: &mut C, peers: &[usize]) -> Result<()> {
    let rank = comm.rank();
    for &p in peers {
        let head = comm.peek_frame(p)?.map(|f| f[..f.len().min(HEADER_BYTES)].to_vec());
        let stale = head.is_some_and(|h| comm.framing().is_stale(p, &h));
        if stale {
            return Err(AttnError::Comm { rank, message: format!("extra (duplicated) frame waiting from rank {p}") });
        }
    }
    Ok(())
}
