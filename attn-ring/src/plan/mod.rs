//! The communication plan every rank derives identically from (config, shape,
//! layout, world, strategy): which pattern uses which strategy, which rows of
//! which owner each rank needs, how far ring blocks travel, and the exact bytes
//! each rank sends (the formula [`expected_bytes`] checks against); for `Strategy::Auto`,
//! whether a head strategy runs instead ([`choose`]).

mod block_reach;
pub mod choose;
mod head_counts;
pub(crate) mod heads_place;
pub mod heads_split;
mod heads_workspace;
pub mod layout;
pub(crate) mod pieces;
pub mod ring_route;
mod traffic;
pub(crate) mod workspace;

use std::collections::HashMap;
use std::ops::Range;

use attn_core::error::TensorName;
use attn_core::{
    AttnError, AttnShape, Band, DilatedConfig, HeadPatterns, Masks, OwnedMasks, PlacedPattern, Result, SegmentPattern,
};

use attn_kernels::block::HeadBlockMask;

use crate::plan::head_counts::PatternHeads;
use crate::plan::layout::Layout;
use crate::plan::ring_route::{Way, route};
pub use crate::plan::traffic::{
    Traffic, expected_bytes, expected_traffic, forward_buffer_bytes, heads_bytes, heads_traffic,
};

/// Strategy override for patterns whose segments span ranks. The chunk ring reads the
/// first three for its whole k/v slices (see [`crate::chunk_ring`]): along the ring, straight
/// to each rank that needs them, or straight where that takes fewer messages (it reads
/// `Ulysses` and `Hybrid` as `Auto`). `Ulysses` and `Hybrid` split heads instead of
/// moving selected rows ([`crate::plan::heads_split`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Strategy {
    /// Per call, the row plan or a head strategy by the cost model of [`choose`]; in the
    /// row plan, per pattern: no traffic when segments sit inside ranks, all-gather when
    /// the selected rows a rank receives are no more than its own rows of the pattern's
    /// heads, ring pass otherwise (e.g. full attention on 3 or more ranks).
    #[default]
    Auto,
    /// Every spanning pattern passes its selected k/v rows from neighbour to neighbour,
    /// each owner's block going the way (or both ways) that reaches the ranks needing it
    /// in the fewest hops.
    Ring,
    /// Every spanning pattern sends its selected rows straight to the ranks that need them.
    AllGather,
    /// Head all-to-all (DeepSpeed-Ulysses) over all ranks: each rank attends whole
    /// sequences for its share of the heads, then the outputs return to sequence shards.
    /// Where no query reaches another rank's keys (every segment inside a rank's rows) the
    /// call is segment-local and sends nothing, as every strategy's is.
    Ulysses,
    /// Ulysses inside groups of `ulysses` consecutive ranks (`ulysses` divides the world),
    /// the groups joined by a ring: a rank attends its group's rows for its share of the
    /// heads against each group's keys in turn, passed around the ranks of its head slot.
    /// Segment-local where nothing crosses ranks, as `Ulysses`.
    Hybrid { ulysses: usize },
}

impl Strategy {
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Auto => "auto",
            Strategy::Ring => "ring",
            Strategy::AllGather => "allgather",
            Strategy::Ulysses => "ulysses",
            Strategy::Hybrid { .. } => "hybrid",
        }
    }

    /// The name with the Ulysses degree of a hybrid (`hybrid:4`): what ranks must agree on.
    pub fn label(self) -> String {
        match self {
            Strategy::Hybrid { ulysses } => format!("hybrid:{ulysses}"),
            s => s.as_str().to_owned(),
        }
    }

    /// The Ulysses degree `U` in a world of `world` ranks (`None` for the row strategies).
    pub fn ulysses_degree(self, world: usize) -> Option<usize> {
        match self {
            Strategy::Ulysses => Some(world),
            Strategy::Hybrid { ulysses } => Some(ulysses),
            _ => None,
        }
    }

    /// Parse `auto` / `ring` / `allgather` / `ulysses` / `hybrid:U`.
    pub fn parse(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        if let Some(u) = lower.strip_prefix("hybrid:").or_else(|| lower.strip_prefix("hybrid=")) {
            let ulysses = u.parse().map_err(|_| {
                AttnError::InvalidArgument(format!("strategy `{s}`: the Ulysses degree `{u}` is not a number"))
            })?;
            return Ok(Strategy::Hybrid { ulysses });
        }
        match lower.replace(['-', '_'], "").as_str() {
            "auto" => Ok(Strategy::Auto),
            "ring" => Ok(Strategy::Ring),
            "allgather" => Ok(Strategy::AllGather),
            "ulysses" => Ok(Strategy::Ulysses),
            "hybrid" => Err(AttnError::InvalidArgument(format!(
                "strategy `{s}` needs its Ulysses degree: hybrid:U, U dividing the world size"
            ))),
            _ => Err(AttnError::InvalidArgument(format!(
                "unknown strategy `{s}` (auto|ring|allgather|ulysses|hybrid:U)"
            ))),
        }
    }
}

