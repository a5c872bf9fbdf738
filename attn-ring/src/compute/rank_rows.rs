//! One rank's rows (views of the caller's buffers) with their global positions, and key blocks: the
//! selected k/v rows of one owner for a list of (pattern, head) pairs, encoded
//! for the wire and decoded on arrival.

use attn_core::{Element, Result, TensorView};

use crate::compute::kernel_bridge::{KeyBlock, Mask, Rows};
use crate::plan::{PatternHead, Plan};
use crate::protocol::wire::{Expected, MsgKind, Reader, begin, get_elems, put_elems};

/// This rank's q/k/v rows (the caller's views, not copied) with their global positions.
/// k and v have `kv_heads` heads, each read by `heads / kv_heads` query heads.
#[derive(Debug)]
pub(crate) struct Local<'a, T> {
    pub pos: Vec<usize>,
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub d: usize,
    q: TensorView<'a, T>,
    k: TensorView<'a, T>,
    v: TensorView<'a, T>,
}

/// The data of `(b, h)` of a `[batch, seq, heads, d]` view from its first row, and the row stride.
pub(crate) fn head_rows<'v, T: Element>(x: &TensorView<'v, T>, b: usize, h: usize) -> (&'v [T], usize) {
    (&x.data()[x.offset(b, 0, h)..], x.strides()[1])
}

impl<'a, T: Element> Local<'a, T> {
    /// This rank's views (already checked against the plan).
    pub fn new(pos: Vec<usize>, q: TensorView<'a, T>, k: TensorView<'a, T>, v: TensorView<'a, T>) -> Self {
        let s = q.shape();
        Local { pos, batch: s.batch, heads: s.heads, kv_heads: k.shape().heads, d: s.head_dim, q, k, v }
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Buffer index of (batch, key/value head).
    pub fn kv_bh(&self, b: usize, kvh: usize) -> usize {
        b * self.kv_heads + kvh
    }

    /// The (batch, key/value head) buffer index that (batch, query head) `bh` reads.
    pub fn kv_of(&self, bh: usize) -> usize {
        self.kv_bh(bh / self.heads, (bh % self.heads) / self.group())
    }

    pub fn rows(&self) -> usize {
        self.pos.len()
    }

    /// Buffer index of (batch, head).
    pub fn bh(&self, b: usize, h: usize) -> usize {
        b * self.heads + h
    }

    /// Rows of q's (batch, query head) `bh`.
    fn q_rows_of(&self, bh: usize) -> (&'a [T], usize) {
        head_rows(&self.q, bh / self.heads, bh % self.heads)
    }

    /// Rows of k's or v's (batch, key/value head) `kbh`.
    fn kv_rows_of(&self, x: &TensorView<'a, T>, kbh: usize) -> (&'a [T], usize) {
        head_rows(x, kbh / self.kv_heads, kbh % self.kv_heads)
    }

    /// Query rows of (batch, head).
    pub fn q_rows(&self, bh: usize) -> Rows<'_, T> {
        let (data, stride) = self.q_rows_of(bh);
        Rows { pos: &self.pos, data, stride }
    }

    /// The caller's q data of (batch, head) from its first row, and the row stride.
    pub fn q_strided(&self, bh: usize) -> (&'a [T], usize) {
        self.q_rows_of(bh)
    }

    /// Query rows `range` of (batch, head).
    pub fn q_rows_range(&self, bh: usize, range: std::ops::Range<usize>) -> Rows<'_, T> {
        let (data, stride) = self.q_rows_of(bh);
        let start = (range.start * stride).min(data.len());
        Rows { pos: &self.pos[range], data: &data[start..], stride }
    }

    /// Local indices of global positions (which this rank holds).
    pub fn indices(&self, positions: &[usize]) -> Vec<usize> {
        positions.iter().map(|p| self.pos.partition_point(|&x| x < *p)).collect()
    }

    /// All of this rank's k/v rows that (batch, query head) `bh` reads, as a key block
    /// (the kernel selects).
    pub fn own_keys(&self, bh: usize) -> KeyBlock<'_, T> {
        let kbh = self.kv_of(bh);
        let ((k, stride), (v, _)) = (self.kv_rows_of(&self.k, kbh), self.kv_rows_of(&self.v, kbh));
        KeyBlock { pos: &self.pos, k, v, stride }
    }

    /// Encode this rank's k/v rows at global positions `pos[i]` of wire pair `i` (its
    /// key/value head), for every batch, as a message of `kind` (the layout
    /// [`Block::decode`] reads), straight from the caller's buffers.
    pub fn encode_rows(
        &self,
        pairs: &[PatternHead],
        pos: &[Vec<usize>],
        kind: MsgKind,
        owner: usize,
        step: usize,
    ) -> Vec<u8> {
        let d = self.d;
        let rows: usize = pos.iter().map(Vec::len).sum();
        let mut out = begin(kind, owner, step, self.batch * rows * 2 * d * T::DTYPE.size());
        for b in 0..self.batch {
            for (ph, p) in pairs.iter().zip(pos) {
                let idx = self.indices(p);
                let kbh = self.kv_bh(b, ph.head);
                for x in [&self.k, &self.v] {
                    let (data, stride) = self.kv_rows_of(x, kbh);
                    for &j in &idx {
                        put_elems(&mut out, &data[j * stride..j * stride + d]);
                    }
                }
            }
        }
        out
    }
}

