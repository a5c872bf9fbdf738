//! What the plan ring moves and holds, in closed form from the plan alone: the bytes and
//! messages each rank sends ([`expected_traffic`], [`expected_bytes`]) and the buffers its
//! forward holds at its peak ([`forward_buffer_bytes`]).

use attn_core::{DType, Pass};

use crate::plan::heads_split::HeadSplit;
use crate::plan::ring_route::Way;
use crate::plan::{MSG_HEADER_BYTES, Plan, RingProblem};

/// What one rank sends in one call: payload bytes (headers included) and data messages,
/// as `RingStats::data_bytes_sent` and `RingStats::data_messages` count them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Traffic {
    pub bytes: u64,
    pub messages: u64,
}

impl Traffic {
    /// One message of `payload` bytes after its header.
    fn send(&mut self, payload: u64) {
        self.bytes += MSG_HEADER_BYTES + payload;
        self.messages += 1;
    }

    /// `count` messages carrying `payload` bytes between them.
    fn send_pieces(&mut self, count: u64, payload: u64) {
        self.bytes += count * MSG_HEADER_BYTES + payload;
        self.messages += count;
    }
}

/// The bytes of [`expected_traffic`], per rank.
pub fn expected_bytes(plan: &Plan, dtype: DType, pass: Pass) -> Vec<u64> {
    expected_traffic(plan, dtype, pass).into_iter().map(|t| t.bytes).collect()
}

/// Payload bytes and messages each rank sends during one forward (or backward) call, by
/// closed-form counts of selected rows (`count_in_range`), not by running anything.
///
/// Forward: all-gather sends `batch * sum_(pattern, head) selected(o -> r) * 2 * d * elem`
/// to each rank that needs them (in one message, or, when no pattern uses the ring, in
/// pieces of at most `direct::piece_rows` (128 to 1024) rows of one (pattern, head),
/// each with its header); a ring block of owner `o` (`batch * sum selected(o) * 2 * d *
/// elem` going each way) is sent once by each of the first `hops_of(way, o)` ranks on its
/// way. Backward adds the
/// same for the recomputed forward, the k/v pass, and the f32 dk/dv coming back (for the
/// ring: once per hop after the first, plus the trip home). Every message carries a
/// [`MSG_HEADER_BYTES`] header; handshake and completion rounds are not counted. The head
/// strategies (Ulysses, hybrid, and `Auto` where it picks one: [`Plan::head_split`]) send
/// what [`heads_traffic`] counts.
///
/// Under a block mask, `selected(o -> r)` and a ring block's rows count only the selected
/// key rows of the key blocks that some query block of a receiver keeps (in some batch,
/// for some query head reading the pair) and reaches (segment and band), and a block
/// travels only as far as the last rank needing any of them; with every block kept this
/// is the count above. The head strategies move whole heads whatever the mask.
pub fn expected_traffic(plan: &Plan, dtype: DType, pass: Pass) -> Vec<Traffic> {
    match plan.head_split() {
        Some(split) => heads_traffic(&plan.problem, split, dtype, pass),
        None => row_traffic(plan, dtype, pass),
    }
}

