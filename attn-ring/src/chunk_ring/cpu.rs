//! [`CpuChunks`]: the chunk ring's blocks on the CPU kernels (`attn_kernels::block`), with
//! host tensors ([`HostRows`]) and f32 accumulators per (batch, head); blocks over a slot of
//! heads and the head copies of the head strategies.

use attn_core::error::TensorName;
use attn_core::{AttnError, Element, PackedSequences, Result, Shape4, TensorView};
use attn_kernels::block::{Block, BlockGradients, BlockRows, Upstream, attend_block, attend_block_backward};

use super::{ChunkBlock, ChunkCompute, ChunkGrads, ChunkUpstream, HeadSlot, check_bsh_len, check_stats, rank_pieces};
use crate::compute::head_work::for_each_item;
use crate::plan::RingProblem;
use crate::protocol::wire::{elems_exact, f32s_exact, put_elems, put_f32s};

/// Contiguous `[batch, rows, heads, head_dim]` rows in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostRows<T> {
    pub shape: Shape4,
    pub data: Vec<T>,
}

impl<T: Element> HostRows<T> {
    /// Rows `rows` of a `[batch, seq, heads, head_dim]` view, copied contiguously.
    pub fn from_view_rows(view: &TensorView<'_, T>, rows: std::ops::Range<usize>) -> Result<Self> {
        let s = view.shape();
        if rows.end > s.seq || rows.is_empty() {
            return Err(AttnError::InvalidArgument(format!("rows {rows:?} of a view with {} rows", s.seq)));
        }
        let shape = Shape4::new(s.batch, rows.len(), s.heads, s.head_dim)?;
        let mut data = Vec::with_capacity(shape.numel());
        for b in 0..s.batch {
            for i in rows.clone() {
                for h in 0..s.heads {
                    data.extend_from_slice(view.row(b, i, h));
                }
            }
        }
        Ok(HostRows { shape, data })
    }

    /// This rank's pieces of its local rows `local` (`[batch, layout rows, heads, head_dim]`,
    /// ascending global order, as the plan ring takes them).
    pub fn rank_pieces(problem: &RingProblem, rank: usize, local: &TensorView<'_, T>) -> Result<Vec<Self>> {
        let mut at = 0;
        rank_pieces(problem, rank)
            .into_iter()
            .map(|r| {
                let piece = Self::from_view_rows(local, at..at + r.len());
                at += r.len();
                piece
            })
            .collect()
    }

    /// Pieces joined back into one `[batch, rows, heads, head_dim]` buffer.
    pub fn join(pieces: &[Self]) -> Vec<T> {
        let Some(first) = pieces.first() else { return Vec::new() };
        let row = first.shape.heads * first.shape.head_dim;
        let mut out = Vec::with_capacity(pieces.iter().map(|p| p.data.len()).sum());
        for b in 0..first.shape.batch {
            for p in pieces {
                let n = p.shape.seq * row;
                out.extend_from_slice(&p.data[b * n..(b + 1) * n]);
            }
        }
        out
    }

    /// Zeroed rows of `shape`.
    pub fn zeros(shape: Shape4) -> Self {
        HostRows { shape, data: vec![T::default(); shape.numel()] }
    }

    /// A copy of rows `rows` (every batch).
    pub fn slice_rows(&self, rows: std::ops::Range<usize>) -> Result<Self> {
        let s = self.shape;
        if rows.end > s.seq || rows.start > rows.end {
            return Err(AttnError::InvalidArgument(format!("rows {rows:?} of a piece with {} rows", s.seq)));
        }
        let shape = Shape4 { seq: rows.len(), ..s };
        let row = self.stride();
        let mut data = Vec::with_capacity(shape.numel());
        for b in 0..s.batch {
            let base = b * s.seq * row;
            data.extend_from_slice(&self.data[base + rows.start * row..base + rows.end * row]);
        }
        Ok(HostRows { shape, data })
    }

    /// Overwrite rows `at..at + src rows` (every batch) with `src`.
    pub fn write_rows(&mut self, at: usize, src: &Self) -> Result<()> {
        let (s, o) = (self.shape, src.shape);
        if (o.batch, o.heads, o.head_dim) != (s.batch, s.heads, s.head_dim) || at + o.seq > s.seq {
            let got = o.dims().to_vec();
            let expected = Shape4 { seq: s.seq.saturating_sub(at).min(o.seq), ..s }.dims().to_vec();
            return Err(AttnError::ShapeMismatch { tensor: TensorName::Other("rows written"), expected, got });
        }
        let row = self.stride();
        for b in 0..s.batch {
            let dst = b * s.seq * row + at * row;
            let src_rows = &src.data[b * o.seq * row..(b + 1) * o.seq * row];
            self.data[dst..dst + src_rows.len()].copy_from_slice(src_rows);
        }
        Ok(())
    }

