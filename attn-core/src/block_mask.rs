//! Block masks (block-sparse attention, the definition's "Block masks"): which (query
//! block, key block) tiles each head may attend, ANDed with the pattern and every other
//! mask. A block mask is a function of global positions (`position / block_size`), so
//! every split of the sequence applies it with the same kernels.

use std::fmt;

use crate::error::{AttnError, Result};
use crate::packing::PackedSequences;
use crate::shape::AttnShape;

/// The sizes of a block mask, `[batch, heads, q_blocks, k_blocks]`: `batch` is 1
/// (broadcast) or the call's batch, `heads` 1 or the call's query heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockDims {
    pub batch: usize,
    pub heads: usize,
    pub q_blocks: usize,
    pub k_blocks: usize,
}

impl BlockDims {
    /// Entries of a mask of these sizes, `None` on overflow.
    pub fn len(&self) -> Option<usize> {
        self.batch.checked_mul(self.heads)?.checked_mul(self.q_blocks)?.checked_mul(self.k_blocks)
    }

    /// Whether some size is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == Some(0)
    }

    fn as_vec(&self) -> Vec<usize> {
        vec![self.batch, self.heads, self.q_blocks, self.k_blocks]
    }
}

fn bad(reason: impl Into<String>) -> AttnError {
    AttnError::InvalidBlockMask(reason.into())
}

/// Blocks need at least one position.
fn check_block_size(block_size: usize) -> Result<()> {
    if block_size == 0 { Err(bad("block_size is 0; blocks need at least one position")) } else { Ok(()) }
}

/// A borrowed block mask: U8 `[batch, heads, q_blocks, k_blocks]`, row-major, 1 = kept,
/// 0 = removed (the opposite polarity of a key padding mask), over blocks of `block_size`
/// positions (the last block of a length that is not a multiple is shorter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMask<'a> {
    keep: &'a [u8],
    dims: BlockDims,
    block_size: usize,
}

impl<'a> BlockMask<'a> {
    /// The mask `keep` of sizes `dims` over blocks of `block_size` positions; a zero size,
    /// a length that is not the sizes' product, or a value other than 0 and 1 is a typed
    /// error naming it.
    pub fn new(keep: &'a [u8], dims: BlockDims, block_size: usize) -> Result<Self> {
        check_block_size(block_size)?;
        match dims.len() {
            None => return Err(bad(format!("sizes {:?} overflow", dims.as_vec()))),
            Some(0) => return Err(bad(format!("sizes {:?} have a zero", dims.as_vec()))),
            Some(n) if n != keep.len() => {
                return Err(bad(format!("{} entries for sizes {:?} ({n} needed)", keep.len(), dims.as_vec())));
            }
            Some(_) => {}
        }
        if let Some(i) = keep.iter().position(|&x| x > 1) {
            return Err(bad(format!("entry {i} is {}; entries are 1 (kept) or 0 (removed)", keep[i])));
        }
        Ok(BlockMask { keep, dims, block_size })
    }

    pub fn dims(&self) -> BlockDims {
        self.dims
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// The entries, `[batch, heads, q_blocks, k_blocks]` row-major.
    pub fn keep(&self) -> &'a [u8] {
        self.keep
    }

    /// Whether head `h` of batch `b` keeps the tile (query block `qb`, key block `kb`);
    /// a mask of batch or heads 1 serves every batch or head.
    #[inline]
    pub fn keeps_blocks(&self, b: usize, h: usize, qb: usize, kb: usize) -> bool {
        let d = &self.dims;
        let (b, h) = (if d.batch == 1 { 0 } else { b }, if d.heads == 1 { 0 } else { h });
        self.keep[((b * d.heads + h) * d.q_blocks + qb) * d.k_blocks + kb] == 1
    }

    /// Whether head `h` of batch `b` keeps the pair (query position `q`, key position `k`),
    /// positions counted from the start of their sequence.
    #[inline]
    pub fn keeps(&self, b: usize, h: usize, q: usize, k: usize) -> bool {
        self.keeps_blocks(b, h, q / self.block_size, k / self.block_size)
    }

    /// Kept tiles of one (batch, head) row of the mask, out of `q_blocks * k_blocks`.
    pub fn kept_tiles(&self, b: usize, h: usize) -> usize {
        let d = &self.dims;
        (0..d.q_blocks).map(|i| (0..d.k_blocks).filter(|&j| self.keeps_blocks(b, h, i, j)).count()).sum()
    }

