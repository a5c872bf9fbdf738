//! Per-rank memory of `ring_forward` / `ring_backward`, from the plan alone: an upper
//! bound of the bytes one rank allocates during a call beyond the caller's tensors
//! ([`Plan::workspace_bytes`], [`ring_workspace_bytes`]), and those tensors themselves
//! ([`Plan::io_bytes`]). Nothing here runs the call or allocates in proportion to the
//! sequence, so a `MemoryBudget` can refuse a call before it allocates or sends, and a
//! capacity table can search sequence lengths with it.
//!
//! A byte counts from its allocation until someone frees it, whoever holds it: a frame
//! this rank sent counts until its receiver drops it (a rank can run several ring steps
//! ahead of a slow neighbour, so every dk/dv partial it sends is counted), and a frame
//! it received counts while it holds it. The terms, per rank with `L` rows:
//! - f32 accumulators: out and lse of every (batch, head), `B*L*H*(D+1)*4` (only one
//!   chunk of 512 rows when a forward has no ring pattern); the backward adds dq, dk,
//!   dv and delta, `B*L*H*(3D+1)*4` (grad_out is read in place), and drops the f32 out
//!   once delta is computed (before dq, dk and dv exist);
//! - messages: every all-gather block sent and received, this rank's ring block, one
//!   visiting ring block with its decoded copy, and in the backward the f32 dk/dv
//!   messages, each with its frame and message headers and position lists;
//! - block-kernel scratch (kept per thread between calls) and the per-call segment
//!   groups, for the largest pieces this rank's calls can see, at twice the exact size
//!   (a growing `Vec` may double its capacity);
//! - bookkeeping: plan tables, handshake and completion messages, channel blocks.
//!
//! The tile sizes below mirror attn-kernels' block kernels; `attn-reliability`'s
//! `ring_budget` test checks the bound against a counting allocator.

use attn_core::{DType, Pass, Result};

use crate::comm::HEADER_BYTES;
use crate::plan::heads_workspace::heads_workspace_bytes;
use crate::plan::pieces::{KEY_ROWS_PER_CALL, ROW_CHUNK, partial_bytes, pieces};
use crate::plan::ring_route::Way;
use crate::plan::{MSG_HEADER_BYTES, Plan, RingProblem};

/// A `Vec` header (pointer, capacity, length) stored inside another `Vec`.
const VEC: u64 = 24;
/// Frame header plus data-message header of every message.
const FRAME: u64 = HEADER_BYTES as u64 + MSG_HEADER_BYTES;
/// attn-kernels' key tile, query chunk and register-block rows.
const KEY_TILE: u64 = 64;
const QUERY_CHUNK: u64 = 128;
const ROW_BLOCK: u64 = 6;

/// Sizes of one rank's problem, in elements, and the input element size `e`.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: u64,
    d: u64,
    dp: u64,
    e: u64,
    bf16: bool,
}

impl Dims {
    /// A k/v message of `rows` selected rows (summed over pairs).
    fn kv_msg(&self, rows: u64) -> u64 {
        FRAME + self.b * rows * 2 * self.d * self.e
    }
    /// A dk/dv (f32) message of `rows` rows.
    fn grad_msg(&self, rows: u64) -> u64 {
        FRAME + self.b * rows * 2 * self.d * 4
    }
    /// Decoded k/v rows of a block (one `Vec` per (batch, pair), pushed: up to 2x headers).
    fn decoded(&self, rows: u64, pairs: u64) -> u64 {
        self.b * rows * 2 * self.d * self.e + 2 * VEC * (2 * self.b * pairs).max(4)
    }
    /// f32 dk/dv of a block.
    fn grads(&self, rows: u64, pairs: u64) -> u64 {
        self.b * rows * 2 * self.d * 4 + 2 * VEC * self.b * pairs
    }

    /// Forward kernel scratch and piece outputs for pieces of up to `mq` query and `mk`
    /// key rows (f32 tiles; for bf16 also the bf16 pair tiles), doubled for `Vec` growth.
    fn kernel_forward(&self, mq: u64, mk: u64) -> u64 {
        let f32s = 2 * tiles(mk) * self.dp
            + 2 * mq.min(QUERY_CHUNK) * self.dp
            + 2 * QUERY_CHUNK
            + ROW_BLOCK * KEY_TILE
            + mq * (self.d + 1);
        let amx = if self.bf16 {
            let (d32, d16) = (self.d.next_multiple_of(32), self.d.next_multiple_of(16));
            tiles(mk) * (d32 + d16) * 2 + 16 * d32 * 2 + 2 * 16 * KEY_TILE * 6 + 16 * d16 * 4
        } else {
            0
        };
        2 * (4 * f32s + amx)
    }

