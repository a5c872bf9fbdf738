//! Message framing: every payload travels with a magic word, its sender, a
//! per-channel sequence number, its length and a checksum, so that corruption,
//! duplication, reordering, loss and truncation are detected on receipt.

use attn_core::{AttnError, Result};

/// Bytes of the frame header.
pub const HEADER_BYTES: usize = 32;
const MAGIC: u32 = 0x4e52_5441; // "ATRN"

/// A 64-bit checksum over the header fields and the payload (word-wise multiply-xor).
pub fn checksum(src: u32, seq: u64, payload: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ (u64::from(src) << 32) ^ seq.wrapping_mul(K);
    h = (h ^ payload.len() as u64).wrapping_mul(K).rotate_left(29);
    let mut chunks = payload.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
        h = (h ^ w).wrapping_mul(K).rotate_left(31);
    }
    for (i, &b) in chunks.remainder().iter().enumerate() {
        h = (h ^ (u64::from(b) << (8 * i))).wrapping_mul(K).rotate_left(17);
    }
    h ^ (h >> 32)
}

/// Sequence numbers per peer and byte counters for one rank.
#[derive(Debug, Clone)]
pub struct Framing {
    rank: usize,
    send_seq: Vec<u64>,
    recv_seq: Vec<u64>,
    stats: CommStats,
}

/// What one rank has sent so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// Payload bytes handed to the transport (excluding frame headers).
    pub payload_bytes_sent: u64,
    /// Bytes including frame headers.
    pub frame_bytes_sent: u64,
    /// Number of messages sent.
    pub messages_sent: u64,
}

impl Framing {
    /// Framing state for `rank` of `world` ranks.
    pub fn new(rank: usize, world: usize) -> Self {
        Framing { rank, send_seq: vec![0; world], recv_seq: vec![0; world], stats: CommStats::default() }
    }

    pub fn stats(&self) -> CommStats {
        self.stats
    }

    /// Frames sent to each rank so far (index = rank; 0 for self).
    pub fn sent_counts(&self) -> &[u64] {
        &self.send_seq
    }

    /// Frames accepted from each rank so far (index = rank; 0 for self).
    pub fn received_counts(&self) -> &[u64] {
        &self.recv_seq
    }

    /// Whether a raw frame waiting from `peer` is an extra copy of one already accepted
    /// (its header names `peer` and a sequence number below the next expected one).
    pub fn is_stale(&self, peer: usize, frame: &[u8]) -> bool {
        if frame.len() < HEADER_BYTES || peer >= self.recv_seq.len() {
            return false;
        }
        let magic = u32::from_le_bytes(frame[0..4].try_into().unwrap_or([0; 4]));
        let src = u32::from_le_bytes(frame[4..8].try_into().unwrap_or([0; 4]));
        let seq = u64::from_le_bytes(frame[8..16].try_into().unwrap_or([0; 8]));
        magic == MAGIC && src as usize == peer && seq < self.recv_seq[peer]
    }

    /// Wrap `payload` for `peer`, advancing that channel's sequence number. The header
    /// is inserted in front of the payload in place (no copy when the payload was built
    /// with [`HEADER_BYTES`] of spare capacity).
    pub fn seal(&mut self, peer: usize, mut payload: Vec<u8>) -> Vec<u8> {
        let seq = self.send_seq[peer];
        self.send_seq[peer] += 1;
        let src = self.rank as u32;
        let mut h = [0u8; HEADER_BYTES];
        h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4..8].copy_from_slice(&src.to_le_bytes());
        h[8..16].copy_from_slice(&seq.to_le_bytes());
        h[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        h[24..32].copy_from_slice(&checksum(src, seq, &payload).to_le_bytes());
        self.stats.payload_bytes_sent += payload.len() as u64;
        // Exactly the header's room: a growing `Vec` would double a full payload's buffer.
        payload.reserve_exact(HEADER_BYTES);
        payload.splice(0..0, h);
        self.stats.frame_bytes_sent += payload.len() as u64;
        self.stats.messages_sent += 1;
        payload
    }

    /// Check a frame received from `peer` and return its payload.
    pub fn open(&mut self, peer: usize, mut frame: Vec<u8>) -> Result<Vec<u8>> {
        let rank = self.rank;
        let err = |message: String| AttnError::Comm { rank, message: format!("frame from rank {peer}: {message}") };
        if frame.len() < HEADER_BYTES {
            return Err(err(format!("truncated header ({} bytes)", frame.len())));
        }
        let u32_at = |o: usize| u32::from_le_bytes(frame[o..o + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |o: usize| u64::from_le_bytes(frame[o..o + 8].try_into().unwrap_or([0; 8]));
        let (magic, src, seq, len, sum) = (u32_at(0), u32_at(4), u64_at(8), u64_at(16), u64_at(24));
        if magic != MAGIC {
            return Err(err(format!("bad magic {magic:#x} (corrupted)")));
        }
        if src as usize != peer {
            return Err(err(format!("claims to come from rank {src}")));
        }
        let expected = self.recv_seq[peer];
        if seq < expected {
            return Err(err(format!("sequence {seq} already received (duplicate; expected {expected})")));
        }
        if seq > expected {
            return Err(err(format!("sequence {seq} arrived before {expected} (lost or reordered message)")));
        }
        let body = frame.len() - HEADER_BYTES;
        if len != body as u64 {
            return Err(err(format!("length field {len} but {body} payload bytes (truncated or corrupted)")));
        }
        if checksum(src, seq, &frame[HEADER_BYTES..]) != sum {
            return Err(err("checksum mismatch (corrupted payload)".into()));
        }
        self.recv_seq[peer] += 1;
        frame.drain(..HEADER_BYTES);
        Ok(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fault_kind_is_detected() {
        let (mut a, mut b) = (Framing::new(0, 2), Framing::new(1, 2));
        let f0 = a.seal(1, b"hello world, this is a payload".to_vec());
        let f1 = a.seal(1, b"second".to_vec());
        // Corrupt one payload bit.
        let mut bad = f0.clone();
        bad[HEADER_BYTES + 3] ^= 4;
        assert!(matches!(b.clone().open(0, bad), Err(AttnError::Comm { .. })));
        // Truncate.
        assert!(b.clone().open(0, f0[..f0.len() - 1].to_vec()).is_err());
        assert!(b.clone().open(0, f0[..10].to_vec()).is_err());
        // Reorder (f1 first).
        assert!(b.clone().open(0, f1.clone()).is_err());
        // In order works, duplicate fails.
        assert_eq!(b.open(0, f0.clone()).unwrap(), b"hello world, this is a payload");
        assert!(b.clone().open(0, f0).is_err());
        assert_eq!(b.open(0, f1).unwrap(), b"second");
        // Wrong sender.
        let f = a.seal(1, b"x".to_vec());
        assert!(b.open(1, f).is_err());
        assert_eq!(a.stats().messages_sent, 3);
        assert_eq!(a.stats().frame_bytes_sent - a.stats().payload_bytes_sent, 3 * HEADER_BYTES as u64);
    }
}
