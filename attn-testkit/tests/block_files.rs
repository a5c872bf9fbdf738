//! The block masks of `conformance/blocks/`: each is a valid mask that fits its call (the
//! `block_size`, shapes and packing of its metadata), and each named pattern a file states
//! (`block_pattern`) builds exactly the file's mask; a pattern one parameter away builds
//! another mask on some file, so the comparison is not vacuous.

use attn_core::{AttnShape, BlockDims, BlockMask, BlockMaskBuf, BlockPattern, PackedSequences, Shape4};
use safetensors::{Dtype, SafeTensors};

/// The eight files and the four of them that state a named pattern.
const FILES: usize = 8;
const NAMED: usize = 4;

struct BlockFile {
    name: String,
    mask: Vec<u8>,
    dims: BlockDims,
    block_size: usize,
    shape: AttnShape,
    cu_seqlens: Option<Vec<usize>>,
    pattern: Option<String>,
}

fn load_all() -> Vec<BlockFile> {
    let dir = attn_testkit::golden::golden_dir().join("blocks");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    paths.sort();
    assert_eq!(paths.len(), FILES, "the {FILES} files of {}", dir.display());
    paths.iter().map(|p| load(p)).collect()
}

fn load(path: &std::path::Path) -> BlockFile {
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let bytes = std::fs::read(path).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone().unwrap_or_default();
    let num = |k: &str| -> usize { meta.get(k).unwrap_or_else(|| panic!("{name}: no `{k}`")).parse().unwrap() };
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let m = st.tensor("block_mask").unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(m.dtype(), Dtype::U8, "{name}: block_mask dtype");
    let s = m.shape();
    assert_eq!(s.len(), 4, "{name}: block_mask rank");
    let dims = BlockDims { batch: s[0], heads: s[1], q_blocks: s[2], k_blocks: s[3] };
    let (batch, seq, heads, kv_heads, d) =
        (num("batch"), num("seq_len"), num("num_heads"), num("num_kv_heads"), num("head_dim"));
    let kv_seq = meta.get("kv_seq_len").map_or(seq, |v| v.parse().unwrap());
    let shape = AttnShape {
        q: Shape4::new(batch, seq, heads, d).unwrap(),
        kv: Shape4::new(batch, kv_seq, kv_heads, d).unwrap(),
    };
    let cu_seqlens = st
        .tensor("cu_seqlens")
        .ok()
        .map(|t| t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as usize).collect());
    BlockFile {
        mask: m.data().to_vec(),
        dims,
        block_size: num("block_size"),
        shape,
        cu_seqlens,
        pattern: meta.get("block_pattern").cloned(),
        name,
    }
}

#[test]
fn every_file_holds_a_mask_that_fits_its_call() {
    for f in load_all() {
        let mask = BlockMask::new(&f.mask, f.dims, f.block_size).unwrap_or_else(|e| panic!("{}: {e}", f.name));
        let packing = f.cu_seqlens.as_deref().map(|cu| PackedSequences::new(cu).unwrap());
        mask.check(&f.shape, packing).unwrap_or_else(|e| panic!("{}: {e}", f.name));
        let kept: usize = (0..f.dims.batch)
            .flat_map(|b| (0..f.dims.heads).map(move |h| (b, h)))
            .map(|(b, h)| mask.kept_tiles(b, h))
            .sum();
        let tiles = f.dims.len().unwrap();
        assert!(
            kept > 0 && kept < tiles,
            "{}: {kept} of {tiles} tiles kept: a mask that removes nothing or everything",
            f.name
        );
    }
}

/// The mask `p` builds for file `f`'s call (packed: over the longest sequence).
fn built(p: &BlockPattern, f: &BlockFile) -> Vec<u8> {
    let (nq, nk) = match &f.cu_seqlens {
        Some(cu) => {
            let longest = cu.windows(2).map(|w| w[1] - w[0]).max().unwrap();
            (longest, longest)
        }
        None => (f.shape.q.seq, f.shape.kv.seq),
    };
    BlockMaskBuf::from_pattern(p, f.block_size, nq, nk).unwrap().view().keep().to_vec()
}

/// `p` with each parameter moved by one, where it can move.
fn neighbours(p: &BlockPattern) -> Vec<BlockPattern> {
    match p {
        BlockPattern::LocalWindow { window_blocks: w } => {
            [w + 2, w.saturating_sub(2)].map(|window_blocks| BlockPattern::LocalWindow { window_blocks }).to_vec()
        }
        BlockPattern::DilatedSparse { rates } => (0..rates.len().min(3))
            .map(|i| {
                let mut r = rates.clone();
                r[i] += 1;
                BlockPattern::DilatedSparse { rates: r }
            })
            .collect(),
        BlockPattern::GlobalLocal { global_blocks: g, radius: r } => vec![
            BlockPattern::GlobalLocal { global_blocks: g + 1, radius: *r },
            BlockPattern::GlobalLocal { global_blocks: *g, radius: r + 1 },
        ],
    }
}

#[test]
fn each_named_pattern_builds_its_file_s_mask_and_its_neighbours_do_not() {
    let files = load_all();
    let mut named = 0;
    for f in &files {
        let Some(text) = &f.pattern else { continue };
        let p = BlockPattern::parse(text).unwrap_or_else(|e| panic!("{}: {e}", f.name));
        assert_eq!(p.to_string(), *text, "{}: the pattern prints as the file states it", f.name);
        assert_eq!((f.dims.batch, f.dims.heads), (1, 1), "{}: a named pattern serves every batch and head", f.name);
        assert!(built(&p, f) == f.mask, "{}: `{text}` builds another mask than the file's", f.name);
        for other in neighbours(&p) {
            assert!(built(&other, f) != f.mask, "{}: `{other}` builds the file's mask too", f.name);
        }
        named += 1;
    }
    assert_eq!(named, NAMED, "files with a named pattern");
}
