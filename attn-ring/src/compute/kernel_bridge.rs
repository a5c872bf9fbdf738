//! The bridge to `attn_kernels::block`: attention of one rank's query rows onto
//! one key block, all rows carrying global positions (the kernel applies the
//! pattern's selection, segment and band), LSE-merged forward and
//! accumulated (`+=`) backward, in f32.

use attn_core::{Band, Element, PackedSequences, Result, SegmentPattern};
use attn_kernels::block::{
    Block, BlockGradients, BlockRows, HeadBlockMask, Upstream, attend_block, attend_block_backward,
};

/// Rows of one (batch, head): row `i` is `data[i * stride..][..d]` at global position `pos[i]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows<'a, T> {
    pub pos: &'a [usize],
    pub data: &'a [T],
    pub stride: usize,
}

/// A key/value block with the global position of each row (rows as in [`Rows`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyBlock<'a, T> {
    pub pos: &'a [usize],
    pub k: &'a [T],
    pub v: &'a [T],
    pub stride: usize,
}

impl<'a, T> KeyBlock<'a, T> {
    /// The rows whose positions lie in `lo..hi`, for a block whose positions ascend (a
    /// binary search; callers check the order once).
    pub(crate) fn positions_within(&self, lo: usize, hi: usize) -> KeyBlock<'a, T> {
        let a = self.pos.partition_point(|&p| p < lo);
        let b = self.pos.partition_point(|&p| p < hi).max(a);
        let at = (a * self.stride).min(self.k.len()).min(self.v.len());
        KeyBlock { pos: &self.pos[a..b], k: &self.k[at..], v: &self.v[at..], stride: self.stride }
    }
}

/// Mask parameters of one call: the pattern, the band, the key padding of the batch
/// row (by global position), the packed sequences, the block mask of the batch row and
/// query head.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mask<'a> {
    pub pat: SegmentPattern,
    pub band: Band,
    pub scale: f32,
    pub d: usize,
    pub key_padding: Option<&'a [bool]>,
    pub packing: Option<PackedSequences<'a>>,
    pub blocks: Option<HeadBlockMask<'a>>,
}

/// Per-query inputs of the backward: final lse, the caller's grad_out rows (`data`,
/// `stride`, read in place) with `go_scale = out_scale`, `delta = grad_out . out - grad_lse`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GradRows<'a, T> {
    pub lse: &'a [f32],
    pub go: &'a [T],
    pub go_stride: usize,
    pub go_scale: f32,
    pub delta: &'a [f32],
}

/// The kernels' view of query rows `q` against `keys` under `m`.
fn block<'a, T: Element>(q: Rows<'a, T>, keys: KeyBlock<'a, T>, m: &'a Mask<'a>) -> Block<'a, T> {
    let k = BlockRows::new(keys.k, keys.stride, keys.pos);
    let v = BlockRows::new(keys.v, keys.stride, keys.pos);
    let mut blk = Block::new(&m.pat, m.band, m.scale, m.d, [BlockRows::new(q.data, q.stride, q.pos), k, v]);
    blk.key_padding = m.key_padding;
    blk.packing = m.packing;
    blk.block_mask = m.blocks;
    blk
}

/// Merge the attention of every selected query row onto `keys` into `acc_o`/`acc_lse`.
pub(crate) fn attend_forward<T: Element>(
    q: Rows<'_, T>,
    keys: KeyBlock<'_, T>,
    m: Mask<'_>,
    acc_o: &mut [f32],
    acc_lse: &mut [f32],
) -> Result<()> {
    if keys.pos.is_empty() {
        return Ok(());
    }
    attend_block(&block(q, keys, &m), acc_o, acc_lse)
}

/// [`attend_forward`] over `keys` split into consecutive slices of `rows_per_call` rows
/// (LSE-merged one after the other: the same result up to rounding, bounded scratch).
pub(crate) fn attend_forward_chunked<T: Element>(
    q: Rows<'_, T>,
    keys: KeyBlock<'_, T>,
    m: Mask<'_>,
    acc_o: &mut [f32],
    acc_lse: &mut [f32],
    rows_per_call: usize,
) -> Result<()> {
    let n = keys.pos.len();
    let step = rows_per_call.max(1);
    for a in (0..n).step_by(step) {
        let b = (a + step).min(n);
        let at = (a * keys.stride).min(keys.k.len()).min(keys.v.len());
        let part = KeyBlock { pos: &keys.pos[a..b], k: &keys.k[at..], v: &keys.v[at..], stride: keys.stride };
        attend_forward(q, part, m, acc_o, acc_lse)?;
    }
    Ok(())
}

/// Add the share of `keys` in the gradients: `dq` (like `q`), `dk`/`dv` (like `keys`).
pub(crate) fn attend_backward<T: Element>(
    q: Rows<'_, T>,
    keys: KeyBlock<'_, T>,
    m: Mask<'_>,
    gr: GradRows<'_, T>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) -> Result<()> {
    if keys.pos.is_empty() {
        return Ok(());
    }
    let go = BlockRows::new(gr.go, gr.go_stride, q.pos);
    let upstream = Upstream { grad_out: go, grad_scale: gr.go_scale, lse: gr.lse, delta: gr.delta };
    attend_block_backward(&block(q, keys, &m), &upstream, BlockGradients { dq, dk, dv })
}
