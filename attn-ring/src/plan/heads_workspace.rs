//! Per-rank memory of the head strategies (Ulysses, hybrid) from the problem alone: an
//! upper bound of the bytes one rank allocates during a call beyond the caller's tensors
//! ([`crate::Plan::workspace_bytes`] for those strategies). Every buffer the call holds is
//! summed as if all were alive at once (phases overlap only partly, so the bound is loose
//! by up to about 2x), with `n` the sequence, `N` the group's rows, `L` the rank's rows,
//! `m`/`k` the slot's query and key/value heads:
//! - the first all-to-all: every payload sent (this rank's rows of each slot) and received
//!   (the group's rows of this slot), with headers;
//! - the slot's rows: q, k and v of the group `B*N*(m+2k)*D*e`, in the backward grad_out
//!   and the f32 gradient into the LSE;
//! - the ring over the groups: the block held, the message sent and the one received (`N`
//!   the largest group's rows; in the backward with f32 dk/dv);
//! - the f32 forward `(o, lse)` `B*N*m*(D+1)*4`, in the backward delta and dq over the
//!   group's rows and the own block's dk/dv;
//! - the second all-to-all: payloads sent and received, and the rank's staged outputs;
//! - block-kernel scratch of one call (one group's keys and values as f32 tiles, doubled
//!   for `Vec` growth) per compute thread beyond the first not counted, as in the
//!   ring; bookkeeping (handshake, completion, position lists).

use attn_core::{DType, Pass};

use crate::comm::HEADER_BYTES;
use crate::plan::heads_split::HeadSplit;
use crate::plan::{MSG_HEADER_BYTES, RingProblem};

/// Frame header plus data-message header of every message.
const FRAME: u64 = HEADER_BYTES as u64 + MSG_HEADER_BYTES;
/// attn-kernels' key tile.
const KEY_TILE: u64 = 64;

/// See the module documentation; 0 for a rank outside the world.
pub(crate) fn heads_workspace_bytes(
    problem: &RingProblem,
    split: &HeadSplit,
    dtype: DType,
    rank: usize,
    pass: Pass,
) -> u64 {
    let RingProblem { batch, head_dim, seq, world: p, layout, heads, kv_heads, .. } = *problem;
    if rank >= p {
        return 0;
    }
    let backward = pass == Pass::Backward;
    let (b, d, e, n) = (batch as u64, head_dim as u64, dtype.size() as u64, seq as u64);
    let (g, j) = (split.group_of(rank), split.slot_of(rank));
    let rows = |r: usize| layout.rows(seq, p, r) as u64;
    let (l, nq) = (rows(rank), split.group_rows(layout, seq, g) as u64);
    let (m, k) = (split.slot_heads(j).len() as u64, split.slot_kv(j).len() as u64);
    // Bytes per row of a slot's first-all-to-all payload: q, k, v, and grad_out with the
    // LSE's gradient in the backward.
    let in_row = |mj: u64, kj: u64| (mj + 2 * kj) * d * e + if backward { mj * (d * e + 4) } else { 0 };
    let sent_in: u64 = (0..split.u)
        .map(|jm| FRAME + b * l * in_row(split.slot_heads(jm).len() as u64, split.slot_kv(jm).len() as u64))
        .sum();
    let recv_in = split.u as u64 * FRAME + b * nq * in_row(m, k);
    let slot = b * nq * (m + 2 * k) * d * e + if backward { b * nq * m * (d * e + 4) } else { 0 };
    let largest = (0..split.groups).map(|x| split.group_rows(layout, seq, x) as u64).max().unwrap_or(0);
    // Held, sent and received blocks of the ring (with f32 dk/dv in the backward).
    let block = FRAME + b * largest * 2 * k * d * (e + if backward { 4 } else { 0 });
    let ring = if split.groups > 1 { 3 * block } else { 0 };
    let fwd = b * nq * m * (d + 1) * 4;
    let (second, grads) = if backward {
        // delta and dq over the group's rows, the own block's dk/dv, dq/dk/dv to each member
        // and from each, the staged f32 gradients.
        let g = b * nq * m * (d + 1) * 4 + 2 * b * nq * k * d * 4;
        let out = split.u as u64 * FRAME + b * nq * (m + 2 * k) * d * 4;
        let back = split.u as u64 * FRAME + b * l * (heads as u64 + 2 * (kv_heads as u64) * split.u as u64) * d * 4;
        let staged = b * l * (heads + 2 * kv_heads) as u64 * d * 4;
        (out + back + staged, g)
    } else {
        let out = split.u as u64 * FRAME + b * nq * m * (d * e + 4);
        let back = split.u as u64 * FRAME + b * l * heads as u64 * (d * e + 4);
        (out + back + b * l * heads as u64 * (d * e + 4), 0)
    };
    // One kernel call's f32 keys and values (whole tiles, head dim rounded up to 16), doubled.
    let scratch =
        2 * (2 * largest.max(nq).div_ceil(KEY_TILE) * KEY_TILE * d.next_multiple_of(16) * 4) + 2 * nq * (d + 8) * 4;
    // Position lists and index maps (8 bytes a row), handshake and completion messages.
    let lists = 8 * (n + 4 * nq + 2 * l);
    let bookkeeping = 16384 + 6 * p as u64 * 1024 + 4 * p as u64 * (32 * p as u64 + 96) + 2048 * p as u64;
    sent_in + recv_in + slot + ring + fwd + second + grads + scratch + lists + bookkeeping
}
