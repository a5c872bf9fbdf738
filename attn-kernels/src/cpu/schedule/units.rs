//! Work units of the CPU backend: the fixed decomposition of a call into `(lane, head,
//! position range)` units, chosen from the shape (and the packed sequence lengths)
//! only, never the thread count. A lane is one sequence: a batch row, or one packed
//! sequence of a `cu_seqlens` batch; positions inside a lane start at 0.

use attn_core::{Band, BlockMask, DilatedConfig, Element, HeadGroups, HeadPatterns, KeyPadding, Mixing, TensorView};

use crate::cpu::isa::Isa;
use crate::cpu::isa::ops::QUERY_CHUNK;
use crate::cpu::schedule::block_split::HeadBlocks;

/// One sequence of a call: rows `base..base + q_len` of batch row `b` (keys
/// `base..base + kv_len`); positions inside the lane are relative to `base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lane {
    pub b: usize,
    pub base: usize,
    pub q_len: usize,
    pub kv_len: usize,
}

/// One work unit: lane-relative rows `c0..c1` of head `h` of a lane. `h` is a query
/// head (forward, dq) or a key/value head (dk/dv, fused backward: the unit runs every
/// query head that reads it).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unit {
    pub lane: Lane,
    pub h: usize,
    pub c0: usize,
    pub c1: usize,
}

/// Everything a unit needs to read, shared by all units of a call.
pub(crate) struct Plan<'a, T> {
    pub isa: Isa,
    pub band: Band,
    pub scale: f32,
    pub d: usize,
    /// Every query head's patterns.
    pub heads: Vec<HeadPatterns>,
    /// Query heads per key/value head (1 without grouped heads).
    pub group: usize,
    pub q: TensorView<'a, T>,
    pub k: TensorView<'a, T>,
    pub v: TensorView<'a, T>,
    pub padding: Option<KeyPadding<'a>>,
    /// The block mask, indexed by lane-relative positions.
    pub blocks: Option<BlockMask<'a>>,
}

impl<T: Element> Plan<'_, T> {
    /// Whether key `p` of `lane` is padding.
    #[inline]
    pub fn is_padding(&self, lane: Lane, p: usize) -> bool {
        self.padding.is_some_and(|m| m.is_padding(lane.b, lane.base + p))
    }

    /// The block mask of query head `h` in `lane`, if the call has one.
    #[inline]
    pub fn head_blocks(&self, lane: Lane, h: usize) -> Option<HeadBlocks<'_>> {
        self.blocks.map(|m| HeadBlocks::new(m, lane.b, h))
    }
}

/// The lanes of a call: one per batch row, or one per packed sequence (`cu_seqlens`).
pub(crate) fn lanes(batch: usize, q_seq: usize, kv_seq: usize, packed: Option<&[usize]>) -> Vec<Lane> {
    match packed {
        Some(cu) => cu.windows(2).map(|w| Lane { b: 0, base: w[0], q_len: w[1] - w[0], kv_len: w[1] - w[0] }).collect(),
        None => (0..batch).map(|b| Lane { b, base: 0, q_len: q_seq, kv_len: kv_seq }).collect(),
    }
}

/// The longest lane (positions), for unit lengths and size bounds.
pub(crate) fn longest(lanes: &[Lane]) -> usize {
    lanes.iter().map(|l| l.q_len.max(l.kv_len)).max().unwrap_or(0)
}

/// Rows per work unit of the split backward: about `8 * QUERY_CHUNK` selected rows per
/// pattern (each unit packs all keys, or all queries, of its segments once, so longer
/// units repack less), smaller when that would leave fewer than 16 units. Depends on
/// the shape only (never the thread count).
pub(crate) fn chunk_len(cfg: &DilatedConfig, lanes: usize, heads: usize, seq: usize) -> usize {
    let max_r = cfg.dilation_rates().iter().copied().max().unwrap_or(1);
    let mut ch = (8 * QUERY_CHUNK).saturating_mul(max_r).clamp(1, seq.max(1));
    while ch > 64 && lanes * heads * seq.div_ceil(ch) < 16 {
        ch = ch.div_ceil(2);
    }
    ch
}

/// Selected rows per pattern a forward unit aims at: a unit packs the keys and values of
/// each of its segments once, so longer units pack less often.
const FORWARD_ROWS: usize = 2048;