/// What one pattern does across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PatternStrategy {
    /// Segments never span ranks: no traffic.
    Local,
    /// Selected rows of spanning segments travel from neighbour to neighbour.
    Ring,
    /// Selected rows go directly to each rank that needs them.
    AllGather,
}

/// The whole distributed problem, identical on every rank.
#[derive(Debug, Clone, PartialEq)]
pub struct RingProblem {
    pub cfg: DilatedConfig,
    /// Global sequence length.
    pub seq: usize,
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`; fewer for grouped-query attention).
    pub kv_heads: usize,
    pub head_dim: usize,
    pub layout: Layout,
    pub strategy: Strategy,
    pub world: usize,
    /// Key padding (`[batch, seq]`), packed sequences and the block mask over the GLOBAL
    /// positions, the same on every rank.
    pub masks: OwnedMasks,
}

impl RingProblem {
    /// The problem for global shapes `shape` (k and v may have fewer heads), no masks.
    pub fn new(cfg: &DilatedConfig, shape: AttnShape, layout: Layout, strategy: Strategy, world: usize) -> Self {
        RingProblem {
            cfg: cfg.clone(),
            seq: shape.q.seq,
            batch: shape.q.batch,
            heads: shape.q.heads,
            kv_heads: shape.kv.heads,
            head_dim: shape.q.head_dim,
            layout,
            strategy,
            world,
            masks: OwnedMasks::none(),
        }
    }

    /// The same problem with `masks`.
    pub fn with_masks(mut self, masks: OwnedMasks) -> Self {
        self.masks = masks;
        self
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// The masks as `attn_core` views, the key padding checked to be `[batch, seq]`.
    pub fn core_masks(&self) -> Result<Masks<'_>> {
        let masks = self.masks.view();
        if let Some(k) = masks.key_padding
            && (k.batch(), k.seq()) != (self.batch, self.seq)
        {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::KeyPaddingMask,
                expected: vec![self.batch, self.seq],
                got: vec![k.batch(), k.seq()],
            });
        }
        Ok(masks)
    }

    /// The key padding of batch row `b`, by global position.
    pub(crate) fn padding_row(&self, b: usize) -> Option<&[bool]> {
        self.masks.key_padding().map(|k| k.view().row(b))
    }

    /// The block mask of batch row `b` and query head `h`, if any.
    pub(crate) fn block_row(&self, b: usize, h: usize) -> Option<HeadBlockMask<'_>> {
        self.masks.block_mask().map(|m| HeadBlockMask { mask: m.view(), batch: b, head: h })
    }
}

/// One (pattern, head) pair: the head's pattern with its offset. In the plan's wire
/// lists ([`Plan::ring_heads`], [`Plan::gather_heads`]) `head` is a key/value head: its
/// selected rows travel once, whatever number of query heads read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PatternHead {
    pub pattern: usize,
    pub head: usize,
    pub pat: SegmentPattern,
}

/// The derived plan.
#[derive(Debug, Clone)]
pub struct Plan {
    pub problem: RingProblem,
    pub strategies: Vec<PatternStrategy>,
    /// `need[i][o][r]`: rank `r` has queries that attend rows of owner `o` under pattern `i`.
    need: Vec<Vec<Vec<bool>>>,
    /// `hops[w][o]`: how many ring steps owner `o`'s block travels going way `w`
    /// ([`Way::index`]).
    pub hops: [Vec<usize>; 2],
    /// `ring_regions[w][i][o]`: the global ranges of `o`'s rows that travel way `w` for
    /// pattern `i`.
    ring_regions: [Vec<Vec<Vec<Range<usize>>>>; 2],
    /// Ring and all-gather (pattern, key/value head) pairs, in wire order.
    pub ring_heads: Vec<PatternHead>,
    pub gather_heads: Vec<PatternHead>,
    /// Every query head's patterns.
    pub(crate) query_patterns: Vec<HeadPatterns>,
    /// Under a block mask, the key ranges each owner sends per wire pair (narrower than
    /// `ring_regions` and the all-gather regions; [`Plan::masked_ranges`]).
    block_reach: Option<MaskedRanges>,
    /// Key rows per piece of the direct all-gather forward, computed on first use
    /// (`Plan::piece_rows`, in `pieces`).
    pub(crate) piece_rows_once: std::sync::OnceLock<usize>,
    /// The head split the call runs (Ulysses, hybrid, or `Auto`'s pick), if any, decided
    /// on first use (`Plan::head_split`, in `choose`).
    pub(crate) head_split_once: std::sync::OnceLock<Option<heads_split::HeadSplit>>,
}

/// Under a block mask, the global key ranges each owner sends per wire pair: per (way
/// index, owner, pair) for the ring pairs, per (owner, receiver, pair) for the all-gather
/// pairs (filled by [`Plan::masked_ranges`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct MaskedRanges {
    pub(crate) ring: HashMap<(usize, usize, PatternHead), Vec<Range<usize>>>,
    pub(crate) gather: HashMap<(usize, usize, PatternHead), Vec<Range<usize>>>,
}

/// Positions of range `a` (owner) that share a segment (of `seg`'s pattern, in the
/// same packed sequence) with some position of range `b` (receiver) and lie within
/// `band`'s reach of `b`'s queries: the keys `b` may need (causal: none after `b`).
fn shared_region(a: &Range<usize>, b: &Range<usize>, seg: &PlacedPattern<'_>, band: Band) -> Option<Range<usize>> {
    let span = seg.segment_span(b.start).start..seg.segment_span(b.end - 1).end;
    let reach = band.keys_of_queries(b.start, b.end - 1);
    let (lo, hi) = (a.start.max(span.start).max(reach.start), a.end.min(span.end).min(reach.end));
    (lo < hi).then_some(lo..hi)
}

fn merge_ranges(mut v: Vec<Range<usize>>) -> Vec<Range<usize>> {
    v.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::new();
    for r in v {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

impl Plan {
    /// Every head's patterns (and `out_scale`), in head order.
    pub(crate) fn head_patterns(&self) -> Vec<HeadPatterns> {
        self.query_patterns.clone()
    }

    /// Every head's `out_scale` as f32, in head order.
    pub(crate) fn out_scales(&self) -> Vec<f32> {
        self.query_patterns.iter().map(|hp| hp.out_scale as f32).collect()
    }

    /// Whether query head `h` reads the wire pair `ph` (its key/value head, one of its
    /// patterns at the same offset).
    pub(crate) fn reads(&self, h: usize, ph: &PatternHead) -> bool {
        h / self.problem.group() == ph.head
            && self.query_patterns[h].patterns.iter().any(|&(i, pat)| i == ph.pattern && pat == ph.pat)
    }

    /// Derive the plan; fails on an invalid config, shape or layout.
    pub fn new(problem: RingProblem) -> Result<Self> {
        let RingProblem { ref cfg, seq: n, heads, kv_heads, layout, strategy, world: p, .. } = problem;
        let shape = attn_core::Shape4::new(problem.batch, n, heads, problem.head_dim)?;
        let kv_shape =
            attn_core::Shape4::named(attn_core::TensorName::Key, [problem.batch, n, kv_heads, problem.head_dim])?;
        let attn_shape = AttnShape::check(&shape.dims(), &kv_shape.dims(), &kv_shape.dims())?;
        cfg.validate_heads(heads)?;
        problem.core_masks()?.check(&attn_shape)?;

        if p > MAX_WORLD {
            return Err(AttnError::InvalidArgument(format!(
                "world of {p} ranks: at most {MAX_WORLD} are supported (the plan's tables grow as world^2)"
            )));
        }
        layout.check(n, p)?;
        if let Some(u) = strategy.ulysses_degree(p) {
            heads_split::HeadSplit::new(heads, kv_heads, u, p)?;
        }
        let g = cfg.num_patterns();
        if heads.saturating_mul(g) > MAX_PAIRS {
            return Err(AttnError::InvalidArgument(format!(
                "{heads} heads x {g} patterns: at most {MAX_PAIRS} (pattern, head) pairs are supported (the plan lists each)"
            )));
        }
        // Every byte figure the plan reports (`expected_bytes`, `workspace_bytes`,
        // `io_bytes`, `forward_buffer_bytes`) is below `BYTES_BOUND` times elements x
        // patterns x world; refuse a problem where that leaves u64 (exabytes) instead of
        // letting those figures wrap.
        let bound = shape.numel() as u128 * g.max(1) as u128 * p.max(1) as u128 * BYTES_BOUND;
        if bound > u64::MAX as u128 {
            return Err(AttnError::ShapeOverflow {
                tensor: attn_core::TensorName::Other("ring problem (elements x patterns x world)"),
                dims: vec![problem.batch, n, heads, problem.head_dim, g, p],
            });
        }
        let ranges: Vec<Vec<Range<usize>>> = (0..p).map(|r| layout.ranges(n, p, r)).collect();
        let mut need = vec![vec![vec![false; p]; p]; g];
        // Selected rows each pattern's heads would receive by all-gather, and the rank's own
        // rows of those heads (counted per pattern in O(1), never per head).
        let pattern_heads: Vec<PatternHeads> = (0..g).map(|i| PatternHeads::new(cfg, heads, i)).collect();
        let mut gathered = vec![vec![0usize; p]; g];
        let mut own = vec![vec![0usize; p]; g];
        let packing = problem.core_masks()?.packing;
        for i in 0..g {
            let seg = PlacedPattern { pat: cfg.pattern(i, 0), packing, n };
            for o in 0..p {
                for r in (0..p).filter(|&r| r != o) {
                    for a in &ranges[o] {
                        for b in &ranges[r] {
                            if let Some(reg) = shared_region(a, b, &seg, cfg.band()) {
                                need[i][o][r] = true;
                                gathered[i][r] += pattern_heads[i].selected_placed(reg, packing);
                            }
                        }
                    }
                }
            }
        }
        let query_patterns: Vec<HeadPatterns> = (0..heads).map(|head| cfg.head_patterns(heads, head)).collect();
        Plan::mask_need(&problem, &query_patterns, &mut need);
        for (i, ph) in pattern_heads.iter().enumerate() {
            for (r, rows) in own[i].iter_mut().enumerate() {
                *rows = ph.heads() * layout.rows(n, p, r);
            }
        }
        let strategies: Vec<PatternStrategy> = (0..g)
            .map(|i| {
                if !need[i].iter().flatten().any(|&x| x) {
                    PatternStrategy::Local
                } else {
                    match strategy {
                        Strategy::Ring => PatternStrategy::Ring,
                        // The head strategies move no selected rows; their plan tables are
                        // those of the all-gather (unused by their compute).
                        Strategy::AllGather | Strategy::Ulysses | Strategy::Hybrid { .. } => PatternStrategy::AllGather,
                        // All-gather while the rows a rank receives for the pattern fit in the
                        // rank's own rows of the pattern's heads (per-rank memory stays O(n/p)).
                        Strategy::Auto if (0..p).all(|r| gathered[i][r] <= own[i][r].max(1)) => {
                            PatternStrategy::AllGather
                        }
                        Strategy::Auto => PatternStrategy::Ring,
                    }
                }
            })
            .collect();
        // Each owner's ring receivers split between the two ways; the rows going each way
        // are those its receivers on that way share with the owner.
        let mut hops = [vec![0usize; p], vec![0usize; p]];
        let mut ring_regions = [vec![vec![Vec::new(); p]; g], vec![vec![Vec::new(); p]; g]];
        let ring_patterns: Vec<usize> = (0..g).filter(|&i| strategies[i] == PatternStrategy::Ring).collect();
        for o in 0..p {
            let mut dists: Vec<usize> = (0..p)
                .filter(|&r| ring_patterns.iter().any(|&i| need[i][o][r]))
                .map(|r| Way::Next.distance(o, r, p))
                .collect();
            dists.sort_unstable();
            let rt = route(&dists, p);
            for way in Way::BOTH {
                hops[way.index()][o] = rt.hops(way);
            }
            for &i in &ring_patterns {
                let seg = PlacedPattern { pat: cfg.pattern(i, 0), packing, n };
                let mut regs = [Vec::new(), Vec::new()];
                for r in (0..p).filter(|&r| need[i][o][r]) {
                    let w = rt.way_of(Way::Next.distance(o, r, p)).index();
                    for a in &ranges[o] {
                        regs[w].extend(ranges[r].iter().filter_map(|b| shared_region(a, b, &seg, cfg.band())));
                    }
                }
                for (w, v) in regs.into_iter().enumerate() {
                    ring_regions[w][i][o] = merge_ranges(v);
                }
            }
        }
        // Wire pairs: each (pattern, key/value head, offset) once, in first-use order.
        let group = problem.group();
        let mut ring_heads = Vec::new();
        let mut gather_heads = Vec::new();
        let mut listed = std::collections::HashSet::new();
        for (head, hp) in query_patterns.iter().enumerate() {
            for &(pattern, pat) in &hp.patterns {
                let ph = PatternHead { pattern, head: head / group, pat };
                let list = match strategies[pattern] {
                    PatternStrategy::Ring => &mut ring_heads,
                    PatternStrategy::AllGather => &mut gather_heads,
                    PatternStrategy::Local => continue,
                };
                if listed.insert(ph) {
                    list.push(ph);
                }
            }
        }
        let mut plan = Plan {
            problem,
            strategies,
            need,
            hops,
            ring_regions,
            ring_heads,
            gather_heads,
            query_patterns,
            block_reach: None,
            piece_rows_once: std::sync::OnceLock::new(),
            head_split_once: std::sync::OnceLock::new(),
        };
        plan.block_reach = plan.masked_ranges();
        Ok(plan)
    }

    /// Number of ring steps (the farthest any block travels either way).
    pub fn ring_steps(&self) -> usize {
        self.hops.iter().flatten().copied().max().unwrap_or(0)
    }

    /// How many steps owner `o`'s block travels going `way`.
    pub fn hops_of(&self, way: Way, o: usize) -> usize {
        self.hops[way.index()][o]
    }

    /// Whether owner `o`'s block going `way` visits `rank` (`rank` may only pass it on).
    pub fn ring_visits(&self, way: Way, o: usize, rank: usize) -> bool {
        let t = way.distance(o, rank, self.problem.world);
        t >= 1 && t <= self.hops_of(way, o)
    }

    /// The blocks reaching `rank` at ring step `t`, as (way, owner), in [`Way::BOTH`]
    /// order: from the previous rank going next, from the next rank going back.
    pub fn ring_arrivals(&self, rank: usize, t: usize) -> Vec<(Way, usize)> {
        let p = self.problem.world;
        Way::BOTH
            .into_iter()
            .map(|way| (way, way.owner_at(rank, t, p)))
            .filter(|&(way, owner)| self.ring_visits(way, owner, rank))
            .collect()
    }

    /// Whether rank `r` needs owner `o`'s rows for some ring pattern.
    pub(crate) fn ring_need(&self, o: usize, r: usize) -> bool {
        self.strategies.iter().enumerate().any(|(i, s)| *s == PatternStrategy::Ring && self.need[i][o][r])
    }

    /// Whether rank `r` needs owner `o`'s rows for some all-gather pattern.
    pub(crate) fn gather_need(&self, o: usize, r: usize) -> bool {
        o != r
            && self.strategies.iter().enumerate().any(|(i, s)| *s == PatternStrategy::AllGather && self.need[i][o][r])
    }

    /// `pat` on the global positions (relative to each packed sequence).
    pub(crate) fn placed(&self, pat: SegmentPattern) -> PlacedPattern<'_> {
        let packing = self.problem.masks.view().packing;
        PlacedPattern { pat, packing, n: self.problem.seq }
    }

    /// Global positions of owner `o`'s rows that travel `way` for `ph`.
    pub(crate) fn ring_positions(&self, way: Way, o: usize, ph: &PatternHead) -> Vec<usize> {
        let placed = self.placed(ph.pat);
        self.ring_ranges(way, o, ph).iter().flat_map(|r| placed.selected_in_range(r.clone())).collect()
    }

    /// Global ranges of owner `o`'s rows that travel `way` for `ph` (under a block mask,
    /// only those some receiver's kept blocks reach).
    fn ring_ranges(&self, way: Way, o: usize, ph: &PatternHead) -> &[Range<usize>] {
        match &self.block_reach {
            Some(m) => m.ring.get(&(way.index(), o, *ph)).map_or(&[], Vec::as_slice),
            None => &self.ring_regions[way.index()][ph.pattern][o],
        }
    }

    /// Global ranges of owner `o`'s rows sent straight to `r` for `ph` (under a block
    /// mask, only those `r`'s kept blocks reach).
    pub(crate) fn gather_ranges(&self, o: usize, r: usize, ph: &PatternHead) -> Vec<Range<usize>> {
        match &self.block_reach {
            Some(m) => m.gather.get(&(o, r, *ph)).cloned().unwrap_or_default(),
            None => self.gather_regions(o, r, ph.pattern),
        }
    }

    pub(crate) fn gather_regions(&self, o: usize, r: usize, pattern: usize) -> Vec<Range<usize>> {
        if !self.need[pattern][o][r] {
            return Vec::new();
        }
        let RingProblem { seq: n, layout, world: p, ref cfg, .. } = self.problem;
        let seg = self.placed(cfg.pattern(pattern, 0));
        let (ro, rr) = (layout.ranges(n, p, o), layout.ranges(n, p, r));
        let regs = ro.iter().flat_map(|a| rr.iter().filter_map(|b| shared_region(a, b, &seg, cfg.band()))).collect();
        merge_ranges(regs)
    }

    /// Global positions of owner `o`'s rows sent directly to `r` for all-gather pair `ph`.
    pub(crate) fn gather_positions(&self, o: usize, r: usize, ph: &PatternHead) -> Vec<usize> {
        let placed = self.placed(ph.pat);
        self.gather_ranges(o, r, ph)
            .into_iter()
            .flat_map(|rg| placed.selected_in_range(rg).collect::<Vec<_>>())
            .collect()
    }

    /// Selected rows of wire pair `ph` in owner `o`'s ring block going `way`.
    pub fn ring_count(&self, way: Way, o: usize, ph: &PatternHead) -> usize {
        let placed = self.placed(ph.pat);
        self.ring_ranges(way, o, ph).iter().map(|r| placed.count_in_range(r.clone())).sum()
    }

    /// Selected rows of wire pair `ph` that owner `o` sends straight to rank `r`.
    pub fn gather_count(&self, o: usize, r: usize, ph: &PatternHead) -> usize {
        let placed = self.placed(ph.pat);
        self.gather_ranges(o, r, ph).into_iter().map(|rg| placed.count_in_range(rg)).sum()
    }
}

/// Size of the small header at the front of every data message.
pub const MSG_HEADER_BYTES: u64 = 9;

/// The most ranks a [`Plan`] accepts: its need/count tables hold `patterns * world^2`
/// entries (48 MB for 3 patterns at 4096 ranks).
pub const MAX_WORLD: usize = 4096;

/// The most (pattern, head) pairs a [`Plan`] accepts (it lists each in wire order).
pub const MAX_PAIRS: usize = 1 << 20;

/// A generous multiple of `elements * patterns * world` above every byte figure of a
/// plan. The largest, a backward's `expected_bytes`, stays under 128 times it: a rank
/// sends at most every pattern's rows of its k and v (8-byte elements at most) to each
/// other rank, twice (the forward is recomputed), f32 gradients come back, and each
/// message's 9-byte header covers at least one row.
const BYTES_BOUND: u128 = 1024;
