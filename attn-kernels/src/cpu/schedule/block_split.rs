//! Block masks on the CPU: a piece (the selected rows of one pattern segment) is cut
//! into sub-pieces, one per run of query blocks whose mask rows are equal (or, from the
//! key side, key blocks whose mask columns are equal), each holding only the rows of the
//! blocks that run keeps. A removed tile's rows are never packed nor scored, so the
//! work falls with the kept blocks, and every kernel (each ISA, each dtype, forward and
//! backward) sees an ordinary piece: the band and padding still apply inside it.
//!
//! Positions here are lane-relative (from the start of a batch row or of a packed
//! sequence), which is what the mask indexes: `block = position / block_size`.

use std::ops::Range;

use attn_core::BlockMask;

/// The block mask of one (batch row, query head) of a call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadBlocks<'a> {
    mask: BlockMask<'a>,
    b: usize,
    h: usize,
}

/// Which side of a piece is cut into runs of blocks (the other side is filtered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outer {
    /// Runs of query blocks with equal rows; each run keeps the keys of its kept blocks.
    Queries,
    /// Runs of key blocks with equal columns; each run keeps the queries that keep it.
    Keys,
}

impl<'a> HeadBlocks<'a> {
    /// Batch row `b`, query head `h` of `mask` (a mask of batch or heads 1 broadcasts).
    pub fn new(mask: BlockMask<'a>, b: usize, h: usize) -> Self {
        HeadBlocks { mask, b, h }
    }

    pub fn block_size(&self) -> usize {
        self.mask.block_size()
    }

    /// Whether the tile (query block `qb`, key block `kb`) is kept.
    #[inline]
    fn keeps(&self, qb: usize, kb: usize) -> bool {
        self.mask.keeps_blocks(self.b, self.h, qb, kb)
    }

    /// Whether outer blocks `x` and `y` keep the same blocks of the other side.
    fn same(&self, outer: Outer, x: usize, y: usize) -> bool {
        let d = self.mask.dims();
        match outer {
            Outer::Queries => (0..d.k_blocks).all(|kb| self.keeps(x, kb) == self.keeps(y, kb)),
            Outer::Keys => (0..d.q_blocks).all(|qb| self.keeps(qb, x) == self.keeps(qb, y)),
        }
    }

    /// Whether outer block `o` keeps inner block `i`.
    #[inline]
    fn pair(&self, outer: Outer, o: usize, i: usize) -> bool {
        match outer {
            Outer::Queries => self.keeps(o, i),
            Outer::Keys => self.keeps(i, o),
        }
    }
}

/// Index ranges of `pos` (ascending) covering it in runs of consecutive blocks of
/// `outer` whose mask rows (columns) are equal, into `runs`.
pub(crate) fn block_runs(hb: &HeadBlocks<'_>, outer: Outer, pos: &[usize], runs: &mut Vec<Range<usize>>) {
    let bs = hb.block_size();
    runs.clear();
    let mut start = 0;
    while start < pos.len() {
        let first = pos[start] / bs;
        // The end of this block's rows, then of every following block with the same set.
        let mut end = start + pos[start..].partition_point(|&p| p / bs == first);
        while end < pos.len() && hb.same(outer, first, pos[end] / bs) {
            let next = pos[end] / bs;
            end += pos[end..].partition_point(|&p| p / bs == next);
        }
        runs.push(start..end);
        start = end;
    }
}

/// The positions of `pos` (ascending) in the inner blocks that outer block `o` keeps,
/// into `dst`: one search per block, so a removed block costs no per-row work.
pub(crate) fn kept_rows(hb: &HeadBlocks<'_>, outer: Outer, o: usize, pos: &[usize], dst: &mut Vec<usize>) {
    dst.clear();
    let (Some(&first), Some(&last)) = (pos.first(), pos.last()) else { return };
    let bs = hb.block_size();
    let mut from = 0;
    for i in first / bs..=last / bs {
        let end = from + pos[from..].partition_point(|&p| p < (i + 1) * bs);
        if hb.pair(outer, o, i) {
            dst.extend_from_slice(&pos[from..end]);
        }
        from = end;
    }
}

/// Like [`kept_rows`], but the index ranges of `pos` (ascending) in the inner blocks
/// that outer block `o` keeps, into `dst` (the block API picks rows by index).
pub(crate) fn kept_ranges(hb: &HeadBlocks<'_>, outer: Outer, o: usize, pos: &[usize], dst: &mut Vec<Range<usize>>) {
    dst.clear();
    let (Some(&first), Some(&last)) = (pos.first(), pos.last()) else { return };
    let bs = hb.block_size();
    let mut from = 0;
    for i in first / bs..=last / bs {
        let end = from + pos[from..].partition_point(|&p| p < (i + 1) * bs);
        if from < end && hb.pair(outer, o, i) {
            dst.push(from..end);
        }
        from = end;
    }
}

