//! Launch planning for the CUDA kernels: which (pattern, head range, offset) launches a
//! config needs, grid sizes, kernel choice and shared memory. Pure host code, so the
//! selected-index math the kernels use (mirrored here from `prelude.cu`) is unit-tested
//! against `attn_core::SegmentPattern` without a GPU.

use std::ops::Range;

use attn_core::{Causality, DType, DilatedConfig, HeadGroups, Mixing, SegmentPattern, Shape4};

pub use super::choices::{
    BackwardDq, BackwardKeys, BackwardLoads, BackwardMma, BackwardOptions, BackwardQueries, BackwardWrites, ForwardMma,
    ForwardOptions, ForwardRows, ForwardStages, PatternFusion,
};
use super::head_window::HeadWindow;
use super::source::{MMA_BWD_HEAD_DIMS, MMA_HEAD_DIMS, mma_bwd_dq_kernel_name, mma_bwd_kernel_name, mma_kernel_name};

/// Threads per block of the row kernels (4 warps; the tensor-core kernels take theirs from
/// their block shape).
pub const THREADS: u32 = 128;

/// The selected-index view of a pattern, exactly as `prelude.cu` computes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SelectedIndex {
    pub w: usize,
    pub r: usize,
    pub off: usize,
    /// Selected positions per full segment, `ceil((w - off) / r)`.
    pub per_seg: usize,
}

impl SelectedIndex {
    /// Requires `off < r <= w` (true for every pattern a validated config produces).
    pub fn new(p: &SegmentPattern) -> Self {
        SelectedIndex { w: p.w, r: p.r, off: p.off, per_seg: (p.w - p.off).div_ceil(p.r) }
    }
    /// Number of selected positions `< x` (`sel_below`).
    pub fn below(&self, x: usize) -> usize {
        let (full, rem) = (x / self.w, x % self.w);
        let tail = if rem > self.off { (rem - self.off).div_ceil(self.r) } else { 0 };
        full * self.per_seg + tail
    }
    /// Global position of the `t`-th selected position (`sel_pos`).
    pub fn pos(&self, t: usize) -> usize {
        (t / self.per_seg) * self.w + self.off + (t % self.per_seg) * self.r
    }
    /// Selected indices of the rows of a block `[start, start + rows)`.
    pub fn range(&self, start: usize, rows: usize) -> Range<usize> {
        self.below(start)..self.below(start + rows)
    }
    /// The key indices (of a k block) a query index `t` attends, as the kernels bound them.
    pub fn keys_of(&self, t: usize, k_block: Range<usize>, causality: Causality) -> Range<usize> {
        let seg = t / self.per_seg;
        let lo = k_block.start.max(seg * self.per_seg);
        let mut hi = k_block.end.min((seg + 1) * self.per_seg);
        if causality.is_causal() {
            hi = hi.min(t + 1);
        }
        lo..hi.max(lo)
    }
}

/// One kernel launch: pattern `index` on heads `heads`, with a fixed offset
/// (HeadGroups) or `head % r` (LongNet, `fixed_off = None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatternLaunch {
    pub index: usize,
    pub w: usize,
    pub r: usize,
    pub fixed_off: Option<usize>,
    pub heads: Range<usize>,
    /// The global index of local head 0 (a [`HeadWindow`]'s first head; 0 without one):
    /// a LongNet head's offset is its global index mod `r`.
    pub head_base: usize,
}

impl PatternLaunch {
    /// Offsets this launch uses.
    pub fn offsets(&self) -> Vec<usize> {
        match self.fixed_off {
            Some(o) => vec![o],
            None => {
                let mut v: Vec<usize> = self.heads.clone().map(|h| (self.head_base + h) % self.r).collect();
                v.sort_unstable();
                v.dedup();
                v
            }
        }
    }

    /// Largest number of selected rows in `[start, start + rows)` over this launch's heads:
    /// the grid covers it and blocks past a head's own count exit at once.
    pub fn max_selected(&self, start: usize, rows: usize) -> usize {
        self.offsets()
            .into_iter()
            .map(|off| SelectedIndex::new(&SegmentPattern::new(self.w, self.r, off)).range(start, rows).len())
            .max()
            .unwrap_or(0)
    }
}