    /// A copy of heads `heads` of every row.
    pub fn take_heads(&self, heads: std::ops::Range<usize>) -> Result<Self> {
        let s = self.shape;
        if heads.end > s.heads || heads.is_empty() {
            return Err(AttnError::InvalidArgument(format!("heads {heads:?} of rows with {} heads", s.heads)));
        }
        let shape = Shape4 { heads: heads.len(), ..s };
        let mut data = Vec::with_capacity(shape.numel());
        for row in self.data.chunks_exact(self.stride()) {
            data.extend_from_slice(&row[heads.start * s.head_dim..heads.end * s.head_dim]);
        }
        Ok(HostRows { shape, data })
    }

    /// Overwrite heads `first..first + src heads` of every row with `src` (same rows).
    pub fn put_heads(&mut self, first: usize, src: &Self) -> Result<()> {
        let (s, o) = (self.shape, src.shape);
        if (o.batch, o.seq, o.head_dim) != (s.batch, s.seq, s.head_dim) || first + o.heads > s.heads {
            let expected = Shape4 { heads: s.heads.saturating_sub(first).min(o.heads), ..s }.dims().to_vec();
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Other("heads written"),
                expected,
                got: o.dims().to_vec(),
            });
        }
        let (row, part) = (self.stride(), o.heads * o.head_dim);
        for (dst, src) in self.data.chunks_exact_mut(row).zip(src.data.chunks_exact(part)) {
            dst[first * s.head_dim..first * s.head_dim + part].copy_from_slice(src);
        }
        Ok(())
    }

    /// Element offset of row 0 of (batch, head).
    fn offset(&self, b: usize, h: usize) -> usize {
        (b * self.shape.seq * self.shape.heads + h) * self.shape.head_dim
    }

    fn stride(&self) -> usize {
        self.shape.heads * self.shape.head_dim
    }
}

/// The forward's f32 accumulators of one query piece, per (batch, head): `o` (`rows *
/// head_dim`, normalised) and `lse` (`rows`, `-inf` = nothing yet).
#[derive(Debug, Clone)]
pub struct HostPartial {
    pub shape: Shape4,
    pub o: Vec<Vec<f32>>,
    pub lse: Vec<Vec<f32>>,
}

/// f32 gradient accumulators per (batch, head), `rows * head_dim` each.
#[derive(Debug, Clone, PartialEq)]
pub struct HostAcc {
    pub shape: Shape4,
    pub data: Vec<Vec<f32>>,
}

/// f32 per-row values per (batch, head), `rows` each.
#[derive(Debug, Clone, PartialEq)]
pub struct HostRowStats {
    pub shape: Shape4,
    pub data: Vec<Vec<f32>>,
}

impl HostAcc {
    /// A copy of heads `heads` (every row).
    pub fn take_heads(&self, heads: std::ops::Range<usize>) -> Result<Self> {
        let s = self.shape;
        if heads.end > s.heads || heads.is_empty() {
            return Err(AttnError::InvalidArgument(format!("heads {heads:?} of accumulators with {} heads", s.heads)));
        }
        let data =
            (0..s.batch).flat_map(|b| heads.clone().map(move |h| b * s.heads + h)).map(|bh| self.data[bh].clone());
        Ok(HostAcc { shape: Shape4 { heads: heads.len(), ..s }, data: data.collect() })
    }

    /// Add `src` to heads `first..first + src heads` (same rows).
    pub fn add_heads(&mut self, first: usize, src: &Self) -> Result<()> {
        let (s, o) = (self.shape, src.shape);
        if (o.batch, o.seq, o.head_dim) != (s.batch, s.seq, s.head_dim) || first + o.heads > s.heads {
            let expected = Shape4 { heads: s.heads.saturating_sub(first).min(o.heads), ..s }.dims().to_vec();
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Other("heads added"),
                expected,
                got: o.dims().to_vec(),
            });
        }
        for (bh, x) in src.data.iter().enumerate() {
            let dst = &mut self.data[(bh / o.heads) * s.heads + first + bh % o.heads];
            dst.iter_mut().zip(x).for_each(|(a, &b)| *a += b);
        }
        Ok(())
    }
}