/// [`expected_traffic`] of the row plan (per-pattern local, ring or all-gather).
pub(crate) fn row_traffic(plan: &Plan, dtype: DType, pass: Pass) -> Vec<Traffic> {
    let backward = pass == Pass::Backward;
    let RingProblem { batch, head_dim: d, world: p, .. } = plan.problem;
    let (b, d, e) = (batch as u64, d as u64, dtype.size() as u64);
    let mut fwd = vec![Traffic::default(); p];
    let mut direct = vec![Traffic::default(); p];
    let mut bwd_extra = vec![Traffic::default(); p];
    for o in 0..p {
        for r in (0..p).filter(|&r| plan.gather_need(o, r)) {
            let rows: u64 = plan.gather_heads.iter().map(|ph| plan.gather_count(o, r, ph) as u64).sum();
            fwd[o].send(b * rows * 2 * d * e);
            let pieces = crate::plan::pieces::pieces(plan, o, r).len() as u64;
            direct[o].send_pieces(pieces, b * rows * 2 * d * e);
            // dk/dv (f32) go back from r to o.
            bwd_extra[r].send(b * rows * 2 * d * 4);
        }
        for way in Way::BOTH {
            let rows: u64 = plan.ring_heads.iter().map(|ph| plan.ring_count(way, o, ph) as u64).sum();
            let h = plan.hops_of(way, o);
            for t in 0..h {
                fwd[way.step(o, t, p)].send(b * rows * 2 * d * e);
            }
            for t in 1..=h {
                // The holder at step t sends dk/dv on (t < h) or home (t == h).
                bwd_extra[way.step(o, t, p)].send(b * rows * 2 * d * 4);
            }
        }
    }
    if backward {
        let twice =
            |f: &Traffic, x: &Traffic| Traffic { bytes: 2 * f.bytes + x.bytes, messages: 2 * f.messages + x.messages };
        fwd.iter().zip(&bwd_extra).map(|(f, x)| twice(f, x)).collect()
    } else if plan.ring_heads.is_empty() {
        direct
    } else {
        fwd
    }
}

