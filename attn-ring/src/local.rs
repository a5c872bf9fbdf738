//! One rank's rows in f32 with their global positions, and key blocks: the
//! selected k/v rows of one owner for a list of (pattern, head) pairs, encoded
//! for the wire and decoded on arrival.

use attn_core::{Element, Result, TensorView};

use crate::block_math::{KeyBlock, Mask, Rows};
use crate::plan::{PatternHead, Plan};
use crate::wire::{MsgKind, Reader, begin, put_elems};

/// This rank's q/k/v rows as f32, one `[rows, d]` buffer per (batch, head).
#[derive(Debug)]
pub(crate) struct Local {
    pub pos: Vec<usize>,
    pub batch: usize,
    pub heads: usize,
    pub d: usize,
    pub q: Vec<Vec<f32>>,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

/// One `[rows, d]` f32 buffer per (batch, head) of a view.
pub(crate) fn split_heads<T: Element>(x: &TensorView<'_, T>) -> Vec<Vec<f32>> {
    let s = x.shape();
    let mut out = Vec::with_capacity(s.batch * s.heads);
    for b in 0..s.batch {
        for h in 0..s.heads {
            let mut buf = Vec::with_capacity(s.seq * s.head_dim);
            for i in 0..s.seq {
                buf.extend(x.row(b, i, h).iter().map(|e| e.to_f32()));
            }
            out.push(buf);
        }
    }
    out
}

impl Local {
    /// Convert this rank's views (already checked against the plan).
    pub fn new<T: Element>(
        pos: Vec<usize>,
        q: &TensorView<'_, T>,
        k: &TensorView<'_, T>,
        v: &TensorView<'_, T>,
    ) -> Self {
        let s = q.shape();
        Local {
            pos,
            batch: s.batch,
            heads: s.heads,
            d: s.head_dim,
            q: split_heads(q),
            k: split_heads(k),
            v: split_heads(v),
        }
    }

    pub fn rows(&self) -> usize {
        self.pos.len()
    }

    /// Buffer index of (batch, head).
    pub fn bh(&self, b: usize, h: usize) -> usize {
        b * self.heads + h
    }

    /// Query rows of (batch, head).
    pub fn q_rows(&self, bh: usize) -> Rows<'_> {
        Rows { pos: &self.pos, data: &self.q[bh] }
    }

    /// Local indices of global positions (which this rank holds).
    pub fn indices(&self, positions: &[usize]) -> Vec<usize> {
        positions.iter().map(|p| self.pos.partition_point(|&x| x < *p)).collect()
    }

    /// All of this rank's k/v rows of (batch, head) as a key block (the kernel selects).
    pub fn own_keys(&self, bh: usize) -> KeyBlock<'_> {
        KeyBlock { pos: &self.pos, k: &self.k[bh], v: &self.v[bh] }
    }

    /// Copy rows `idx` of `src` into a contiguous buffer.
    pub fn gather(&self, src: &[f32], idx: &[usize]) -> Vec<f32> {
        let d = self.d;
        let mut out = Vec::with_capacity(idx.len() * d);
        for &j in idx {
            out.extend_from_slice(&src[j * d..(j + 1) * d]);
        }
        out
    }
}

/// Selected k/v rows of one owner for a list of (pattern, head) pairs, for every batch.
#[derive(Debug)]
pub(crate) struct Block {
    /// Global positions per pair.
    pub pos: Vec<Vec<usize>>,
    /// k and v rows per (batch, pair): index `b * pairs + i`.
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

impl Block {
    /// This rank's own rows at `pos[i]` for pair `i`.
    pub fn from_local(local: &Local, pairs: &[PatternHead], pos: Vec<Vec<usize>>) -> Self {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for b in 0..local.batch {
            for (ph, p) in pairs.iter().zip(&pos) {
                let idx = local.indices(p);
                let bh = local.bh(b, ph.head);
                k.push(local.gather(&local.k[bh], &idx));
                v.push(local.gather(&local.v[bh], &idx));
            }
        }
        Block { pos, k, v }
    }

    /// Encode as a message of `kind` (rows in dtype `T`).
    pub fn encode<T: Element>(&self, kind: MsgKind, owner: usize, step: usize) -> Vec<u8> {
        let n: usize = self.k.iter().map(Vec::len).sum::<usize>() * 2 * T::DTYPE.size();
        let mut out = begin(kind, owner, step, n);
        for (k, v) in self.k.iter().zip(&self.v) {
            put_elems::<T>(&mut out, k);
            put_elems::<T>(&mut out, v);
        }
        out
    }

    /// Decode a message of `kind` whose pairs have positions `pos`.
    #[allow(clippy::too_many_arguments)]
    pub fn decode<T: Element>(
        bytes: &[u8],
        kind: MsgKind,
        owner: usize,
        step: usize,
        rank: usize,
        batch: usize,
        d: usize,
        pos: Vec<Vec<usize>>,
    ) -> Result<Self> {
        let mut rd = Reader::open(bytes, kind, owner, step, rank)?;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for _ in 0..batch {
            for p in &pos {
                let (mut kb, mut vb) = (Vec::new(), Vec::new());
                rd.elems::<T>(p.len() * d, &mut kb)?;
                rd.elems::<T>(p.len() * d, &mut vb)?;
                k.push(kb);
                v.push(vb);
            }
        }
        rd.finish()?;
        Ok(Block { pos, k, v })
    }

    /// The key block of (batch `b`, pair `i`).
    pub fn keys(&self, b: usize, i: usize) -> KeyBlock<'_> {
        let j = b * self.pos.len() + i;
        KeyBlock { pos: &self.pos[i], k: &self.k[j], v: &self.v[j] }
    }
}

/// The mask of a pair.
pub(crate) fn mask_of(plan: &Plan, ph: &PatternHead) -> Mask {
    let pr = &plan.problem;
    Mask { pat: ph.pat, causal: pr.cfg.causal(), scale: pr.cfg.scale_for(pr.head_dim) as f32, d: pr.head_dim }
}