/// The launches a config needs for `heads` heads (one per pattern; HeadGroups launches
/// only cover the pattern's head group). Order is the pattern order.
pub fn pattern_launches(cfg: &DilatedConfig, heads: usize) -> Vec<PatternLaunch> {
    window_launches(cfg, heads, None)
}

/// [`pattern_launches`] for tensors of `heads` heads that hold `window`'s run of the
/// problem's heads: head ranges local to the tensors, each head in the group of its
/// global index.
pub fn window_launches(cfg: &DilatedConfig, heads: usize, window: Option<&HeadWindow>) -> Vec<PatternLaunch> {
    let g = cfg.num_patterns();
    let (total, base) = window.map_or((heads, 0), |w| (w.heads, w.first));
    (0..g)
        .filter_map(|i| {
            let (w, r) = (cfg.pattern(i, 0).w, cfg.rate(i));
            let (fixed_off, range) = match cfg.mixing() {
                Mixing::HeadGroups => {
                    let global = HeadGroups::new(total, g).range(i);
                    (
                        Some(i % r),
                        global.start.clamp(base, base + heads) - base..global.end.clamp(base, base + heads) - base,
                    )
                }
                Mixing::LongNet => (None, 0..heads),
                Mixing::Window => (Some(0), 0..heads),
            };
            (!range.is_empty()).then_some(PatternLaunch { index: i, w, r, fixed_off, heads: range, head_base: base })
        })
        .collect()
}

/// Heads of one launch as the grid's y axis sees them: `count` heads from `head0`, `step`
/// apart (`AttnParams::head_step`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSweep {
    pub head0: usize,
    pub count: usize,
    pub step: usize,
}

/// The backward's sweeps of a head range when `group` query heads share a key/value
/// head: one sweep per residue mod `group`, so no two blocks of a launch write the same
/// dk/dv rows (the sweeps run one after another: a deterministic group sum).
pub fn head_sweeps(heads: Range<usize>, group: usize) -> Vec<HeadSweep> {
    if group <= 1 {
        return vec![HeadSweep { head0: heads.start, count: heads.len(), step: 1 }];
    }
    (0..group)
        .filter_map(|j| {
            let first = heads.start + (j + group - heads.start % group) % group;
            (first < heads.end).then(|| HeadSweep {
                head0: first,
                count: (heads.end - 1 - first) / group + 1,
                step: group,
            })
        })
        .collect()
}

/// One per-sequence part of a (q block, k block) pair: block rows `q` and `k` of the
/// packed sequence starting at global position `seq_start`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqPiece {
    pub q: Range<usize>,
    pub k: Range<usize>,
    pub seq_start: usize,
}

/// Split a q block at global positions `q` and a k block at `k` by packed sequence
/// (`cu_seqlens`); without packing the whole pair is one piece of the sequence at 0.
pub fn seq_pieces(cu_seqlens: Option<&[usize]>, q: Range<usize>, k: Range<usize>) -> Vec<SeqPiece> {
    let Some(cu) = cu_seqlens else {
        return vec![SeqPiece { q: 0..q.len(), k: 0..k.len(), seq_start: 0 }];
    };
    let first = cu.partition_point(|&c| c <= q.start).saturating_sub(1);
    cu[first..]
        .windows(2)
        .take_while(|s| s[0] < q.end)
        .filter_map(|s| {
            let (qa, qb) = (q.start.max(s[0]), q.end.min(s[1]));
            let (ka, kb) = (k.start.max(s[0]), k.end.min(s[1]));
            (qa < qb && ka < kb).then(|| SeqPiece {
                q: qa - q.start..qb - q.start,
                k: ka - k.start..kb - k.start,
                seq_start: s[0],
            })
        })
        .collect()
}