    /// Backward kernel scratch and piece gradients, doubled for `Vec` growth.
    fn kernel_backward(&self, mq: u64, mk: u64) -> u64 {
        let f32s = 4 * tiles(mq) * self.dp
            + tiles(mq)
            + ROW_BLOCK * KEY_TILE
            + 2 * QUERY_CHUNK * KEY_TILE
            + mq * self.dp
            + 4 * mk.min(QUERY_CHUNK) * self.dp
            + (mq + 2 * mk) * self.d;
        2 * 4 * f32s + 16 * mq
    }
}

/// Rows rounded up to whole key tiles.
fn tiles(n: u64) -> u64 {
    n.div_ceil(KEY_TILE) * KEY_TILE
}

/// Position lists of a block: one `Vec` per pair, collected from a flat map (up to 2x).
fn positions(rows: u64, pairs: u64) -> u64 {
    16 * rows + pairs * (VEC + 32)
}

/// The segment groups a block call builds for one side: `s` selected rows in at most
/// `segs` segments (row, offset and position lists, pushed).
fn groups(s: u64, segs: u64) -> u64 {
    64 * s + 256 * segs.min(s) + 512
}

/// Sums and maxima over a set of (owner, receiver) blocks.
fn sum_max(xs: impl Iterator<Item = u64>) -> (u64, u64) {
    xs.fold((0, 0), |(s, m), x| (s + x, m.max(x)))
}

impl Plan {
    /// Upper bound of the bytes rank `rank` allocates during one `ring_forward`
    /// (`backward = false`) or `ring_backward` call with inputs of `dtype`, beyond the
    /// caller's tensors ([`Plan::io_bytes`]); 0 for a rank outside the world. See the
    /// module documentation for what is counted.
    pub fn workspace_bytes(&self, dtype: DType, rank: usize, pass: Pass) -> u64 {
        match self.head_split() {
            Some(split) => heads_workspace_bytes(&self.problem, split, dtype, rank, pass),
            None => self.row_workspace_bytes(dtype, rank, pass),
        }
    }

