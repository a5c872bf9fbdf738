//! Launch planning for the CUDA kernels: which (pattern, head range, offset) launches a
//! config needs, grid sizes, kernel choice and shared memory. Pure host code, so the
//! selected-index math the kernels use (mirrored here from `prelude.cu`) is unit-tested
//! against `attn_core::SegmentPattern` without a GPU.

use std::ops::Range;

use attn_core::{Causality, DType, DilatedConfig, HeadGroups, Mixing, SegmentPattern};

use super::source::{MMA_BWD_HEAD_DIMS, MMA_HEAD_DIMS, mma_bwd_kernel_name, mma_kernel_name};

/// Threads per block of every attention kernel (4 warps).
pub const THREADS: u32 = 128;
/// Query rows (selected indices) per block of the tensor-core forward.
pub const MMA_BLOCK_M: usize = 64;

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
}

impl PatternLaunch {
    /// Offsets this launch uses.
    pub fn offsets(&self) -> Vec<usize> {
        match self.fixed_off {
            Some(o) => vec![o],
            None => {
                let mut v: Vec<usize> = self.heads.clone().map(|h| h % self.r).collect();
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
    let g = cfg.num_patterns();
    (0..g)
        .filter_map(|i| {
            let (w, r) = (cfg.pattern(i, 0).w, cfg.rate(i));
            let (fixed_off, range) = match cfg.mixing() {
                Mixing::HeadGroups => (Some(i % r), HeadGroups::new(heads, g).range(i)),
                Mixing::LongNet => (None, 0..heads),
                Mixing::Window => (Some(0), 0..heads),
            };
            (!range.is_empty()).then_some(PatternLaunch { index: i, w, r, fixed_off, heads: range })
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
    /// Tensor-core kernel: name, padded head dim, key tile, dynamic shared memory.
    Mma { name: String, padded_d: usize, block_n: usize, smem_bytes: usize },
    /// One warp per query row (f32, or head dims the MMA path has no instance for).
    Rows { name: String },
}

/// Key tile of the tensor-core forward for a padded head dim (see `ATTN_MMA_KERNEL`).
pub fn mma_block_n(padded_d: usize) -> usize {
    if padded_d <= 128 { 64 } else { 32 }
}

/// Dynamic shared memory of the tensor-core forward (`MMA_SMEM` in `dilated_fwd_mma.cu`):
/// the Q tile and two K/V stages.
pub fn mma_smem_bytes(padded_d: usize) -> usize {
    (MMA_BLOCK_M + 4 * mma_block_n(padded_d)) * (padded_d + 8) * 2
}

/// Pick the forward kernel (`suffix` is `f32`, `f16` or `bf16`).
pub fn forward_kernel(dtype: DType, suffix: &str, head_dim: usize) -> ForwardKernel {
    let padded = MMA_HEAD_DIMS.iter().copied().find(|&p| p >= head_dim);
    match (dtype, padded) {
        (DType::F16 | DType::BF16, Some(p)) => ForwardKernel::Mma {
            name: mma_kernel_name(suffix, p),
            padded_d: p,
            block_n: mma_block_n(p),
            smem_bytes: mma_smem_bytes(p),
        },
        _ => ForwardKernel::Rows { name: format!("dilated_fwd_rows_{suffix}") },
    }
}

/// Keys per block of the tensor-core backward (queries stream in tiles of 32).
pub const MMA_BWD_BLOCK_N: usize = 64;

/// Dynamic shared memory of the tensor-core backward (`MMA_BWD_SMEM` in `dilated_bwd_mma.cu`).
pub fn mma_bwd_smem_bytes(padded_d: usize) -> usize {
    (2 * 64 + 2 * 32) * (padded_d + 8) * 2 + 64 * (32 + 8) * 2
}

/// Which backward kernels run a dtype and head dim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackwardKernel {
    /// One tensor-core kernel for dq, dk and dv: name, key rows per block, shared memory.
    Mma { name: String, block_n: usize, smem_bytes: usize },
    /// Two warp-per-row kernels (dq per query row; dk, dv per key row).
    Rows { dq: String, dkv: String },
}

/// Pick the backward kernels (`suffix` is `f32`, `f16` or `bf16`).
pub fn backward_kernel(dtype: DType, suffix: &str, head_dim: usize) -> BackwardKernel {
    let padded = MMA_BWD_HEAD_DIMS.iter().copied().find(|&p| p >= head_dim);
    match (dtype, padded) {
        (DType::F16 | DType::BF16, Some(p)) => BackwardKernel::Mma {
            name: mma_bwd_kernel_name(suffix, p),
            block_n: MMA_BWD_BLOCK_N,
            smem_bytes: mma_bwd_smem_bytes(p),
        },
        _ => BackwardKernel::Rows {
            dq: format!("dilated_bwd_dq_rows_{suffix}"),
            dkv: format!("dilated_bwd_dkv_rows_{suffix}"),
        },
    }
}

/// Whether rows of a tensor allow the 16-byte loads of the MMA kernel: `d % 8 == 0` and
/// every stride a multiple of 8 elements (buffers are allocated 256-byte aligned).
pub fn vec_loads_ok(d: usize, strides: [usize; 4]) -> bool {
    d.is_multiple_of(8) && strides[..3].iter().all(|s| s.is_multiple_of(8))
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
    fn grid_covers_every_offset() {
        let l = PatternLaunch { index: 0, w: 2, r: 2, fixed_off: None, heads: 0..2 };
        assert_eq!(l.max_selected(1, 1), 1); // only offset 1 selects position 1
        assert_eq!(l.max_selected(0, 10), 5);
    }

    #[test]
    fn kernel_choice_and_shared_memory() {
        assert!(matches!(forward_kernel(DType::F32, "f32", 64), ForwardKernel::Rows { .. }));
        assert!(matches!(forward_kernel(DType::BF16, "bf16", 300), ForwardKernel::Rows { .. }));
        let ForwardKernel::Mma { name, padded_d, smem_bytes, .. } = forward_kernel(DType::BF16, "bf16", 96) else {
            panic!("expected the MMA kernel")
        };
        assert_eq!((name.as_str(), padded_d, smem_bytes), ("dilated_fwd_mma_bf16_d128", 128, 320 * 136 * 2));
        assert!(mma_smem_bytes(256) <= 163 * 1024, "must fit sm_80's opt-in shared memory");
        assert!(mma_bwd_smem_bytes(128) <= 163 * 1024);
        assert!(matches!(backward_kernel(DType::F16, "f16", 200), BackwardKernel::Rows { .. }));
        assert!(matches!(backward_kernel(DType::F32, "f32", 64), BackwardKernel::Rows { .. }));
        let BackwardKernel::Mma { name, .. } = backward_kernel(DType::BF16, "bf16", 64) else { panic!("expected MMA") };
        assert_eq!(name, "dilated_bwd_mma_bf16_d64");
        assert!(vec_loads_ok(64, [1024, 128, 64, 1]) && !vec_loads_ok(60, [960, 120, 60, 1]));
    }
}
