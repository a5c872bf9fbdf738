//! The launch planner's own checks: kernels, grids and parameters of planned launches.

use std::collections::BTreeSet;

use attn_core::{DilatedConfig, Mixing, Shape4};

use super::*;

fn geometry(cfg: &DilatedConfig, s: Shape4) -> BlockGeometry<'_> {
    BlockGeometry {
        cfg,
        q: (s, s.contiguous_strides()),
        q_start: 0,
        k: (s, s.contiguous_strides()),
        v_strides: s.contiguous_strides(),
        k_start: 0,
        g_strides: None,
        band: cfg.band(),
        kpad_seq: None,
        packing: None,
        block_mask: None,
        window: None,
    }
}

fn plan(cfg: &DilatedConfig, s: Shape4, fusion: PatternFusion) -> Vec<Planned> {
    let opts = ForwardOptions { rows: ForwardRows::M64, fusion, ..ForwardOptions::default() };
    plan_forward(&geometry(cfg, s), DType::BF16, "bf16", opts).unwrap()
}

/// Every (pattern, head, row block) a plan's blocks run, decoded as `fused_block` does.
fn blocks(plan: &[Planned]) -> BTreeSet<(i64, i64, i64, i64)> {
    let mut out = BTreeSet::new();
    for l in plan {
        let p = &l.params;
        // A persistent launch: items of every batch element in turn (grid x cut later).
        let xs = match p.work_items {
            0 => (0..i64::from(l.grid.0)).collect::<Vec<_>>(),
            n => (0..n).step_by(p.work_batch as usize).map(|i| i / i64::from(p.work_batch)).collect(),
        };
        for x in xs {
            if p.fused == 0 {
                for y in 0..i64::from(l.grid.1) {
                    out.insert((p.w, p.r, p.head0 + y * p.head_step, x));
                }
                continue;
            }
            let f = p.fuse[..p.fused as usize].iter().rfind(|f| x >= f.first).unwrap();
            out.insert((f.w, f.r, f.head0 + (x - f.first) / f.blocks, (x - f.first) % f.blocks));
        }
    }
    out
}

#[test]
fn head_groups_fuse_into_one_launch_covering_the_same_blocks() {
    let cfg = DilatedConfig::new(&[2048, 4096, 8192, 16384, 32768], &[1, 2, 4, 8, 16]).unwrap();
    let s = Shape4::new(1, 65_536, 16, 128).unwrap();
    let (apart, fused) = (plan(&cfg, s, PatternFusion::PerPattern), plan(&cfg, s, PatternFusion::Fused));
    assert_eq!((apart.len(), fused.len()), (5, 1));
    let f = &fused[0];
    assert_eq!((f.params.fused, f.grid.1, f.grid.2), (5, 1, 1));
    // Each pattern: 2048 keys a row; heads 4, 3, 3, 3, 3; 65536 / r rows of 64 a block.
    // Heads of entry i: its grid x range (to the next entry's first) over its blocks.
    let ends: Vec<i64> = f.params.fuse[1..5].iter().map(|p| p.first).chain([i64::from(f.grid.0)]).collect();
    let parts: Vec<_> = f.params.fuse[..5]
        .iter()
        .zip(ends)
        .map(|(p, end)| (p.r, (end - p.first) / p.blocks, p.blocks, p.first))
        .collect();
    assert_eq!(parts, [(1, 4, 1024, 0), (2, 3, 512, 4096), (4, 3, 256, 5632), (8, 3, 128, 6400), (16, 3, 64, 6784)]);
    assert_eq!(f.grid.0, 6784 + 3 * 64);
    assert_eq!(blocks(&apart), blocks(&fused));
}