    /// [`Plan::workspace_bytes`] of the row plan (per-pattern local, ring or all-gather),
    /// whatever head split the plan runs.
    pub(crate) fn row_workspace_bytes(&self, dtype: DType, rank: usize, pass: Pass) -> u64 {
        let backward = pass == Pass::Backward;
        let pr = &self.problem;
        let p = pr.world;
        if rank >= p {
            return 0;
        }
        let d = pr.head_dim as u64;
        let x = Dims {
            b: pr.batch as u64,
            d,
            dp: d.next_multiple_of(16),
            e: dtype.size() as u64,
            bf16: dtype == DType::BF16,
        };
        let nl = pr.layout.rows(pr.seq, p, rank) as u64;
        let bh = x.b * pr.heads as u64;
        let (nr, ng) = (self.ring_heads.len() as u64, self.gather_heads.len() as u64);
        let ring = |way: Way, o: usize| sum_max(self.ring_heads.iter().map(|ph| self.ring_count(way, o, ph) as u64));
        let gather =
            |o: usize, r: usize| sum_max(self.gather_heads.iter().map(|ph| self.gather_count(o, r, ph) as u64));
        let sends: Vec<usize> = (0..p).filter(|&y| self.gather_need(rank, y)).collect();
        let recvs: Vec<usize> = (0..p).filter(|&y| self.gather_need(y, rank)).collect();
        // Blocks visiting this rank, by way (at most one from each way at a step).
        let visitors: [Vec<(Way, usize)>; 2] = Way::BOTH.map(|way| {
            (1..=self.ring_steps())
                .map(|t| (way, way.owner_at(rank, t, p)))
                .filter(|&(way, o)| self.ring_visits(way, o, rank))
                .collect()
        });
        let all_visitors = || visitors.iter().flatten().copied();
        // The larger of the two ways' per-visitor figure `f`, for each way, summed.
        let per_step = |f: &dyn Fn(Way, usize) -> u64| -> u64 {
            visitors.iter().map(|v| v.iter().map(|&(w, o)| f(w, o)).max().unwrap_or(0)).sum()
        };

        // Largest selected rows a kernel call sees: this rank's own rows (queries, own
        // keys) and any received part; pieces are at most one segment's selection.
        let ranges = pr.layout.ranges(pr.seq, p, rank);
        let mut sel_own = 0u64;
        let (mut cap, mut w_min) = (1u64, u64::MAX);
        for head in 0..pr.heads {
            for (_, pat) in pr.cfg.head_patterns(pr.heads, head).patterns {
                let placed = self.placed(pat);
                sel_own = sel_own.max(ranges.iter().map(|r| placed.count_in_range(r.clone()) as u64).sum());
                // A segment holds at most the whole sequence (`w > n` is one segment).
                cap = cap.max(pat.w.min(pr.seq).div_ceil(pat.r) as u64 + 1);
                w_min = w_min.min(pat.w as u64);
            }
        }
        let received = all_visitors().map(|(w, o)| ring(w, o).1).chain(recvs.iter().map(|&y| gather(y, rank).1));
        let sel_k = received.fold(sel_own, u64::max);
        let n_max = (0..p).map(|r| pr.layout.rows(pr.seq, p, r) as u64).max().unwrap_or(0);
        // Every packed sequence may start a segment of its own.
        let sequences = pr.masks.cu_seqlens().map_or(0, |c| c.len() as u64);
        let segs_q = nl / w_min.max(1) + 4 + sequences;
        let segs_k = n_max / w_min.max(1) + 4 + sequences;

        // Messages of the all-gather and ring passes of a forward.
        let own_ring: u64 = Way::BOTH
            .into_iter()
            .filter(|&w| self.hops_of(w, rank) >= 1)
            .map(|w| {
                let (rows, pair) = ring(w, rank);
                x.kv_msg(rows) + positions(rows, nr) + 8 * pair
            })
            .sum();
        let gsend: u64 = sends
            .iter()
            .map(|&y| {
                let (rows, pair) = gather(rank, y);
                x.kv_msg(rows) + positions(rows, ng) + 8 * pair
            })
            .sum();
        let graw: u64 = recvs.iter().map(|&y| x.kv_msg(gather(y, rank).0) + 2 * positions(gather(y, rank).0, ng)).sum();
        let graw = graw + (8 * x.b * ng + 2 * VEC) * recvs.len() as u64;
        let small = self.bookkeeping_bytes() + 16 * nl;

        if !backward && self.ring_heads.is_empty() {
            // Direct all-gather forward: pieces of at most piece_rows rows, one round at a
            // time; f32 partials for the query rows that see remote keys; then chunks of
            // ROW_CHUNK rows over the own keys.
            let rows = ROW_CHUNK as u64;
            let (sq, sk) = (sel_own.min(rows + 2), sel_k.min(KEY_ROWS_PER_CALL as u64 + 2));
            // Received rows are decoded into two reused buffers (up to 2x by growth).
            let piece_rows = self.piece_rows() as u64;
            let kv_bufs = if recvs.is_empty() { 0 } else { 2 * 2 * piece_rows * d * x.e };
            let acc = nl.min(rows) * (d + 1) * 4 + kv_bufs;
            let piece_pos = positions(piece_rows, 1);
            // Every piece sent may still be held by its receiver (a rank that only sends
            // can run rounds ahead), plus the positions of the piece being encoded.
            let (mut sent, mut listed) = (piece_pos, 0u64);
            for &y in &sends {
                let n = pieces(self, rank, y).len() as u64;
                sent += x.kv_msg(gather(rank, y).0) + FRAME * n.saturating_sub(1);
                listed += n;
            }
            // One round received: a piece from each source with its positions and offsets.
            let piece = x.kv_msg(piece_rows) + 2 * piece_pos + 8 * x.b + 2 * VEC;
            let round = recvs.len() as u64 * piece;
            listed += recvs.iter().map(|&y| pieces(self, y, rank).len() as u64).sum::<u64>();
            let lists = 2 * 24 * listed + 4 * VEC * p as u64 + 8 * ng;
            let kernel = x.kernel_forward(sq.min(cap), sk.min(cap)) + groups(sq, segs_q) + groups(sk, segs_k);
            return acc + sent + round + partial_bytes(self, rank) + lists + kernel + small;
        }

        let acc = bh * nl * (d + 1) * 4 + 2 * VEC * bh;
        let gdecoded: u64 = recvs.iter().map(|&y| x.decoded(gather(y, rank).0, ng)).sum();
        let visit = per_step(&|w, o| {
            let rows = ring(w, o).0;
            x.kv_msg(rows) + x.decoded(rows, nr) + positions(rows, nr)
        });
        let (mq, mk) = (sel_own.min(cap), sel_k.min(cap));
        let kern_f = x.kernel_forward(mq, mk);
        let grp = groups(sel_own, segs_q) + groups(sel_k, segs_k);
        let fwd_transient = (graw + gdecoded).max(visit) + grp;
        let persist = acc + own_ring + gsend + kern_f;
        if !backward {
            return persist + fwd_transient + small;
        }

        // Backward: state, the all-gather k/v out and dk/dv back, the ring pass with
        // dk/dv partials travelling on and home, and the backward kernels.
        // dq, dk, dv and delta (grad_out is read in place); the forward's f32 output is
        // dropped once delta is computed, before dq, dk and dv are allocated.
        let state = 3 * bh * nl * d * 4 + bh * nl * 4 + 4 * VEC * bh;
        let (_, dec_max) = sum_max(recvs.iter().map(|&y| {
            let rows = gather(y, rank).0;
            x.decoded(rows, ng) + x.grads(rows, ng)
        }));
        let recv_b: u64 = recvs
            .iter()
            .map(|&y| {
                let rows = gather(y, rank).0;
                x.kv_msg(rows) + x.grad_msg(rows) + positions(rows, ng)
            })
            .sum();
        let ret_b: u64 = sends
            .iter()
            .map(|&y| {
                let (rows, pair) = gather(rank, y);
                x.grad_msg(rows) + x.grads(rows, ng) + 2 * positions(rows, ng) + 8 * pair * (d + 1)
            })
            .sum();
        let step = per_step(&|w, o| {
            let (rows, pair) = ring(w, o);
            x.kv_msg(rows)
                + x.decoded(rows, nr)
                + positions(rows, nr)
                + x.grads(rows, nr)
                + x.grad_msg(rows)
                + 8 * pair * d
        });
        let outgoing: u64 = all_visitors().map(|(w, o)| x.grad_msg(ring(w, o).0)).sum();
        let home: u64 = Way::BOTH
            .into_iter()
            .filter(|&w| self.hops_of(w, rank) >= 1)
            .map(|w| {
                let (rows, pair) = ring(w, rank);
                x.grad_msg(rows) + x.grads(rows, nr) + 2 * positions(rows, nr) + 8 * pair * (d + 1)
            })
            .sum();
        let kern_b = x.kernel_backward(mq, mk) + grp;
        let bwd = state + gsend + recv_b + dec_max + ret_b + own_ring + step + outgoing + home + kern_b;
        let out_f32 = bh * nl * d * 4;
        (persist + fwd_transient).max(persist - out_f32 + bwd) + small
    }