/// The buffers one rank's forward holds at its peak, beyond the caller's tensors (q, k,
/// v, out, lse), charged to the rank that allocated them (a message counts against its
/// sender until its last receiver drops it), without kernel scratch and bookkeeping
/// (bounded by [`Plan::workspace_bytes`], not proportional to the sequence):
/// - with ring patterns: the f32 accumulators of every (batch, head), `B*L*H*(D+1)*4`;
///   this rank's own ring message (`9 + B*rows*2*D*e`, alive while it travels); one
///   visiting block at a time, decoded whole when it is passed on (`B*rows*2*D*e`),
///   at its last hop read from the message one (batch, pair) at a time
///   (`rows_pair*2*D*e`), plus 8 bytes per position; the kernel's f32 packing of one
///   call's keys and values (`2*K*D*4`, `K` the larger of `L` and a visiting part,
///   whole tiles of 64 rows); every
///   all-gather message it sends and every received one decoded;
/// - without ring patterns (the direct all-gather forward): f32 partials `(o, lse)` for
///   the selected query rows that see remote keys, `B*rows*(D+1)*4`, and this rank's
///   pieces (`R` rows of one pair each, an eighth of the smallest one-pair message
///   clamped to 128..=1024, `B*R*2*D*e`) of three rounds: the next one (posted before the current one is
///   attended), the current one and the previous one (its receiver may be one round
///   behind); a
///   received piece is dropped as soon as it is attended; after the completion round
///   one row chunk's f32 `(o, lse)` (`min(512, rows)*(D+1)*4`) and the kernel's f32
///   copy of one call's own keys and values (`min(1024, rows)*2*D16*4`).
///
/// Plain ring attention (one pattern, `w >= n`, `r = 1`, strategy ring, `L = n/p`
/// rows): `B*L*H*(D+1)*4 + (9 + B*L*H*2*D*e) + (B*L*H*2*D*e + 8*L*H) + 2*L*D*4` for
/// p >= 3, about `(4 + 4e) * B*L*H*D` (at p = 2 the visitor is at its last hop: `L*2*D*e +
/// 8*L*H` instead of the decoded block); all-gather (auto at p = 2): `B*L*H*(D+1)*4 + 3*B*R*2*D*e + min(512, L)*(D+1)*4 +
/// min(1024, L)*2*D16*4` (partials, three rounds of sent pieces of `R = clamp(L/8, 128, 1024)` rows, one row
/// chunk, one kernel call's f32 keys and values; `D16` = D rounded up to 16). Both proportional to `n/p`; `attn-reliability`'s `full_attention_memory`
/// test measures them.
pub fn forward_buffer_bytes(plan: &Plan, dtype: DType, rank: usize) -> u64 {
    let RingProblem { batch, heads, head_dim: d, world: p, seq: n, layout, .. } = plan.problem;
    let (b, h, d, e) = (batch as u64, heads as u64, d as u64, dtype.size() as u64);
    if rank >= p {
        return 0;
    }
    let rows = layout.rows(n, p, rank) as u64;
    if plan.ring_heads.is_empty() {
        // This rank's pieces of the next, the current and the previous round (posted
        // one round ahead; a receiver may be one round behind).
        let sent: u64 = (0..p)
            .filter(|&x| x != rank)
            .map(|x| {
                crate::plan::pieces::pieces(plan, rank, x).iter().take(3).map(|(_, rg)| rg.len() as u64).sum::<u64>()
            })
            .sum();
        // After the completion round: one chunk's f32 (o, lse) and the kernel's f32 copy of
        // one call's own keys and values (head dim rounded up to 16).
        let chunk = (crate::plan::pieces::ROW_CHUNK as u64).min(rows) * (d + 1) * 4;
        let keys = (crate::plan::pieces::KEY_ROWS_PER_CALL as u64).min(rows) * 2 * d.next_multiple_of(16) * 4;
        return crate::plan::pieces::partial_rows(plan, rank) * b * (d + 1) * 4 + sent * b * 2 * d * e + chunk + keys;
    }
    let ring_rows =
        |way: Way, o: usize| -> u64 { plan.ring_heads.iter().map(|ph| plan.ring_count(way, o, ph) as u64).sum() };
    let mut total = b * rows * h * (d + 1) * 4;
    for way in Way::BOTH.into_iter().filter(|&w| plan.hops_of(w, rank) >= 1) {
        total += MSG_HEADER_BYTES + b * ring_rows(way, rank) * 2 * d * e;
    }
    // A block passed on is decoded whole; at its last hop one (batch, pair) at a time. The
    // blocks arriving from both ways at one step are handled one after the other.
    let part =
        |way: Way, o: usize| plan.ring_heads.iter().map(|ph| plan.ring_count(way, o, ph) as u64).max().unwrap_or(0);
    let visitors = |way: Way| {
        (1..=plan.ring_steps())
            .map(move |t| way.owner_at(rank, t, p))
            .filter(move |&o| o != rank && plan.ring_visits(way, o, rank) && plan.ring_need(o, rank))
    };
    let visiting = Way::BOTH
        .into_iter()
        .flat_map(|way| {
            visitors(way).map(move |o| {
                if plan.hops_of(way, o) > way.distance(o, rank, p) {
                    b * ring_rows(way, o) * 2 * d * e + 8 * ring_rows(way, o)
                } else {
                    part(way, o) * 2 * d * e + 8 * ring_rows(way, o)
                }
            })
        })
        .max()
        .unwrap_or(0);
    total += visiting;
    // The block kernel packs one call's keys and values as f32 (whole key tiles of
    // FORWARD_KEY_TILE rows, D rounded up to 16), and forward_core calls it with all own rows or a whole
    // visiting part: kept as per-thread scratch.
    let k_rows = Way::BOTH.into_iter().flat_map(|way| visitors(way).map(move |o| part(way, o))).fold(rows, u64::max);
    let tile = attn_kernels::FORWARD_KEY_TILE as u64;
    total += 2 * k_rows.div_ceil(tile) * tile * d.next_multiple_of(16) * 4;
    for x in (0..p).filter(|&x| x != rank) {
        let out: u64 = plan.gather_heads.iter().map(|ph| plan.gather_count(rank, x, ph) as u64).sum();
        let inc: u64 = plan.gather_heads.iter().map(|ph| plan.gather_count(x, rank, ph) as u64).sum();
        if plan.gather_need(rank, x) {
            total += MSG_HEADER_BYTES + b * out * 2 * d * e;
        }
        if plan.gather_need(x, rank) {
            total += b * inc * 2 * d * e + 8 * inc;
        }
    }
    total
}