/// The output scale of every head of a config (1/G for HeadGroups, 1 for LongNet and
/// windows).
pub fn out_scale(cfg: &DilatedConfig) -> f32 {
    match cfg.mixing() {
        Mixing::HeadGroups => 1.0 / cfg.num_patterns() as f32,
        Mixing::LongNet | Mixing::Window => 1.0,
    }
}

/// Which forward kernel runs a dtype and head dim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForwardKernel {
    /// Tensor-core kernel: name, padded head dim, query rows a block, K/V stages, key tile
    /// a block, dynamic shared memory.
    Mma { name: String, padded_d: usize, rows: ForwardRows, stages: ForwardStages, block_n: usize, smem_bytes: usize },
    /// One warp per query row (f32, or head dims the MMA path has no instance for).
    Rows { name: String },
}

/// Key tile of the tensor-core forward for a block shape and padded head dim (the `BN` of
/// the `ATTN_MMA_KERNEL*` and `ATTN_MMA3_KERNEL*` instances): 32 where the accumulators are
/// large (head dim 256; 128 with two row tiles a warp, whose scores would otherwise spill
/// registers), else 64.
pub fn mma_block_n(opts: ForwardOptions, padded_d: usize) -> usize {
    if padded_d * opts.rows.rows_per_warp() / 16 <= 128 { 64 } else { 32 }
}

/// Dynamic shared memory of the tensor-core forward (`MMA_SMEM` in `dilated_fwd_mma.cu`,
/// `MMA3_SMEM` in `dilated_fwd_mma3.cu`): the Q tile and the K/V stages.
pub fn mma_smem_bytes(opts: ForwardOptions, padded_d: usize) -> usize {
    (opts.rows.rows() + 2 * opts.stages.stages() * mma_block_n(opts, padded_d)) * (padded_d + 8) * 2
}

/// Pick the forward kernel (`suffix` is `f32`, `f16` or `bf16`; `opts` the tensor-core
/// kernel's block shape and stages, the 64-row one where the shape has no instance for the
/// head dim).
pub fn forward_kernel(dtype: DType, suffix: &str, head_dim: usize, opts: ForwardOptions) -> ForwardKernel {
    let padded = MMA_HEAD_DIMS.iter().copied().find(|&p| p >= head_dim);
    match (dtype, padded) {
        (DType::F16 | DType::BF16, Some(p)) => {
            let opts = if opts.has_head_dim(p) { opts } else { ForwardOptions { rows: ForwardRows::M64, ..opts } };
            ForwardKernel::Mma {
                name: mma_kernel_name(suffix, p, opts.rows, opts.stages),
                padded_d: p,
                rows: opts.rows,
                stages: opts.stages,
                block_n: mma_block_n(opts, p),
                smem_bytes: mma_smem_bytes(opts, p),
            }
        }
        _ => ForwardKernel::Rows { name: format!("dilated_fwd_rows_{suffix}") },
    }
}

/// Dynamic shared memory of the tensor-core backward (`MMA_BWD_SMEM` in `dilated_bwd_mma.cu`;
/// the dS^T tile only where the kernel adds dQ).
pub fn mma_bwd_smem_bytes(padded_d: usize, opts: BackwardOptions) -> usize {
    let (n, m) = (opts.keys.keys(), opts.queries.rows());
    let ds = match opts.dq {
        BackwardDq::Atomic => n * (m + 8) * 2,
        BackwardDq::Deterministic => 0,
    };
    (2 * n + opts.loads.stages() * 2 * m) * (padded_d + 8) * 2 + ds
}

/// Which backward kernels run a dtype and head dim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackwardKernel {
    /// The tensor-core kernel: name, keys a block, shared memory; `dq` the query-major
    /// tensor-core kernel that adds dq where this one computes dk and dv only
    /// ([`BackwardDq::Deterministic`]), `None` where it adds dq too.
    Mma { name: String, keys: BackwardKeys, smem_bytes: usize, dq: Option<MmaDq> },
    /// Two warp-per-row kernels (dq per query row; dk, dv per key row).
    Rows { dq: String, dkv: String },
}

/// The deterministic backward's dq kernel on tensor cores: 64 query rows a block over 4
/// warps, its dynamic shared memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmaDq {
    pub name: String,
    pub smem_bytes: usize,
}