    /// Check the mask against a call: batch 1 or the call's, heads 1 or its query heads,
    /// and `ceil(n / block_size)` blocks of queries and of keys; with packed sequences
    /// batch 1 and `ceil(max_i n_i / block_size)` blocks each way (sequence `i` uses the
    /// top-left `ceil(n_i / block_size)` square).
    pub fn check(&self, shape: &AttnShape, packing: Option<PackedSequences<'_>>) -> Result<()> {
        let d = &self.dims;
        let blocks = |n: usize| n.div_ceil(self.block_size);
        let (want_batch, q_blocks, k_blocks) = match packing {
            Some(p) => {
                let longest = p.iter().map(|r| r.len()).max().unwrap_or(0);
                (1, blocks(longest), blocks(longest))
            }
            None => (shape.q.batch, blocks(shape.q.seq), blocks(shape.kv.seq)),
        };
        if d.batch != 1 && d.batch != want_batch {
            return Err(bad(format!("batch {} where 1 or {want_batch} was expected", d.batch)));
        }
        if d.heads != 1 && d.heads != shape.q.heads {
            return Err(bad(format!("heads {} where 1 or the {} query heads were expected", d.heads, shape.q.heads)));
        }
        if (d.q_blocks, d.k_blocks) != (q_blocks, k_blocks) {
            let (bs, what) =
                (self.block_size, if packing.is_some() { "the longest packed sequence" } else { "the call" });
            return Err(bad(format!(
                "{} x {} blocks where {what} at block_size {bs} needs {q_blocks} x {k_blocks}",
                d.q_blocks, d.k_blocks
            )));
        }
        Ok(())
    }
}

/// A named block pattern over block indices `i` (query) and `j` (key), `nb` key blocks,
/// with the index sets of the Python library's `SparsePatternConfig` pattern types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockPattern {
    /// `max(0, i - W/2) <= j < min(nb, i + W/2 + 1)` (an even W keeps W + 1 blocks).
    LocalWindow { window_blocks: usize },
    /// `j = i` or `j = i +- r` for the first three rates.
    DilatedSparse { rates: Vec<usize> },
    /// `j < min(g, nb)` or `max(g, i - R) <= j < min(nb, i + R + 1)`.
    GlobalLocal { global_blocks: usize, radius: usize },
}

impl BlockPattern {
    /// Whether the pattern keeps key block `j` for query block `i` (`nb` key blocks).
    pub fn keeps(&self, i: usize, j: usize, nb: usize) -> bool {
        if j >= nb {
            return false;
        }
        match self {
            BlockPattern::LocalWindow { window_blocks } => {
                let half = window_blocks / 2;
                i.saturating_sub(half) <= j && j < i + half + 1
            }
            BlockPattern::DilatedSparse { rates } => j == i || rates.iter().take(3).any(|&r| j + r == i || j == i + r),
            BlockPattern::GlobalLocal { global_blocks, radius } => {
                let local_lo = (*global_blocks).max(i.saturating_sub(*radius));
                j < *global_blocks || (local_lo <= j && j < i + radius + 1)
            }
        }
    }

    /// The pattern a file's `block_pattern` names: `local_window window_blocks=3`,
    /// `dilated_sparse rates=1,2,4` or `global_local global_blocks=1 radius=2`.
    pub fn parse(s: &str) -> Result<Self> {
        let mut words = s.split_whitespace();
        let name = words.next().ok_or_else(|| bad("block_pattern is empty"))?;
        let mut args = std::collections::BTreeMap::new();
        for w in words {
            let (k, v) =
                w.split_once('=').ok_or_else(|| bad(format!("block_pattern `{s}`: `{w}` is not key=value")))?;
            args.insert(k, v);
        }
        let number = |k: &str| -> Result<usize> {
            let v = args.get(k).ok_or_else(|| bad(format!("block_pattern `{s}` lacks `{k}`")))?;
            v.parse().map_err(|_| bad(format!("block_pattern `{s}`: `{k}={v}` is not a count")))
        };
        let (pattern, keys): (Self, &[&str]) = match name {
            "local_window" => {
                (BlockPattern::LocalWindow { window_blocks: number("window_blocks")? }, &["window_blocks"])
            }
            "dilated_sparse" => {
                let v = args.get("rates").ok_or_else(|| bad(format!("block_pattern `{s}` lacks `rates`")))?;
                let rates = v.split(',').map(|r| r.trim().parse()).collect::<std::result::Result<Vec<usize>, _>>();
                let rates =
                    rates.map_err(|_| bad(format!("block_pattern `{s}`: `rates={v}` is not a list of counts")))?;
                (BlockPattern::DilatedSparse { rates }, &["rates"])
            }
            "global_local" => {
                let (global_blocks, radius) = (number("global_blocks")?, number("radius")?);
                (BlockPattern::GlobalLocal { global_blocks, radius }, &["global_blocks", "radius"])
            }
            other => {
                return Err(bad(format!(
                    "unknown block pattern `{other}` (local_window, dilated_sparse, global_local)"
                )));
            }
        };
        if let Some(k) = args.keys().find(|k| !keys.contains(k)) {
            return Err(bad(format!("block_pattern `{s}`: `{k}` is not a parameter of {name}")));
        }
        Ok(pattern)
    }