/// Rows per forward work unit of each head: `FORWARD_ROWS` selected rows of the head's
/// sparsest pattern, halved while the call would have fewer than 16 units. Depends on
/// the shape only (never the thread count); per-row results do not depend on it either
/// (every row walks the same key tiles in the same order).
pub(crate) fn forward_chunk_lens(cfg: &DilatedConfig, lanes: usize, heads: usize, seq: usize) -> Vec<usize> {
    let mut lens: Vec<usize> = (0..heads).map(|h| forward_len(cfg, heads, h, seq)).collect();
    let count = |lens: &[usize]| lens.iter().map(|&l| lanes.saturating_mul(seq.div_ceil(l))).sum::<usize>();
    while count(&lens) < 16 && lens.iter().any(|&l| l > 64) {
        lens.iter_mut().filter(|l| **l > 64).for_each(|l| *l = l.div_ceil(2));
    }
    lens
}

/// Head `h`'s forward unit length before any halving.
fn forward_len(cfg: &DilatedConfig, heads: usize, h: usize, seq: usize) -> usize {
    let max_r = cfg.head_patterns(heads, h).patterns.iter().map(|(_, p)| p.r).max().unwrap_or(1);
    FORWARD_ROWS.saturating_mul(max_r).clamp(1, seq.max(1))
}

/// The longest of [`forward_chunk_lens`], in O(patterns) from 16 `(lane, head)` pairs
/// on (each gives at least one unit, so nothing is halved): for size queries, where
/// `heads` comes from the caller and may be absurd.
pub(crate) fn max_forward_chunk_len(cfg: &DilatedConfig, lanes: usize, heads: usize, seq: usize) -> usize {
    if lanes.saturating_mul(heads) < 16 {
        return forward_chunk_lens(cfg, lanes, heads, seq).into_iter().max().unwrap_or(0);
    }
    head_kinds(cfg, heads).map(|h| forward_len(cfg, heads, h, seq)).max().unwrap_or(0)
}

/// The first head of each head group (LongNet and windows: head 0, every head runs
/// every pattern): all heads of a group run patterns with the same segment lengths and
/// rates, the only things unit lengths depend on, so these heads stand for all `heads`.
fn head_kinds(cfg: &DilatedConfig, heads: usize) -> impl Iterator<Item = usize> {
    let groups = match cfg.mixing() {
        Mixing::LongNet | Mixing::Window => 1,
        Mixing::HeadGroups => cfg.num_patterns(),
    };
    let split = HeadGroups::new(heads, groups);
    (0..groups).map(move |g| split.range(g)).filter(|r| !r.is_empty()).map(|r| r.start)
}

/// Forward work units: rows `c0..c1` of each (lane, query head) in runs of the head's length.
pub(crate) fn forward_units(lanes: &[Lane], lens: &[usize]) -> Vec<Unit> {
    let mut out = Vec::new();
    for &lane in lanes {
        for (h, &len) in lens.iter().enumerate() {
            for c0 in (0..lane.q_len).step_by(len) {
                out.push(Unit { lane, h, c0, c1: (c0 + len).min(lane.q_len) });
            }
        }
    }
    out
}

/// Largest segment (selected rows) the fused backward takes; bigger ones use the
/// two-kernel backward (bounded per-worker memory either way; the fused one holds
/// three unit-sized f32 accumulators more). Fused computes the scores once instead of
/// twice.
const FUSED_MAX_ROWS: usize = 16384;
/// Longest fused unit (positions): the LCM of a head's segment lengths must fit.
pub(crate) const FUSED_MAX_UNIT: usize = 16384;

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Units for the fused backward: per (lane, key/value head), runs of `L = lcm(w_i)`
/// positions over the patterns of every query head reading that key/value head, so
/// every segment of every pattern lies inside one unit and the unit owns all rows its
/// queries and keys touch. Used for self-attention when segments have at most
/// `FUSED_MAX_ROWS` selected rows, `L <= FUSED_MAX_UNIT` and there are at least 8
/// units: a shape-only rule, so the choice never depends on the thread count.
pub(crate) fn fused_units<T: Element>(plan: &Plan<'_, T>, lanes: &[Lane]) -> Option<Vec<Unit>> {
    if lanes.iter().any(|l| l.q_len != l.kv_len) {
        return None;
    }
    let mut out = Vec::new();
    for hk in 0..plan.heads.len() / plan.group {
        let seq = longest(lanes);
        let mut len = 1;
        for hp in &plan.heads[hk * plan.group..(hk + 1) * plan.group] {
            len = lcm_capped(len, head_unit_len(hp, seq)?)?;
        }
        for &lane in lanes {
            let len = len.min(lane.q_len);
            for c0 in (0..lane.q_len).step_by(len) {
                out.push(Unit { lane, h: hk, c0, c1: (c0 + len).min(lane.q_len) });
            }
        }
    }
    (out.len() >= 8).then_some(out)
}

