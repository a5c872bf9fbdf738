//! The random block masks of the block-sparse rows: per query block, the diagonal and
//! enough other key blocks drawn without replacement to keep `round(f * nb)` of them.

use attn_core::{BlockDims, BlockMaskBuf, Result};

use serde::{Deserialize, Serialize};

use crate::inputs::SplitMix;

/// A random block mask over blocks of `block_size` positions: `round(kept_percent / 100 *
/// nb)` kept key blocks (at least 1) per query block, the diagonal among them, drawn with
/// `seed`; one mask for every batch row and head ([`mask`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSparse {
    pub block_size: usize,
    pub kept_percent: usize,
    pub seed: u64,
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
    let kept = ((b.kept_percent as f64 / 100.0 * nb as f64).round() as usize).clamp(1, nb.max(1));
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

    #[test]
    fn each_row_keeps_its_share_and_the_diagonal() {
        for (seq, percent, want) in [(16384, 10, 13), (16384, 5, 6), (16384, 100, 128), (1000, 1, 1), (300, 50, 2)] {
            let m = mask(&BlockSparse { block_size: 128, kept_percent: percent, seed: 9 }, seq).unwrap();
            let v = m.view();
            let nb = v.dims().q_blocks;
            assert_eq!(nb, seq.div_ceil(128));
            for i in 0..nb {
                assert!(v.keeps_blocks(0, 0, i, i), "diagonal {i}");
                assert_eq!((0..nb).filter(|&j| v.keeps_blocks(0, 0, i, j)).count(), want, "{seq} {percent}% row {i}");
            }
            let share = kept_share(&BlockSparse { block_size: 128, kept_percent: percent, seed: 9 }, seq).unwrap();
            if seq % 128 == 0 {
                assert!((share - want as f64 / nb as f64).abs() < 1e-12, "{seq} {percent}%: {share}");
            }
        }
    }
}