impl HostRowStats {
    /// As a `[batch, rows, heads]` buffer (the plan ring's lse layout).
    pub fn to_bsh(&self) -> Vec<f32> {
        let Shape4 { batch, seq, heads, .. } = self.shape;
        let mut out = vec![0.0; batch * seq * heads];
        for (bh, rows) in self.data.iter().enumerate() {
            let (b, h) = (bh / heads, bh % heads);
            for (i, &x) in rows.iter().enumerate() {
                out[(b * seq + i) * heads + h] = x;
            }
        }
        out
    }
}

/// The packed sequences the blocks apply (key padding rows come from the problem).
#[derive(Debug, Clone)]
pub struct CpuMasks {
    cu_seqlens: Option<Vec<usize>>,
}

impl CpuMasks {
    fn packing(&self) -> Result<Option<PackedSequences<'_>>> {
        self.cu_seqlens.as_deref().map(PackedSequences::new).transpose()
    }
}

/// The chunk ring's blocks on the CPU kernels; work split by (batch, head) (by key/value
/// head in the backward) over `threads` (0 or 1: the calling thread), bit-identical for
/// any count.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuChunks {
    pub threads: usize,
}

fn shape_error(tensor: TensorName, expected: Shape4, got: Shape4) -> AttnError {
    AttnError::ShapeMismatch { tensor, expected: expected.dims().to_vec(), got: got.dims().to_vec() }
}

/// Which heads a block attends: for each local query head its (global head index among
/// `total` heads, local key/value head).
struct BlockHeads {
    total: usize,
    first: usize,
    kv: Vec<usize>,
}

impl BlockHeads {
    /// The global head of local query head `h`.
    fn global(&self, h: usize) -> usize {
        self.first + h
    }
}

/// Check a block's shapes (k and v alike, batch and head_dim as q's; every head of the
/// problem: k/v heads dividing q's; a slot: the key/value heads its query heads read) and
/// map its heads.
fn check_block<T>(
    problem: &RingProblem,
    slot: HeadSlot,
    q: &HostRows<T>,
    k: &HostRows<T>,
    v: &HostRows<T>,
) -> Result<BlockHeads> {
    let (qs, ks) = (q.shape, k.shape);
    if v.shape != ks {
        return Err(shape_error(TensorName::Value, ks, v.shape));
    }
    if (ks.batch, ks.head_dim) != (qs.batch, qs.head_dim) {
        return Err(shape_error(TensorName::Key, Shape4 { seq: ks.seq, heads: ks.heads, ..qs }, ks));
    }
    let HeadSlot::Slot { first, kv_first } = slot else {
        if ks.heads == 0 || !qs.heads.is_multiple_of(ks.heads) {
            return Err(AttnError::KvHeadsNotDividing { heads: qs.heads, kv_heads: ks.heads });
        }
        let group = qs.heads / ks.heads;
        return Ok(BlockHeads { total: qs.heads, first: 0, kv: (0..qs.heads).map(|h| h / group).collect() });
    };
    let group = problem.group();
    let kv: Vec<usize> = (first..first + qs.heads).map(|h| (h / group).wrapping_sub(kv_first)).collect();
    if first + qs.heads > problem.heads || kv.iter().any(|&x| x >= ks.heads) {
        return Err(AttnError::InvalidArgument(format!(
            "a block of query heads {}..{} reading key/value heads from {} has {} key/value heads ({} query heads)",
            first,
            first + qs.heads,
            kv_first,
            ks.heads,
            problem.heads
        )));
    }
    Ok(BlockHeads { total: problem.heads, first, kv })
}

/// The rows of (batch `b`, head `h`) of `x` at positions `pos`.
fn head_rows<'a, T: Element>(x: &'a HostRows<T>, b: usize, h: usize, pos: &'a [usize]) -> BlockRows<'a, T> {
    BlockRows::new(&x.data[x.offset(b, h)..], x.stride(), pos)
}

fn positions(start: usize, n: usize) -> Vec<usize> {
    (start..start + n).collect()
}

impl<T: Element> ChunkCompute<T> for CpuChunks {
    type Rows = HostRows<T>;
    type Partial = HostPartial;
    type Acc = HostAcc;
    type RowStats = HostRowStats;
    type Masks = CpuMasks;