impl MmaDq {
    /// Query rows (selected indices) a block.
    pub const ROWS: usize = 64;
    /// Threads a block.
    pub const THREADS: u32 = 128;
}

/// Dynamic shared memory of the tensor-core dq kernel (`MMA_BWD_DQ_SMEM` in
/// `dilated_bwd_dq_mma.cu`: the Q and dO tiles and two K/V stages, 32 keys a tile at head dim
/// 128, 64 below).
pub fn mma_bwd_dq_smem_bytes(padded_d: usize) -> usize {
    let keys = if padded_d >= 128 { 32 } else { 64 };
    (2 * MmaDq::ROWS + 4 * keys) * (padded_d + 8) * 2
}

/// Pick the backward kernels (`suffix` is `f32`, `f16` or `bf16`; `opts` the tensor-core
/// kernel's query-tile loads and keys a block, 64 keys where `opts.keys` has no instance
/// for the head dim).
pub fn backward_kernel(dtype: DType, suffix: &str, head_dim: usize, opts: BackwardOptions) -> BackwardKernel {
    let padded = MMA_BWD_HEAD_DIMS.iter().copied().find(|&p| p >= head_dim);
    match (dtype, padded) {
        (DType::F16 | DType::BF16, Some(p)) => {
            let keys = if opts.keys.has_head_dim(p) { opts.keys } else { BackwardKeys::K64 };
            let opts = BackwardOptions { keys, ..opts };
            BackwardKernel::Mma {
                name: mma_bwd_kernel_name(suffix, p, opts),
                keys,
                smem_bytes: mma_bwd_smem_bytes(p, opts),
                dq: match opts.dq {
                    BackwardDq::Atomic => None,
                    BackwardDq::Deterministic => {
                        Some(MmaDq { name: mma_bwd_dq_kernel_name(suffix, p), smem_bytes: mma_bwd_dq_smem_bytes(p) })
                    }
                },
            }
        }
        _ => BackwardKernel::Rows {
            dq: format!("dilated_bwd_dq_rows_{suffix}"),
            dkv: format!("dilated_bwd_dkv_rows_{suffix}"),
        },
    }
}