#[cfg(test)]
mod tests {
    use attn_core::{BlockDims, BlockMaskBuf};

    use super::*;

    /// The sub-pieces of (qpos, kpos) as (outer rows, inner rows) lists.
    fn split(hb: &HeadBlocks<'_>, outer: Outer, qpos: &[usize], kpos: &[usize]) -> Vec<(Vec<usize>, Vec<usize>)> {
        let (o, i) = if outer == Outer::Queries { (qpos, kpos) } else { (kpos, qpos) };
        let mut runs = Vec::new();
        block_runs(hb, outer, o, &mut runs);
        let mut out = Vec::new();
        for r in runs {
            let mut kept = Vec::new();
            kept_rows(hb, outer, o[r.start] / hb.block_size(), i, &mut kept);
            out.push((o[r].to_vec(), kept));
        }
        out
    }

    /// Every sub-piece keeps exactly its kept pairs and no other: the pairs the pieces
    /// cover are the mask's kept pairs, each once, and a removed block's rows appear in
    /// no piece of a run that removes it (the skip).
    #[test]
    fn sub_pieces_cover_exactly_the_kept_pairs() {
        // 5 query blocks of 3 (the last ragged), 4 key blocks of 3 over 11 keys.
        let dims = BlockDims { batch: 1, heads: 2, q_blocks: 5, k_blocks: 4 };
        let rows = [[1, 0, 0, 1], [1, 0, 0, 1], [0, 1, 0, 0], [1, 0, 0, 1], [0, 0, 1, 1]];
        let m = BlockMaskBuf::from_fn(dims, 3, |_, h, i, j| h == 1 || rows[i][j] == 1).unwrap();
        let hb = HeadBlocks::new(m.view(), 0, 0);
        let qpos: Vec<usize> = (0..14).filter(|p| p % 5 != 2).collect();
        let kpos: Vec<usize> = (0..11).collect();
        for outer in [Outer::Queries, Outer::Keys] {
            let pieces = split(&hb, outer, &qpos, &kpos);
            let mut pairs = Vec::new();
            for (o, i) in &pieces {
                for &a in o {
                    for &b in i {
                        pairs.push(if outer == Outer::Queries { (a, b) } else { (b, a) });
                    }
                }
            }
            pairs.sort_unstable();
            let mut want: Vec<(usize, usize)> = qpos
                .iter()
                .flat_map(|&q| kpos.iter().map(move |&k| (q, k)))
                .filter(|&(q, k)| rows[q / 3][k / 3] == 1)
                .collect();
            want.sort_unstable();
            assert_eq!(pairs, want, "{outer:?}");
        }
        // Query runs: blocks 0-1 (equal rows) merge; 2, 3, 4 stand alone; block 2 keeps
        // key block 1 only, so keys 0-2 and 6-11 are never loaded for it.
        let pieces = split(&hb, Outer::Queries, &qpos, &kpos);
        let want: Vec<(Vec<usize>, Vec<usize>)> = vec![
            (vec![0, 1, 3, 4, 5], vec![0, 1, 2, 9, 10]),
            (vec![6, 8], vec![3, 4, 5]),
            (vec![9, 10, 11], vec![0, 1, 2, 9, 10]),
            (vec![13], vec![6, 7, 8, 9, 10]),
        ];
        assert_eq!(pieces, want);
        // A row that keeps one block keeps that block's rows; an all-kept head is one piece.
        let all = HeadBlocks::new(m.view(), 0, 1);
        assert_eq!(split(&all, Outer::Queries, &qpos, &kpos), vec![(qpos.clone(), kpos.clone())]);
        assert_eq!(split(&all, Outer::Keys, &qpos, &kpos), vec![(kpos.clone(), qpos.clone())]);
    }

    #[test]
    fn a_block_edge_is_position_over_block_size() {
        // Block size 4: key 3 is in block 0, key 4 in block 1.
        let dims = BlockDims { batch: 1, heads: 1, q_blocks: 1, k_blocks: 2 };
        let m = BlockMaskBuf::from_fn(dims, 4, |_, _, _, j| j == 1).unwrap();
        let hb = HeadBlocks::new(m.view(), 0, 0);
        let mut kept = Vec::new();
        kept_rows(&hb, Outer::Queries, 0, &[2, 3, 4, 5, 7], &mut kept);
        assert_eq!(kept, [4, 5, 7]);
        kept_rows(&hb, Outer::Keys, 1, &[0, 3], &mut kept);
        assert_eq!(kept, [0, 3]);
        kept_rows(&hb, Outer::Keys, 0, &[0, 3], &mut kept);
        assert!(kept.is_empty());
    }
}
