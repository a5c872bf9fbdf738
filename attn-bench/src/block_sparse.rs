//! The block masks of the block-sparse rows: random ones (per query block, the diagonal
//! and enough other key blocks drawn without replacement to keep `round(f * nb)` of them)
//! and the named `local_window` pattern of width `round(f * nb)` blocks.

use attn_core::{BlockDims, BlockMaskBuf, BlockPattern, Result};

use serde::{Deserialize, Serialize};

use crate::inputs::SplitMix;

/// Which mask a block-sparse row runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SparseKind {
    /// `round(f * nb)` key blocks per query block drawn at random, the diagonal among them.
    #[default]
    Random,
    /// `BlockPattern::LocalWindow` with `window_blocks = round(f * nb)`: the Python
    /// library's `local_window` pattern at `local_window_size = f * n`.
    LocalWindow,
}

impl SparseKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SparseKind::Random => "random",
            SparseKind::LocalWindow => "local_window",
        }
    }
}

/// A block mask over blocks of `block_size` positions, one for every batch row and head
/// ([`mask`]): `kind` at the kept fraction `kept_percent / 100` (random masks drawn with
/// `seed`; the seed is unused by the local window).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSparse {
    pub block_size: usize,
    pub kept_percent: usize,
    pub seed: u64,
    /// Random unless named (results written before the local window rows read as random).
    #[serde(default)]
    pub kind: SparseKind,
}

/// `round(kept_percent / 100 * nb)`, at least 1 and at most `nb`: the random masks' kept
/// blocks per query block and the local window's `window_blocks`.
pub fn kept_blocks(kept_percent: usize, nb: usize) -> usize {
    ((kept_percent as f64 / 100.0 * nb as f64).round() as usize).clamp(1, nb.max(1))
}

/// The share of (query block, key block) tiles of `seq` positions the mask `b` keeps.
pub fn kept_tile_share(b: &BlockSparse, seq: usize) -> Result<f64> {
    let m = mask(b, seq)?;
    let nb = m.view().dims().q_blocks;
    Ok(m.view().kept_tiles(0, 0) as f64 / (nb * nb) as f64)
}

/// The bound on a block-masked ring's bytes as a share of the all-kept mask's: the
/// mask's kept fraction `f` (a window's width over `nb`) plus one block row `1/nb` (the
/// blocks a rank's edge rows reach).
pub fn ring_bytes_bound(f: f64, nb: usize) -> f64 {
    f + 1.0 / nb as f64
}

/// The share of (query, key) pairs of a `seq`-long sequence the mask `b` keeps (the
/// ragged last block counted by its length).
pub fn kept_share(b: &BlockSparse, seq: usize) -> Result<f64> {
    let m = mask(b, seq)?;
    let v = m.view();
    let nb = v.dims().q_blocks;
    let len = |i: usize| (seq - i * b.block_size).min(b.block_size) as f64;
    let kept: f64 = (0..nb)
        .flat_map(|i| (0..nb).map(move |j| (i, j)))
        .filter(|&(i, j)| v.keeps_blocks(0, 0, i, j))
        .map(|(i, j)| len(i) * len(j))
        .sum();
    Ok(kept / (seq as f64 * seq as f64))
}