    /// The pattern of the Python library's `SparsePatternConfig` on the block-sparse path:
    /// `W = local_window_size // block_size`, `g = global_tokens // block_size`, `R = W // 2`,
    /// `rates` the module's dilation rates; an unknown pattern type is a typed error.
    pub fn from_sparse_config(
        pattern_type: &str,
        local_window_size: usize,
        global_tokens: usize,
        block_size: usize,
        dilation_rates: &[usize],
    ) -> Result<Self> {
        check_block_size(block_size)?;
        let w = local_window_size / block_size;
        match pattern_type {
            "local_window" => Ok(BlockPattern::LocalWindow { window_blocks: w }),
            "dilated_sparse" => Ok(BlockPattern::DilatedSparse { rates: dilation_rates.to_vec() }),
            "global_local" => {
                Ok(BlockPattern::GlobalLocal { global_blocks: global_tokens / block_size, radius: w / 2 })
            }
            other => Err(bad(format!("unknown pattern_type `{other}` (local_window, dilated_sparse, global_local)"))),
        }
    }
}

impl fmt::Display for BlockPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockPattern::LocalWindow { window_blocks } => write!(f, "local_window window_blocks={window_blocks}"),
            BlockPattern::DilatedSparse { rates } => {
                let rates: Vec<String> = rates.iter().map(usize::to_string).collect();
                write!(f, "dilated_sparse rates={}", rates.join(","))
            }
            BlockPattern::GlobalLocal { global_blocks, radius } => {
                write!(f, "global_local global_blocks={global_blocks} radius={radius}")
            }
        }
    }
}

/// An owned block mask, built from a function of (batch, head, query block, key block) or
/// from a named pattern; [`BlockMaskBuf::view`] lends it as a [`BlockMask`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockMaskBuf {
    keep: Vec<u8>,
    dims: BlockDims,
    block_size: usize,
}

impl BlockMaskBuf {
    /// The mask `keep` (`[batch, heads, q_blocks, k_blocks]` row-major, 1 kept, 0 removed),
    /// checked as [`BlockMask::new`] checks it.
    pub fn new(keep: Vec<u8>, dims: BlockDims, block_size: usize) -> Result<Self> {
        BlockMask::new(&keep, dims, block_size)?;
        Ok(BlockMaskBuf { keep, dims, block_size })
    }

    /// The mask of sizes `dims` whose entry (b, h, i, j) is `f(b, h, i, j)`.
    pub fn from_fn(
        dims: BlockDims,
        block_size: usize,
        mut f: impl FnMut(usize, usize, usize, usize) -> bool,
    ) -> Result<Self> {
        let n = dims.len().ok_or_else(|| bad(format!("sizes {:?} overflow", dims.as_vec())))?;
        let mut keep = Vec::with_capacity(n);
        for b in 0..dims.batch {
            for h in 0..dims.heads {
                for i in 0..dims.q_blocks {
                    keep.extend((0..dims.k_blocks).map(|j| u8::from(f(b, h, i, j))));
                }
            }
        }
        BlockMask::new(&keep, dims, block_size)?;
        Ok(BlockMaskBuf { keep, dims, block_size })
    }