    fn shape_of(&self, rows: &HostRows<T>) -> Shape4 {
        rows.shape
    }

    fn masks(&self, problem: &RingProblem) -> Result<CpuMasks> {
        let masks = CpuMasks { cu_seqlens: problem.masks.cu_seqlens().map(<[usize]>::to_vec) };
        masks.packing()?;
        Ok(masks)
    }

    fn empty_partial(&self, q: Shape4) -> Result<HostPartial> {
        let bh = q.batch * q.heads;
        Ok(HostPartial {
            shape: q,
            o: vec![vec![0.0; q.seq * q.head_dim]; bh],
            lse: vec![vec![f32::NEG_INFINITY; q.seq]; bh],
        })
    }

    fn zero_acc(&self, shape: Shape4) -> Result<HostAcc> {
        Ok(HostAcc { shape, data: vec![vec![0.0; shape.seq * shape.head_dim]; shape.batch * shape.heads] })
    }

    fn forward_block(&self, block: &ChunkBlock<'_, HostRows<T>, CpuMasks>, partial: &mut HostPartial) -> Result<()> {
        let ChunkBlock { problem, masks, q, q_start, k, v, k_start, heads } = *block;
        let hs = check_block(problem, heads, q, k, v)?;
        if partial.shape != q.shape {
            return Err(shape_error(TensorName::Output, q.shape, partial.shape));
        }
        let (qs, cfg) = (q.shape, &problem.cfg);
        let (qpos, kpos) = (positions(q_start, qs.seq), positions(k_start, k.shape.seq));
        let (d, band, scale) = (qs.head_dim, cfg.band(), cfg.scale_for(qs.head_dim) as f32);
        let packing = masks.packing()?;
        let items: Vec<_> =
            partial.o.iter_mut().zip(partial.lse.iter_mut()).enumerate().map(|(bh, (o, l))| (bh, o, l)).collect();
        for_each_item(self.threads, items, |(bh, o, lse)| {
            let (b, h) = (bh / qs.heads, bh % qs.heads);
            let kvh = hs.kv[h];
            let qkv = [head_rows(q, b, h, &qpos), head_rows(k, b, kvh, &kpos), head_rows(v, b, kvh, &kpos)];
            for (_, pat) in cfg.head_patterns(hs.total, hs.global(h)).patterns {
                let mut blk = Block::new(&pat, band, scale, d, qkv);
                blk.key_padding = problem.padding_row(b);
                blk.packing = packing;
                blk.block_mask = problem.block_row(b, hs.global(h));
                attend_block(&blk, o, lse)?;
            }
            Ok(())
        })
    }

    fn finish_forward(&self, problem: &RingProblem, partial: &HostPartial) -> Result<(HostRows<T>, HostRowStats)> {
        self.finish_forward_slot(problem, partial, HeadSlot::Every)
    }

    fn finish_forward_slot(
        &self,
        problem: &RingProblem,
        partial: &HostPartial,
        slot: HeadSlot,
    ) -> Result<(HostRows<T>, HostRowStats)> {
        let s = partial.shape;
        // The rows' own heads, or the slot's global heads.
        let (total, first) = match slot {
            HeadSlot::Every => (s.heads, 0),
            HeadSlot::Slot { first, .. } => (problem.heads, first),
        };
        if first + s.heads > total {
            let message = format!("a partial of {} heads from head {first} of {total}", s.heads);
            return Err(AttnError::InvalidArgument(message));
        }
        let mut data = vec![T::default(); s.numel()];
        for (bh, o) in partial.o.iter().enumerate() {
            let (b, h) = (bh / s.heads, bh % s.heads);
            let scale = problem.cfg.head_patterns(total, first + h).out_scale as f32;
            for (i, row) in o.chunks_exact(s.head_dim).enumerate() {
                let at = ((b * s.seq + i) * s.heads + h) * s.head_dim;
                for (x, &y) in data[at..at + s.head_dim].iter_mut().zip(row) {
                    *x = T::from_f32(y * scale);
                }
            }
        }
        Ok((HostRows { shape: s, data }, HostRowStats { shape: s, data: partial.lse.clone() }))
    }