fn lcm_capped(a: usize, b: usize) -> Option<usize> {
    (a / gcd(a, b)).checked_mul(b).filter(|&l| l <= FUSED_MAX_UNIT)
}

/// `lcm` of the head's segment lengths, if the head qualifies for the fused backward.
fn head_unit_len(hp: &HeadPatterns, seq: usize) -> Option<usize> {
    let mut len = 1usize;
    for (_, p) in &hp.patterns {
        if p.w.min(seq).div_ceil(p.r) > FUSED_MAX_ROWS {
            return None;
        }
        len = lcm_capped(len, p.w)?;
    }
    Some(len.min(seq.max(1)))
}

/// The longest fused unit of any head (`None` if the fused backward is not used); with
/// grouped heads a unit covers its group's heads, whose lengths' lcm is at most their
/// product, bounded by `FUSED_MAX_UNIT`.
pub(crate) fn fused_unit_len(cfg: &DilatedConfig, heads: usize, seq: usize) -> Option<usize> {
    head_kinds(cfg, heads).map(|h| head_unit_len(&cfg.head_patterns(heads, h), seq)).try_fold(0, |m, l| Some(m.max(l?)))
}

/// Split-backward units of rows `c0..c1` for each (lane, head) of `heads` heads, over the
/// lane's queries (`keys == false`) or keys.
pub(crate) fn split_units(lanes: &[Lane], heads: usize, ch: usize, side: Side) -> Vec<Unit> {
    let mut out = Vec::new();
    for &lane in lanes {
        let n = match side {
            Side::Queries => lane.q_len,
            Side::Keys => lane.kv_len,
        };
        for h in 0..heads {
            for c0 in (0..n).step_by(ch) {
                out.push(Unit { lane, h, c0, c1: (c0 + ch).min(n) });
            }
        }
    }
    out
}

/// Which rows of a lane split-backward units cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Queries,
    Keys,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The O(patterns) size helpers equal their per-head definitions.
    #[test]
    fn size_helpers_equal_the_per_head_definitions() {
        for mixing in [Mixing::LongNet, Mixing::HeadGroups] {
            for (segs, rates) in [(&[64, 128, 256][..], &[1, 2, 4][..]), (&[4096, 300], &[8, 3]), (&[20000], &[1])] {
                let cfg = DilatedConfig::builder().segments(segs).dilations(rates).mixing(mixing).build().unwrap();
                for heads in 1..40 {
                    for (batch, seq) in [(1, 1), (1, 700), (3, 5000), (2, 40000)] {
                        let want = forward_chunk_lens(&cfg, batch, heads, seq).into_iter().max();
                        assert_eq!(Some(max_forward_chunk_len(&cfg, batch, heads, seq)), want);
                        let per_head = (0..heads)
                            .map(|h| head_unit_len(&cfg.head_patterns(heads, h), seq))
                            .try_fold(0, |m, l| Some(m.max(l?)));
                        assert_eq!(fused_unit_len(&cfg, heads, seq), per_head, "{segs:?} {heads} {seq}");
                    }
                }
            }
        }
    }

    #[test]
    fn lanes_follow_the_packing() {
        assert_eq!(lanes(2, 5, 7, None)[1], Lane { b: 1, base: 0, q_len: 5, kv_len: 7 });
        let packed = lanes(1, 9, 9, Some(&[0, 2, 9]));
        assert_eq!(packed, [Lane { b: 0, base: 0, q_len: 2, kv_len: 2 }, Lane { b: 0, base: 2, q_len: 7, kv_len: 7 }]);
        assert_eq!(longest(&packed), 7);
    }
}