/// The bytes of [`heads_traffic`], per rank.
pub fn heads_bytes(problem: &RingProblem, split: &HeadSplit, dtype: DType, pass: Pass) -> Vec<u64> {
    heads_traffic(problem, split, dtype, pass).into_iter().map(|t| t.bytes).collect()
}

/// Payload bytes and messages each rank sends in one Ulysses or hybrid call (the head
/// strategies' [`expected_traffic`]), with `L_m` member `m`'s rows, `m_j`/`k_j` slot `j`'s query
/// and key/value heads, `N_g` group `g`'s rows, `D` the head dim and `e` the element size;
/// every message carries a [`MSG_HEADER_BYTES`] header and nothing travels to itself.
/// Forward: to each other member `m` of its group, rank `r` (slot `j`) sends its rows of
/// `m`'s slot, `B*L_r*(m_m + 2k_m)*D*e` (q, k, v), then `m`'s rows of its own slot's out and
/// lse, `B*L_m*m_j*(D*e + 4)`; around the ring of its slot over the `G` groups, at steps
/// `t = 1..G` the k/v of group `g - t + 1`, `B*N*2k_j*D*e`. Backward: the first all-to-all
/// adds grad_out and the f32 gradient into the LSE (`B*L_r*m_m*(D*e + 4)`, zeros when none
/// is given); the ring runs twice (the forward recomputed, then each block with its f32
/// dk/dv, `B*N*2k_j*D*(e + 4)`), and a last step takes group `g + 1`'s dk/dv home
/// (`B*N_(g+1)*2k_j*D*4`); the second all-to-all carries f32 dq, dk, dv
/// (`B*L_m*(m_j + 2k_j)*D*4`). Handshake and completion are not counted.
pub fn heads_traffic(problem: &RingProblem, split: &HeadSplit, dtype: DType, pass: Pass) -> Vec<Traffic> {
    let backward = pass == Pass::Backward;
    let RingProblem { batch, head_dim, seq: n, world: p, layout, .. } = *problem;
    let (b, d, e) = (batch as u64, head_dim as u64, dtype.size() as u64);
    let rows = |m: usize| layout.rows(n, p, m) as u64;
    let group_rows = |g: usize| split.group_rows(layout, n, g) as u64;
    let (heads, kv) = (|j: usize| split.slot_heads(j).len() as u64, |j: usize| split.slot_kv(j).len() as u64);
    (0..p)
        .map(|r| {
            let (g, j) = (split.group_of(r), split.slot_of(r));
            let mut sent = Traffic::default();
            for m in split.members(g).filter(|&m| m != r) {
                let jm = split.slot_of(m);
                let grad_in = if backward { b * rows(r) * heads(jm) * (d * e + 4) } else { 0 };
                sent.send(b * rows(r) * (heads(jm) + 2 * kv(jm)) * d * e + grad_in);
                if backward {
                    sent.send(b * rows(m) * (heads(j) + 2 * kv(j)) * d * 4);
                } else {
                    sent.send(b * rows(m) * heads(j) * (d * e + 4));
                }
            }
            // The ring over the groups: at step t (1..G) this rank passes on the block of
            // group g - t + 1 (every group but g + 1), in the backward twice (the forward
            // recomputed, then with its f32 dk/dv), and last sends the dk/dv of group g + 1 home.
            let groups = split.groups;
            for t in 1..groups {
                let held = group_rows((g + groups + 1 - t) % groups);
                sent.send(b * held * 2 * kv(j) * d * e);
                if backward {
                    sent.send(b * held * 2 * kv(j) * d * (e + 4));
                }
            }
            if backward && groups > 1 {
                sent.send(b * group_rows((g + 1) % groups) * 2 * kv(j) * d * 4);
            }
            sent
        })
        .collect()
}