    fn delta(
        &self,
        grad_out: &HostRows<T>,
        out: &HostRows<T>,
        lse_grad: Option<(&HostRowStats, &HostRowStats)>,
    ) -> Result<HostRowStats> {
        let s = out.shape;
        if grad_out.shape != s {
            return Err(shape_error(TensorName::GradOutput, s, grad_out.shape));
        }
        for (name, stats) in lse_grad.iter().flat_map(|(g, l)| [(TensorName::GradLse, *g), (TensorName::Lse, *l)]) {
            check_stats(name, <Self as ChunkCompute<T>>::stats_shape(self, stats), stats.shape, s)?;
        }
        let mut data = vec![vec![0.0f32; s.seq]; s.batch * s.heads];
        for (row, (g, o)) in grad_out.data.chunks_exact(s.head_dim).zip(out.data.chunks_exact(s.head_dim)).enumerate() {
            let (h, i, b) = (row % s.heads, (row / s.heads) % s.seq, row / (s.heads * s.seq));
            let dot: f32 = g.iter().zip(o).map(|(g, o)| g.to_f32() * o.to_f32()).sum();
            // A row that attends nothing (lse -inf) takes none of the LSE's gradient.
            let from_lse = lse_grad
                .map(|(gl, l)| (gl.data[b * s.heads + h][i], l.data[b * s.heads + h][i]))
                .filter(|&(_, l)| l != f32::NEG_INFINITY)
                .map_or(0.0, |(gl, _)| gl);
            data[b * s.heads + h][i] = dot - from_lse;
        }
        Ok(HostRowStats { shape: s, data })
    }

    fn stats_shape(&self, stats: &HostRowStats) -> Option<Shape4> {
        let s = stats.shape;
        let fills = stats.data.len() == s.batch * s.heads && stats.data.iter().all(|r| r.len() == s.seq);
        fills.then_some(Shape4 { head_dim: 1, ..s })
    }

    fn stats_from_bsh(&self, shape: Shape4, values: &[f32]) -> Result<HostRowStats> {
        check_bsh_len(shape, values.len())?;
        let Shape4 { batch, seq, heads, .. } = shape;
        let data = (0..batch * heads)
            .map(|bh| (0..seq).map(|i| values[((bh / heads) * seq + i) * heads + bh % heads]).collect())
            .collect();
        Ok(HostRowStats { shape, data })
    }

    fn backward_block(
        &self,
        block: &ChunkBlock<'_, HostRows<T>, CpuMasks>,
        upstream: &ChunkUpstream<'_, HostRows<T>, HostRowStats>,
        grads: ChunkGrads<'_, HostAcc>,
    ) -> Result<()> {
        let ChunkBlock { problem, masks, q, q_start, k, v, k_start, heads } = *block;
        let ChunkUpstream { grad_out, lse, delta } = *upstream;
        let hs = check_block(problem, heads, q, k, v)?;
        let (qs, ks, cfg) = (q.shape, k.shape, &problem.cfg);
        for (name, got, want) in [
            (TensorName::GradOutput, grad_out.shape, qs),
            (TensorName::Lse, lse.shape, qs),
            (TensorName::Other("delta"), delta.shape, qs),
            (TensorName::GradQuery, grads.dq.shape, qs),
            (TensorName::GradKey, grads.dk.shape, ks),
            (TensorName::GradValue, grads.dv.shape, ks),
        ] {
            if got != want {
                return Err(shape_error(name, want, got));
            }
        }
        let (qpos, kpos) = (positions(q_start, qs.seq), positions(k_start, ks.seq));
        let (d, band, scale) = (qs.head_dim, cfg.band(), cfg.scale_for(qs.head_dim) as f32);
        let packing = masks.packing()?;
        // One item per (batch, k/v head): its dk and dv, and the dq of the query heads reading it.
        let mut readers: Vec<Vec<(usize, &mut Vec<f32>)>> = (0..ks.batch * ks.heads).map(|_| Vec::new()).collect();
        for (bh, dq) in grads.dq.data.iter_mut().enumerate() {
            let (b, h) = (bh / qs.heads, bh % qs.heads);
            readers[b * ks.heads + hs.kv[h]].push((h, dq));
        }
        let items: Vec<_> = grads.dk.data.iter_mut().zip(grads.dv.data.iter_mut()).zip(readers).enumerate().collect();
        for_each_item(self.threads, items, |(kbh, ((dk, dv), dqs))| {
            let (b, kvh) = (kbh / ks.heads, kbh % ks.heads);
            for (h, dq) in dqs {
                let bh = b * qs.heads + h;
                let qkv = [head_rows(q, b, h, &qpos), head_rows(k, b, kvh, &kpos), head_rows(v, b, kvh, &kpos)];
                let hp = cfg.head_patterns(hs.total, hs.global(h));
                let up = Upstream {
                    grad_out: head_rows(grad_out, b, h, &qpos),
                    grad_scale: hp.out_scale as f32,
                    lse: &lse.data[bh],
                    delta: &delta.data[bh],
                };
                for (_, pat) in hp.patterns {
                    let mut blk = Block::new(&pat, band, scale, d, qkv);
                    blk.key_padding = problem.padding_row(b);
                    blk.packing = packing;
                    blk.block_mask = problem.block_row(b, hs.global(h));
                    let g = BlockGradients { dq: dq.as_mut_slice(), dk: dk.as_mut_slice(), dv: dv.as_mut_slice() };
                    attend_block_backward(&blk, &up, g)?;
                }
            }
            Ok(())
        })
    }