/// Whether the rows of a tensor of `shape` allow the 16-byte loads of the MMA kernels once
/// its first element sits on a 16-byte boundary ([`Planned::params_at`] checks that per
/// launch): `d % 8 == 0` and a multiple of 8 elements as the stride of every dimension a
/// launch steps along (of size above 1; a framework may give a size-1 dimension any stride).
///
/// [`Planned::params_at`]: super::launch_plan::Planned::params_at
pub fn vec_loads_ok(shape: Shape4, strides: [usize; 4]) -> bool {
    let sizes = [shape.batch, shape.seq, shape.heads];
    shape.head_dim.is_multiple_of(8) && sizes.iter().zip(strides).all(|(&n, s)| n <= 1 || s.is_multiple_of(8))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patterns() -> Vec<SegmentPattern> {
        let mut v = Vec::new();
        for (w, r) in [(1, 1), (4, 1), (8, 3), (5, 5), (16, 4), (7, 2), (12, 5)] {
            for off in 0..r {
                v.push(SegmentPattern::new(w, r, off));
            }
        }
        v
    }

    #[test]
    fn selected_index_math_matches_the_pattern() {
        for p in patterns() {
            let s = SelectedIndex::new(&p);
            let selected: Vec<usize> = (0..60).filter(|&x| p.is_selected(x)).collect();
            for (t, &pos) in selected.iter().enumerate() {
                assert_eq!(s.pos(t), pos, "{p:?} t={t}");
            }
            for x in 0..60 {
                assert_eq!(s.below(x), selected.iter().filter(|&&y| y < x).count(), "{p:?} x={x}");
            }
        }
    }

    /// The kernels' key bounds plus their per-element mask (same segment index) give
    /// exactly `SegmentPattern::attends` for any split into q and k blocks, ragged tails included.
    #[test]
    fn kernel_key_bounds_equal_the_mask() {
        for p in patterns() {
            let s = SelectedIndex::new(&p);
            for n in [1usize, 7, 13, 29] {
                for (q0, q1, k0, k1) in
                    [(0, n, 0, n), (0, n / 2, n / 2, n), (n / 3, n, 0, n / 3 + 1), (1.min(n), n, 0, n)]
                {
                    for causal in [false, true] {
                        for qp in q0..q1 {
                            let mut got: Vec<usize> = Vec::new();
                            if p.is_selected(qp) {
                                let t = s.below(qp);
                                assert_eq!(s.pos(t), qp);
                                for tk in s.keys_of(t, s.range(k0, k1 - k0), causal.into()) {
                                    got.push(s.pos(tk));
                                }
                            }
                            let want: Vec<usize> = (k0..k1).filter(|&kp| p.attends(qp, kp, causal.into())).collect();
                            assert_eq!(got, want, "{p:?} n={n} q={q0}..{q1} k={k0}..{k1} causal={causal} qp={qp}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn launches_cover_each_head_pattern_once() {
        for mixing in [Mixing::HeadGroups, Mixing::LongNet] {
            let cfg =
                DilatedConfig::builder().segments(&[4, 8, 16]).dilations(&[1, 2, 4]).mixing(mixing).build().unwrap();
            for heads in 3..9 {
                let launches = pattern_launches(&cfg, heads);
                for h in 0..heads {
                    let mut got: Vec<(usize, SegmentPattern)> = launches
                        .iter()
                        .filter(|l| l.heads.contains(&h))
                        .map(|l| (l.index, SegmentPattern::new(l.w, l.r, l.fixed_off.unwrap_or(h % l.r))))
                        .collect();
                    got.sort_by_key(|x| x.0);
                    assert_eq!(got, cfg.head_patterns(heads, h).patterns, "{mixing:?} heads={heads} h={h}");
                }
            }
            assert_eq!(out_scale(&cfg) as f64, cfg.head_patterns(3, 0).out_scale as f32 as f64);
        }
    }

    #[test]
    fn head_sweeps_write_each_kv_head_once_per_launch() {
        for (range, group) in [(0..8, 4), (2..7, 2), (3..4, 3), (0..5, 1), (1..9, 8)] {
            let sweeps = head_sweeps(range.clone(), group);
            let mut all: Vec<usize> = Vec::new();
            for s in &sweeps {
                let heads: Vec<usize> = (0..s.count).map(|i| s.head0 + i * s.step).collect();
                let mut kv: Vec<usize> = heads.iter().map(|h| h / group).collect();
                kv.dedup();
                assert_eq!(kv.len(), heads.len(), "{range:?} / {group}: {s:?} shares a kv head");
                all.extend(heads);
            }
            all.sort_unstable();
            assert_eq!(all, range.collect::<Vec<_>>());
        }
    }

    #[test]
    fn seq_pieces_split_blocks_by_sequence() {
        let cu = [0, 3, 4, 17, 30];
        assert_eq!(seq_pieces(None, 5..9, 0..30), [SeqPiece { q: 0..4, k: 0..30, seq_start: 0 }]);
        let got = seq_pieces(Some(&cu), 2..20, 0..16);
        assert_eq!(
            got,
            [
                SeqPiece { q: 0..1, k: 0..3, seq_start: 0 },
                SeqPiece { q: 1..2, k: 3..4, seq_start: 3 },
                SeqPiece { q: 2..15, k: 4..16, seq_start: 4 },
            ]
        );
        // Every (query, key) pair of one sequence lies in exactly one piece.
        for (q, k) in [(0..30, 0..30), (10..30, 15..25), (3..4, 0..30), (29..30, 17..30)] {
            let pieces = seq_pieces(Some(&cu), q.clone(), k.clone());
            for qp in q.clone() {
                for kp in k.clone() {
                    let same = cu.partition_point(|&c| c <= qp) == cu.partition_point(|&c| c <= kp);
                    let n = pieces
                        .iter()
                        .filter(|p| p.q.contains(&(qp - q.start)) && p.k.contains(&(kp - k.start)))
                        .count();
                    assert_eq!(n, usize::from(same), "q {qp} k {kp}");
                }
            }
        }
    }

    #[test]
    fn grid_covers_every_offset() {
        let l = PatternLaunch { index: 0, w: 2, r: 2, fixed_off: None, heads: 0..2, head_base: 0 };
        assert_eq!(l.max_selected(1, 1), 1); // only offset 1 selects position 1
        assert_eq!(l.max_selected(0, 10), 5);
    }

    #[test]
    fn kernel_choice_and_shared_memory() {
        let fwd = |rows, stages| ForwardOptions { rows, stages, ..ForwardOptions::default() };
        let m64 = fwd(ForwardRows::M64, ForwardStages::Two);
        assert!(matches!(forward_kernel(DType::F32, "f32", 64, m64), ForwardKernel::Rows { .. }));
        assert!(matches!(forward_kernel(DType::BF16, "bf16", 300, m64), ForwardKernel::Rows { .. }));
        let ForwardKernel::Mma { name, padded_d, smem_bytes, .. } = forward_kernel(DType::BF16, "bf16", 96, m64) else {
            panic!("expected the MMA kernel")
        };
        assert_eq!((name.as_str(), padded_d, smem_bytes), ("dilated_fwd_mma_bf16_d128", 128, 320 * 136 * 2));
        let ForwardKernel::Mma { name, rows, smem_bytes, .. } =
            forward_kernel(DType::F16, "f16", 128, fwd(ForwardRows::M128, ForwardStages::Two))
        else {
            panic!("expected the MMA kernel")
        };
        assert_eq!((name.as_str(), rows.threads(), smem_bytes), ("dilated_fwd_mma_m128_f16_d128", 256, 384 * 136 * 2));
        let ForwardKernel::Mma { name, rows, smem_bytes, .. } =
            forward_kernel(DType::BF16, "bf16", 64, fwd(ForwardRows::M128W4, ForwardStages::Two))
        else {
            panic!("expected the MMA kernel")
        };
        assert_eq!((name.as_str(), rows.threads(), smem_bytes), ("dilated_fwd_mma_m128w4_bf16_d64", 128, 384 * 72 * 2));
        // No 256 instance of 32 rows a warp: the 64-row kernel.
        let ForwardKernel::Mma { name, rows, .. } =
            forward_kernel(DType::BF16, "bf16", 200, fwd(ForwardRows::M128W4, ForwardStages::Two))
        else {
            panic!("expected the MMA kernel")
        };
        assert_eq!((name.as_str(), rows), ("dilated_fwd_mma_bf16_d256", ForwardRows::M64));
        // Three stages: the key tiles of two, three of them in shared memory.
        let ForwardKernel::Mma { name, block_n, smem_bytes, .. } =
            forward_kernel(DType::BF16, "bf16", 128, fwd(ForwardRows::M128W4, ForwardStages::Three))
        else {
            panic!("expected the MMA kernel")
        };
        assert_eq!((name.as_str(), block_n, smem_bytes), ("dilated_fwd_mma3_m128w4_bf16_d128", 32, 320 * 136 * 2));
        let ForwardKernel::Mma { name, rows, block_n, .. } =
            forward_kernel(DType::F16, "f16", 256, fwd(ForwardRows::M128, ForwardStages::Three))
        else {
            panic!("expected the MMA kernel")
        };
        assert_eq!((name.as_str(), rows, block_n), ("dilated_fwd_mma3_f16_d256", ForwardRows::M64, 32));
        for rows in ForwardRows::ALL {
            for stages in ForwardStages::ALL {
                for d in MMA_HEAD_DIMS {
                    let ForwardKernel::Mma { smem_bytes, .. } =
                        forward_kernel(DType::BF16, "bf16", d, fwd(rows, stages))
                    else {
                        panic!("expected the MMA kernel")
                    };
                    assert!(smem_bytes <= 163 * 1024, "must fit sm_80's opt-in shared memory");
                }
            }
        }
        for (loads, queries) in BackwardLoads::ALL.into_iter().flat_map(|l| BackwardQueries::ALL.map(|q| (l, q))) {
            for keys in BackwardKeys::ALL {
                let opts = BackwardOptions { loads, keys, queries, ..BackwardOptions::default() };
                assert!(mma_bwd_smem_bytes(128, opts) <= 163 * 1024, "{opts:?} must fit sm_80's shared memory");
                assert!(matches!(backward_kernel(DType::F16, "f16", 200, opts), BackwardKernel::Rows { .. }));
                assert!(matches!(backward_kernel(DType::F32, "f32", 64, opts), BackwardKernel::Rows { .. }));
            }
        }
        let sync = BackwardOptions::default();
        let BackwardKernel::Mma { name, .. } = backward_kernel(DType::BF16, "bf16", 64, sync) else {
            panic!("expected MMA")
        };
        assert_eq!(name, "dilated_bwd_mma_bf16_d64");
        let pipelined = BackwardOptions { loads: BackwardLoads::Pipelined, ..BackwardOptions::default() };
        let BackwardKernel::Mma { name, smem_bytes, .. } = backward_kernel(DType::BF16, "bf16", 128, pipelined) else {
            panic!("expected MMA")
        };
        assert_eq!((name.as_str(), smem_bytes), ("dilated_bwd_mma_pipelined_bf16_d128", 256 * 136 * 2 + 64 * 40 * 2));
        let k128 =
            BackwardOptions { loads: BackwardLoads::Pipelined, keys: BackwardKeys::K128, ..BackwardOptions::default() };
        let BackwardKernel::Mma { name, keys, smem_bytes, dq: None } = backward_kernel(DType::BF16, "bf16", 128, k128)
        else {
            panic!("expected MMA")
        };
        assert_eq!(
            (name.as_str(), keys.threads(), smem_bytes),
            ("dilated_bwd_mma_pipelined_k128_bf16_d128", 256, 384 * 136 * 2 + 128 * 40 * 2)
        );
        // No 128-key instance below head dim 64: 64 keys.
        let BackwardKernel::Mma { name, keys, .. } = backward_kernel(DType::F16, "f16", 32, k128) else {
            panic!("expected MMA")
        };
        assert_eq!((name.as_str(), keys), ("dilated_bwd_mma_pipelined_f16_d32", BackwardKeys::K64));
        // Deterministic: the tensor-core kernel without dq (no dS^T tile) and the query-major
        // dq kernel (Q, dO and two stages of 32 K/V rows at head dim 128; 64 below).
        let ordered = BackwardOptions { dq: BackwardDq::Deterministic, ..k128 };
        let BackwardKernel::Mma { name, smem_bytes, dq: Some(dq), .. } =
            backward_kernel(DType::BF16, "bf16", 128, ordered)
        else {
            panic!("expected MMA with a dq kernel")
        };
        assert_eq!(
            (name.as_str(), smem_bytes, dq.name.as_str(), dq.smem_bytes),
            (
                "dilated_bwd_mma_dkv_pipelined_k128_bf16_d128",
                384 * 136 * 2,
                "dilated_bwd_dq_mma_bf16_d128",
                256 * 136 * 2
            )
        );
        assert_eq!(mma_bwd_dq_smem_bytes(64), 384 * 72 * 2);
        let shape = |batch, seq, heads, head_dim| Shape4 { batch, seq, heads, head_dim };
        assert!(vec_loads_ok(shape(2, 16, 2, 64), [2048, 128, 64, 1]));
        assert!(!vec_loads_ok(shape(2, 16, 2, 60), [1920, 120, 60, 1]));
        // A stride off the multiple of 8 counts only where the launch steps along it.
        assert!(!vec_loads_ok(shape(2, 16, 2, 64), [2052, 128, 64, 1]));
        assert!(vec_loads_ok(shape(1, 16, 1, 64), [1, 64, 1, 1]));
        assert!(!vec_loads_ok(shape(1, 16, 2, 64), [1, 64, 3, 1]));
    }
}