/// Selected k/v rows of one owner for a list of (pattern, head) pairs, for every batch.
#[derive(Debug)]
pub(crate) struct Block<T> {
    /// Global positions per pair.
    pub pos: Vec<Vec<usize>>,
    /// k and v rows per (batch, pair): index `b * pairs + i`.
    pub k: Vec<Vec<T>>,
    pub v: Vec<Vec<T>>,
}

impl<T: Element> Block<T> {
    /// Decode every part of a checked raw block.
    pub fn from_raw(raw: &RawBlock, batch: usize, d: usize) -> Self {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for b in 0..batch {
            for i in 0..raw.pos.len() {
                let (kb, vb) = raw.part::<T>(b, i, d);
                k.push(kb);
                v.push(vb);
            }
        }
        Block { pos: raw.pos.clone(), k, v }
    }

    /// Decode a message (`want`: its kind, owner and step) whose pairs have positions `pos`.
    pub fn decode(bytes: &[u8], want: Expected, batch: usize, d: usize, pos: Vec<Vec<usize>>) -> Result<Self> {
        let mut rd = Reader::open(bytes, want)?;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for _ in 0..batch {
            for p in &pos {
                let (mut kb, mut vb) = (Vec::new(), Vec::new());
                rd.elems(p.len() * d, &mut kb)?;
                rd.elems(p.len() * d, &mut vb)?;
                k.push(kb);
                v.push(vb);
            }
        }
        rd.finish()?;
        Ok(Block { pos, k, v })
    }

    /// The key block of (batch `b`, pair `i`).
    pub fn keys(&self, b: usize, i: usize, d: usize) -> KeyBlock<'_, T> {
        let j = b * self.pos.len() + i;
        KeyBlock { pos: &self.pos[i], k: &self.k[j], v: &self.v[j], stride: d }
    }
}

/// A received block kept as its message bytes; the k/v rows of one (batch, pair)
/// are decoded only when needed (so at most one head's rows exist decoded).
#[derive(Debug)]
pub(crate) struct RawBlock {
    bytes: Vec<u8>,
    pub pos: Vec<Vec<usize>>,
    /// Byte offset of the k rows of (batch, pair), index `b * pairs + i`.
    offsets: Vec<usize>,
}

impl RawBlock {
    /// Check the header and the length against the plan's positions.
    pub fn new<T: Element>(
        bytes: Vec<u8>,
        want: Expected,
        batch: usize,
        d: usize,
        pos: Vec<Vec<usize>>,
    ) -> Result<Self> {
        let mut rd = Reader::open(&bytes, want)?;
        let mut offsets = Vec::with_capacity(batch * pos.len());
        for _ in 0..batch {
            for p in &pos {
                offsets.push(rd.position());
                rd.skip(2 * p.len() * d * T::DTYPE.size())?;
            }
        }
        rd.finish()?;
        Ok(RawBlock { bytes, pos, offsets })
    }

    /// Decode rows `rows` of the k and v of (batch `b`, pair `i`) into `k` and `v`
    /// (cleared first), so a caller can walk a long part with small reused buffers.
    pub fn part_rows<T: Element>(
        &self,
        b: usize,
        i: usize,
        d: usize,
        rows: std::ops::Range<usize>,
        k: &mut Vec<T>,
        v: &mut Vec<T>,
    ) {
        let (es, n) = (d * T::DTYPE.size(), self.pos[i].len() * d * T::DTYPE.size());
        let at = self.offsets[b * self.pos.len() + i];
        let (lo, hi) = (rows.start * es, rows.end * es);
        k.clear();
        v.clear();
        get_elems(&self.bytes[at + lo..at + hi], k);
        get_elems(&self.bytes[at + n + lo..at + n + hi], v);
    }

    /// Decoded k and v rows of (batch `b`, pair `i`).
    pub fn part<T: Element>(&self, b: usize, i: usize, d: usize) -> (Vec<T>, Vec<T>) {
        let n = self.pos[i].len() * d * T::DTYPE.size();
        let at = self.offsets[b * self.pos.len() + i];
        let (mut k, mut v) = (Vec::new(), Vec::new());
        get_elems(&self.bytes[at..at + n], &mut k);
        get_elems(&self.bytes[at + n..at + 2 * n], &mut v);
        (k, v)
    }
}

/// The mask of a pair in batch row `b` for query head `h` (a pair of a wire list names a
/// key/value head; the block mask is the query head's).
pub(crate) fn mask_of<'p>(plan: &'p Plan, ph: &PatternHead, b: usize, h: usize) -> Mask<'p> {
    let pr = &plan.problem;
    Mask {
        pat: ph.pat,
        band: pr.cfg.band(),
        scale: pr.cfg.scale_for(pr.head_dim) as f32,
        d: pr.head_dim,
        key_padding: pr.padding_row(b),
        packing: plan.placed(ph.pat).packing,
        blocks: pr.block_row(b, h),
    }
}