    fn store_acc(&self, acc: &HostAcc) -> Result<HostRows<T>> {
        let s = acc.shape;
        let mut data = vec![T::default(); s.numel()];
        for (bh, rows) in acc.data.iter().enumerate() {
            let (b, h) = (bh / s.heads, bh % s.heads);
            for (i, row) in rows.chunks_exact(s.head_dim).enumerate() {
                let at = ((b * s.seq + i) * s.heads + h) * s.head_dim;
                data[at..at + s.head_dim].iter_mut().zip(row).for_each(|(x, &y)| *x = T::from_f32(y));
            }
        }
        Ok(HostRows { shape: s, data })
    }

    fn rows_to_bytes(&self, rows: &HostRows<T>, out: &mut Vec<u8>) -> Result<()> {
        put_elems(out, &rows.data);
        Ok(())
    }

    fn rows_from_bytes(&self, shape: Shape4, bytes: &[u8]) -> Result<HostRows<T>> {
        Ok(HostRows { shape, data: elems_exact(bytes, shape.numel())? })
    }

    fn acc_to_bytes(&self, acc: &HostAcc, out: &mut Vec<u8>) -> Result<()> {
        acc.data.iter().for_each(|x| put_f32s(out, x));
        Ok(())
    }

    fn acc_from_bytes(&self, shape: Shape4, bytes: &[u8]) -> Result<HostAcc> {
        let flat = f32s_exact(bytes, shape.numel())?;
        let data = flat.chunks_exact(shape.seq * shape.head_dim).map(<[f32]>::to_vec).collect();
        Ok(HostAcc { shape, data })
    }

    fn acc_bytes(&self, acc: &HostAcc) -> usize {
        acc.data.iter().map(|x| x.len() * 4).sum()
    }

    fn slice_rows(&self, src: &HostRows<T>, rows: std::ops::Range<usize>) -> Result<HostRows<T>> {
        src.slice_rows(rows)
    }

    fn zero_rows(&self, shape: Shape4) -> Result<HostRows<T>> {
        Ok(HostRows::zeros(shape))
    }

    fn write_rows(&self, dst: &mut HostRows<T>, at: usize, src: &HostRows<T>) -> Result<()> {
        dst.write_rows(at, src)
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn take_heads(&self, src: &HostRows<T>, heads: std::ops::Range<usize>) -> Result<HostRows<T>> {
        src.take_heads(heads)
    }

    fn put_heads(&self, dst: &mut HostRows<T>, first: usize, src: &HostRows<T>) -> Result<()> {
        dst.put_heads(first, src)
    }

    fn take_acc_heads(&self, src: &HostAcc, heads: std::ops::Range<usize>) -> Result<HostAcc> {
        src.take_heads(heads)
    }

    fn add_acc_heads(&self, dst: &mut HostAcc, first: usize, src: &HostAcc) -> Result<()> {
        dst.add_heads(first, src)
    }

    fn stats_as_acc(&self, stats: &HostRowStats) -> Result<HostAcc> {
        let shape = <Self as ChunkCompute<T>>::stats_shape(self, stats)
            .ok_or_else(|| AttnError::InvalidArgument("per-row values that do not fill their shape".into()))?;
        Ok(HostAcc { shape, data: stats.data.clone() })
    }

    fn acc_as_stats(&self, acc: &HostAcc) -> Result<HostRowStats> {
        if acc.shape.head_dim != 1 {
            let message = format!("an accumulator of head_dim {} as per-row values", acc.shape.head_dim);
            return Err(AttnError::InvalidArgument(message));
        }
        Ok(HostRowStats { shape: acc.shape, data: acc.data.clone() })
    }
}