#[test]
fn heavier_patterns_come_first_and_at_most_max_fused_share_a_launch() {
    let segs: Vec<usize> = (0..9).map(|i| 64 << (i % 3)).collect();
    let rates: Vec<usize> = (0..9).map(|i| 1 + i / 3).collect();
    let cfg = DilatedConfig::new(&segs, &rates).unwrap();
    let s = Shape4::new(2, 1000, 9, 64).unwrap();
    let (apart, fused) = (plan(&cfg, s, PatternFusion::PerPattern), plan(&cfg, s, PatternFusion::Fused));
    assert_eq!((apart.len(), fused.len()), (9, 2));
    assert_eq!((fused[0].params.fused, fused[1].params.fused), (MAX_FUSED as i32, 0));
    let keys: Vec<i64> = fused[0].params.fuse.iter().map(|p| (p.w + p.r - 1) / p.r).collect();
    assert!(keys.windows(2).all(|w| w[0] >= w[1]), "{keys:?}");
    assert!(fused.iter().all(|l| l.grid.2 == 2));
    assert_eq!(blocks(&apart), blocks(&fused));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: attn_testkit::proptest_cases(256), ..Default::default() })]

    /// Any head-group config, shape and block offsets (a ring block): the fused and the
    /// persistent plans run exactly the (pattern, head, row block) triples of one launch a
    /// pattern, in fewer launches where there are several patterns.
    #[test]
    fn fused_plans_cover_what_one_launch_a_pattern_covers(
        patterns in proptest::collection::vec((1usize..300, 1usize..9), 1..13),
        heads in 1usize..24,
        (nq, nk, q_start, k_start) in (1usize..700, 1usize..700, 0usize..900, 0usize..900),
        (batch, causal) in (1usize..3, proptest::bool::ANY),
    ) {
        let (segs, rates): (Vec<usize>, Vec<usize>) = patterns.iter().map(|&(w, r)| (w.max(r), r)).unzip();
        let Ok(cfg) = DilatedConfig::builder().segments(&segs).dilations(&rates).causality(causal.into()).build() else {
            return Ok(());
        };
        let (sq, sk) = (Shape4::new(batch, nq, heads, 64).unwrap(), Shape4::new(batch, nk, heads, 64).unwrap());
        let g = BlockGeometry {
            q: (sq, sq.contiguous_strides()),
            q_start,
            k: (sk, sk.contiguous_strides()),
            v_strides: sk.contiguous_strides(),
            k_start,
            ..geometry(&cfg, sq)
        };
        let run = |fusion| {
            let opts = ForwardOptions { rows: ForwardRows::M64, fusion, ..ForwardOptions::default() };
            plan_forward(&g, DType::BF16, "bf16", opts).unwrap()
        };
        let (apart, fused) = (run(PatternFusion::PerPattern), run(PatternFusion::Fused));
        proptest::prop_assert_eq!(blocks(&apart), blocks(&fused));
        proptest::prop_assert_eq!(fused.len(), apart.len().div_ceil(MAX_FUSED));
        proptest::prop_assert!(fused.iter().all(|l| (l.params.fused > 1) == l.kernel.contains("fused")));
        // Persistent: the same blocks and launches, every launch one over its items.
        let persistent = run(PatternFusion::Persistent);
        proptest::prop_assert_eq!(blocks(&apart), blocks(&persistent));
        proptest::prop_assert_eq!(persistent.len(), fused.len());
        for l in &persistent {
            let p = &l.params;
            proptest::prop_assert!(l.work && l.kernel.contains("persistent") && p.work == 0, "{l:?}");
            proptest::prop_assert_eq!((p.work_batch as usize, l.grid), (batch, (p.work_items as u32, 1, 1)));
        }
    }
}

#[test]
fn longnet_heads_and_row_kernels_are_not_fused() {
    let s = Shape4::new(1, 512, 4, 64).unwrap();
    let longnet = DilatedConfig::builder().segments(&[64, 128]).dilations(&[1, 2]).mixing(Mixing::LongNet);
    let cfg = longnet.build().unwrap();
    assert_eq!(plan(&cfg, s, PatternFusion::Fused), plan(&cfg, s, PatternFusion::PerPattern));
    let hg = DilatedConfig::new(&[64, 128], &[1, 2]).unwrap();
    let opts = ForwardOptions { rows: ForwardRows::M64, fusion: PatternFusion::Fused, ..ForwardOptions::default() };
    let rows = plan_forward(&geometry(&hg, s), DType::F32, "f32", opts).unwrap();
    assert!(rows.len() == 2 && rows.iter().all(|l| l.params.fused == 0));
}

/// Under `BackwardMma::Wgmma` each atomic-dQ backward launch of f16/bf16 becomes the sm_90a
/// kernel (64 keys a block, two warpgroups) with the `mma.sync` launch of the same keys
/// behind it; f32, the deterministic dq sum and a block mask keep the `mma.sync` plan.
#[test]
fn the_sm90a_backward_replaces_atomic_dq_launches_with_their_fallback_behind() {
    let cfg = DilatedConfig::new(&[256, 512], &[1, 2]).unwrap();
    let s = Shape4::new(2, 1024, 4, 64).unwrap();
    let g = BlockGeometry { g_strides: Some(s.contiguous_strides()), ..geometry(&cfg, s) };
    let keys = BackwardKeys::K128;
    let wgmma = BackwardOptions { mma: BackwardMma::Wgmma, keys, ..BackwardOptions::default() };
    let mma = plan_backward(&g, DType::BF16, "bf16", BackwardOptions { keys, ..BackwardOptions::default() }).unwrap();
    let plan = plan_backward(&g, DType::BF16, "bf16", wgmma).unwrap();
    assert_eq!(plan.len(), mma.len());
    for (p, m) in plan.iter().zip(&mma) {
        assert_eq!(p.kernel, "dilated_bwd_wgmma_bf16_d64");
        assert_eq!((p.threads, p.grid.0), (256, m.grid.0 * 2), "64 keys a block against the fallback's 128");
        assert_eq!(p.fallback.as_deref(), Some(m));
    }
    let det = BackwardOptions { dq: BackwardDq::Deterministic, ..wgmma };
    assert!(plan_backward(&g, DType::BF16, "bf16", det).unwrap().iter().all(|p| p.fallback.is_none()));
    assert!(plan_backward(&g, DType::F32, "f32", wgmma).unwrap().iter().all(|p| p.fallback.is_none()));
}