    /// Plan tables, handshake and completion messages and channel bookkeeping: small,
    /// independent of the sequence length.
    fn bookkeeping_bytes(&self) -> u64 {
        let pr = &self.problem;
        let (p, g) = (pr.world as u64, pr.cfg.num_patterns() as u64);
        let pairs = (self.ring_heads.len() + self.gather_heads.len()) as u64 + pr.heads as u64 * g;
        let fingerprint = 512 + 48 * g;
        let handshake = 6 * p * (fingerprint + 160);
        let completion = 4 * p * (32 * p + 96) + 32 * p * p;
        let plan = g * p * (p + 48 + 128 * p) + 192 * pairs + 64 * p + 2048;
        16384 + handshake + completion + 2048 * p + plan
    }

    /// Bytes of the caller's tensors on rank `rank`: q, k, v, out and lse for a forward;
    /// q, k, v, grad_out, dq, dk and dv for a backward.
    pub fn io_bytes(&self, dtype: DType, rank: usize, pass: Pass) -> u64 {
        let backward = pass == Pass::Backward;
        let pr = &self.problem;
        if rank >= pr.world {
            return 0;
        }
        let rows = (pr.batch * pr.layout.rows(pr.seq, pr.world, rank) * pr.heads) as u64;
        let elems = rows * pr.head_dim as u64 * dtype.size() as u64;
        if backward { 7 * elems } else { 4 * elems + 4 * rows }
    }

    /// The largest [`Plan::workspace_bytes`] of any rank: what every rank checks a
    /// budget against, so all ranks of a call decide alike.
    pub fn max_workspace_bytes(&self, dtype: DType, pass: Pass) -> u64 {
        (0..self.problem.world).map(|r| self.workspace_bytes(dtype, r, pass)).max().unwrap_or(0)
    }
}

/// Upper bound of the bytes any one rank allocates during a `ring_forward`
/// (`backward = false`) or `ring_backward` of `problem` with inputs of `dtype`, beyond
/// the caller's tensors: [`Plan::max_workspace_bytes`]. Errors as [`Plan::new`].
pub fn ring_workspace_bytes(problem: &RingProblem, dtype: DType, pass: Pass) -> Result<u64> {
    Ok(Plan::new(problem.clone())?.max_workspace_bytes(dtype, pass))
}