    /// `pattern` over `ceil(q_len / block_size)` query and `ceil(k_len / block_size)` key
    /// blocks, one mask for every batch and head.
    pub fn from_pattern(pattern: &BlockPattern, block_size: usize, q_len: usize, k_len: usize) -> Result<Self> {
        check_block_size(block_size)?;
        let dims = BlockDims {
            batch: 1,
            heads: 1,
            q_blocks: q_len.div_ceil(block_size),
            k_blocks: k_len.div_ceil(block_size),
        };
        Self::from_fn(dims, block_size, |_, _, i, j| pattern.keeps(i, j, dims.k_blocks))
    }

    /// The mask, borrowed.
    pub fn view(&self) -> BlockMask<'_> {
        BlockMask { keep: &self.keep, dims: self.dims, block_size: self.block_size }
    }
}

impl From<BlockMask<'_>> for BlockMaskBuf {
    /// An owned copy of a borrowed (already checked) mask.
    fn from(m: BlockMask<'_>) -> Self {
        BlockMaskBuf { keep: m.keep.to_vec(), dims: m.dims, block_size: m.block_size }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::Shape4;

    fn dims(batch: usize, heads: usize, q_blocks: usize, k_blocks: usize) -> BlockDims {
        BlockDims { batch, heads, q_blocks, k_blocks }
    }

    fn message(e: AttnError) -> String {
        match e {
            AttnError::InvalidBlockMask(m) => m,
            other => panic!("expected InvalidBlockMask, got {other:?}"),
        }
    }

    #[test]
    fn misfits_are_typed_errors_naming_them() {
        let keep = [1u8, 0, 1, 1];
        assert!(message(BlockMask::new(&keep, dims(1, 1, 2, 2), 0).unwrap_err()).contains("block_size is 0"));
        assert!(message(BlockMask::new(&keep, dims(1, 1, 2, 3), 4).unwrap_err()).contains("4 entries"));
        assert!(message(BlockMask::new(&[], dims(1, 0, 2, 2), 4).unwrap_err()).contains("zero"));
        assert!(message(BlockMask::new(&[1, 2, 0, 1], dims(1, 1, 2, 2), 4).unwrap_err()).contains("entry 1 is 2"));
        let huge = dims(usize::MAX, 2, 1, 1);
        assert!(message(BlockMask::new(&keep, huge, 4).unwrap_err()).contains("overflow"));
        assert!(BlockMask::new(&keep, dims(1, 1, 2, 2), 4).is_ok());
    }

    #[test]
    fn positions_map_to_blocks_and_size_one_broadcasts() {
        // Two heads, three query blocks of 4 (the last ragged), two key blocks.
        let keep: Vec<u8> = (0..12).map(|i| u8::from(i % 3 != 0)).collect();
        let m = BlockMask::new(&keep, dims(1, 2, 3, 2), 4).unwrap();
        for (b, h, q, k) in [(0, 0, 0, 0), (5, 1, 9, 7), (2, 0, 4, 5), (0, 1, 11, 0)] {
            let flat = (h * 3 + q / 4) * 2 + k / 4;
            assert_eq!(m.keeps(b, h, q, k), flat % 3 != 0, "b {b} h {h} q {q} k {k}");
        }
        assert_eq!(m.kept_tiles(0, 0) + m.kept_tiles(0, 1), 8);
    }

    #[test]
    fn the_mask_must_fit_the_call() {
        let shape = AttnShape::self_attn(Shape4::new(2, 100, 4, 8).unwrap());
        let ok = BlockMaskBuf::from_fn(dims(2, 4, 13, 13), 8, |_, _, _, _| true).unwrap();
        ok.view().check(&shape, None).unwrap();
        for (d, want) in [
            (dims(3, 1, 13, 13), "batch 3"),
            (dims(1, 2, 13, 13), "heads 2"),
            (dims(1, 1, 12, 13), "needs 13 x 13"),
            (dims(1, 1, 13, 14), "needs 13 x 13"),
        ] {
            let m = BlockMaskBuf::from_fn(d, 8, |_, _, _, _| true).unwrap();
            let e = message(m.view().check(&shape, None).unwrap_err());
            assert!(e.contains(want), "{d:?}: {e}");
        }
        // Cross-attention: the key blocks follow the keys' length.
        let cross = AttnShape { q: Shape4::new(1, 16, 2, 8).unwrap(), kv: Shape4::new(1, 40, 2, 8).unwrap() };
        BlockMaskBuf::from_fn(dims(1, 1, 2, 5), 8, |_, _, _, _| true).unwrap().view().check(&cross, None).unwrap();
        // Packed: the longest sequence's square.
        let cu = [0, 10, 30, 35];
        let packed = PackedSequences::new(&cu).unwrap();
        let shape = AttnShape::self_attn(Shape4::new(1, 35, 2, 8).unwrap());
        let m = BlockMaskBuf::from_fn(dims(1, 2, 3, 3), 8, |_, _, _, _| true).unwrap();
        m.view().check(&shape, Some(packed)).unwrap();
        let e = message(m.view().check(&shape, None).unwrap_err());
        assert!(e.contains("needs 5 x 5"), "{e}");
    }

    /// The kept key blocks of query block `i`.
    fn row(p: &BlockPattern, i: usize, nb: usize) -> Vec<usize> {
        (0..nb + 2).filter(|&j| p.keeps(i, j, nb)).collect()
    }

    #[test]
    fn named_patterns_keep_their_index_sets() {
        let w3 = BlockPattern::LocalWindow { window_blocks: 3 };
        assert_eq!(row(&w3, 0, 6), [0, 1]);
        assert_eq!(row(&w3, 3, 6), [2, 3, 4]);
        assert_eq!(row(&w3, 5, 6), [4, 5]);
        let w4 = BlockPattern::LocalWindow { window_blocks: 4 };
        assert_eq!(row(&w4, 3, 8), [1, 2, 3, 4, 5], "an even window keeps W + 1 blocks");
        let ds = BlockPattern::DilatedSparse { rates: vec![1, 3, 4, 2] };
        assert_eq!(row(&ds, 4, 10), [0, 1, 3, 4, 5, 7, 8], "the first three rates only");
        let gl = BlockPattern::GlobalLocal { global_blocks: 2, radius: 1 };
        assert_eq!(row(&gl, 0, 8), [0, 1]);
        assert_eq!(row(&gl, 5, 8), [0, 1, 4, 5, 6]);
        assert_eq!(row(&gl, 7, 8), [0, 1, 6, 7]);
        assert_eq!(row(&gl, 2, 8), [0, 1, 2, 3], "the local band starts past the global blocks");
    }

    #[test]
    fn patterns_parse_from_and_print_as_the_file_metadata() {
        for s in ["local_window window_blocks=3", "dilated_sparse rates=1,2,4", "global_local global_blocks=1 radius=2"]
        {
            assert_eq!(BlockPattern::parse(s).unwrap().to_string(), s);
        }
        for (s, want) in [
            ("", "empty"),
            ("causal_blocks", "unknown block pattern"),
            ("local_window", "lacks `window_blocks`"),
            ("local_window window_blocks=x", "not a count"),
            ("local_window window_blocks=2 radius=1", "`radius` is not a parameter"),
            ("dilated_sparse rates=1,,2", "not a list"),
            ("global_local global_blocks=1", "lacks `radius`"),
            ("global_local global_blocks", "not key=value"),
        ] {
            let e = message(BlockPattern::parse(s).unwrap_err());
            assert!(e.contains(want), "`{s}`: {e}");
        }
    }

    #[test]
    fn the_python_config_maps_to_the_named_patterns() {
        let from = |t, w, g| BlockPattern::from_sparse_config(t, w, g, 64, &[1, 2, 4]);
        assert_eq!(from("local_window", 256, 0).unwrap(), BlockPattern::LocalWindow { window_blocks: 4 });
        assert_eq!(from("dilated_sparse", 256, 0).unwrap(), BlockPattern::DilatedSparse { rates: vec![1, 2, 4] });
        let gl = BlockPattern::GlobalLocal { global_blocks: 2, radius: 2 };
        assert_eq!(from("global_local", 256, 128).unwrap(), gl);
        assert!(message(from("hierarchical", 256, 0).unwrap_err()).contains("unknown pattern_type"));
        assert!(BlockPattern::from_sparse_config("local_window", 256, 0, 0, &[]).is_err());
    }

    #[test]
    fn a_pattern_mask_has_the_call_s_blocks() {
        let p = BlockPattern::LocalWindow { window_blocks: 3 };
        let m = BlockMaskBuf::from_pattern(&p, 16, 100, 40).unwrap();
        let v = m.view();
        assert_eq!(v.dims(), dims(1, 1, 7, 3));
        assert!(v.keeps(0, 0, 99, 39) == p.keeps(6, 2, 3) && !v.keeps(0, 0, 99, 39));
        assert!(v.keeps(3, 5, 17, 35));
    }
}