/// The mask `b` describes for a sequence of `seq` positions (one for every batch row and
/// head).
pub fn mask(b: &BlockSparse, seq: usize) -> Result<BlockMaskBuf> {
    let nb = seq.div_ceil(b.block_size.max(1));
    let kept = kept_blocks(b.kept_percent, nb);
    if b.kind == SparseKind::LocalWindow {
        return BlockMaskBuf::from_pattern(&BlockPattern::LocalWindow { window_blocks: kept }, b.block_size, seq, seq);
    }
    let mut rng = SplitMix::new(b.seed);
    let mut keep = vec![0u8; nb * nb];
    let mut others: Vec<usize> = Vec::with_capacity(nb);
    for (i, row) in keep.chunks_exact_mut(nb.max(1)).enumerate() {
        row[i] = 1;
        others.clear();
        others.extend((0..nb).filter(|&j| j != i));
        // A partial Fisher-Yates shuffle: the first kept - 1 of the others.
        for c in 0..kept - 1 {
            let pick = c + rng.below((others.len() - c) as u64) as usize;
            others.swap(c, pick);
            row[others[c]] = 1;
        }
    }
    BlockMaskBuf::new(keep, BlockDims { batch: 1, heads: 1, q_blocks: nb, k_blocks: nb }, b.block_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(kept_percent: usize) -> BlockSparse {
        BlockSparse { block_size: 128, kept_percent, seed: 9, kind: SparseKind::Random }
    }

    fn window(kept_percent: usize) -> BlockSparse {
        BlockSparse { kind: SparseKind::LocalWindow, ..random(kept_percent) }
    }

    #[test]
    fn kept_blocks_round_the_share_and_stay_in_range() {
        assert_eq!([5, 10, 25, 50, 100].map(|p| kept_blocks(p, 128)), [6, 13, 32, 64, 128]);
        assert_eq!([5, 10, 25, 50, 100].map(|p| kept_blocks(p, 512)), [26, 51, 128, 256, 512]);
        assert_eq!((kept_blocks(1, 10), kept_blocks(0, 10), kept_blocks(300, 10)), (1, 1, 10));
    }

    /// Interior query blocks keep `2 * (W / 2) + 1` blocks of a window of `W =
    /// round(f * nb)`; the edges lose what falls outside the sequence; 128 blocks.
    #[test]
    fn local_window_keeps_its_width_around_the_diagonal() {
        for (percent, w, interior) in [(5, 6, 7), (10, 13, 13), (25, 32, 33), (50, 64, 65)] {
            let m = mask(&window(percent), 16384).unwrap();
            let v = m.view();
            let row = |i: usize| (0..128).filter(|&j| v.keeps_blocks(0, 0, i, j)).collect::<Vec<_>>();
            assert_eq!(row(64), ((64 - w / 2)..=(64 + w / 2)).collect::<Vec<_>>(), "{percent}%");
            assert_eq!(row(64).len(), interior, "{percent}%");
            assert_eq!(row(0), (0..=w / 2).collect::<Vec<_>>(), "{percent}% first row");
            assert_eq!(row(127), ((127 - w / 2)..128).collect::<Vec<_>>(), "{percent}% last row");
            // Tiles: nb rows of `interior` less the two triangles cut off at the edges.
            let half = w / 2;
            let tiles = 128 * interior - half * (half + 1);
            let share = kept_tile_share(&window(percent), 16384).unwrap();
            assert!((share - tiles as f64 / (128.0 * 128.0)).abs() < 1e-12, "{percent}%: {share}");
        }
        // At 100% the window is nb wide: each row keeps the 64 blocks either side of it.
        let share = kept_tile_share(&window(100), 16384).unwrap();
        assert!((share - (128.0 * 129.0 - 64.0 * 65.0) / (128.0 * 128.0)).abs() < 1e-12, "{share}");
        assert_eq!(kept_tile_share(&random(100), 16384).unwrap(), 1.0);
    }

    #[test]
    fn the_ring_bound_adds_one_block_row() {
        assert!((ring_bytes_bound(0.25, 128) - (0.25 + 1.0 / 128.0)).abs() < 1e-15);
        assert_eq!(ring_bytes_bound(1.0, 1), 2.0);
    }

    #[test]
    fn earlier_results_read_as_random_masks() {
        let old: BlockSparse = serde_json::from_str(r#"{"block_size":128,"kept_percent":10,"seed":2026}"#).unwrap();
        assert_eq!(old.kind, SparseKind::Random);
        let w = serde_json::to_string(&window(10)).unwrap();
        assert!(w.contains(r#""kind":"local_window""#), "{w}");
        assert_eq!(serde_json::from_str::<BlockSparse>(&w).unwrap(), window(10));
    }

    #[test]
    fn each_row_keeps_its_share_and_the_diagonal() {
        for (seq, percent, want) in [(16384, 10, 13), (16384, 5, 6), (16384, 100, 128), (1000, 1, 1), (300, 50, 2)] {
            let m = mask(&random(percent), seq).unwrap();
            let v = m.view();
            let nb = v.dims().q_blocks;
            assert_eq!(nb, seq.div_ceil(128));
            for i in 0..nb {
                assert!(v.keeps_blocks(0, 0, i, i), "diagonal {i}");
                assert_eq!((0..nb).filter(|&j| v.keeps_blocks(0, 0, i, j)).count(), want, "{seq} {percent}% row {i}");
            }
            let share = kept_share(&random(percent), seq).unwrap();
            if seq % 128 == 0 {
                assert!((share - want as f64 / nb as f64).abs() < 1e-12, "{seq} {percent}%: {share}");
            }
        }
    }
}
