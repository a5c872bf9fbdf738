//! The bridge to `attn_kernels::block`: attention of one rank's query rows onto
//! one key block, all rows carrying global positions (the kernel applies the
//! pattern's selection, segment and causal mask), LSE-merged forward and
//! accumulated (`+=`) backward, in f32.

use attn_core::{Element, Result, SegmentPattern};
use attn_kernels::block::{BlockRows, attend_block, attend_block_backward};

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

/// Mask parameters of one call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mask {
    pub pat: SegmentPattern,
    pub causal: bool,
    pub scale: f32,
    pub d: usize,
}

/// Per-query inputs of the backward: final lse, `g = out_scale * grad_out`, `delta = grad_out . out`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GradRows<'a> {
    pub lse: &'a [f32],
    pub g: &'a [f32],
    pub delta: &'a [f32],
}

/// Merge the attention of every selected query row onto `keys` into `acc_o`/`acc_lse`.
pub(crate) fn attend_forward<T: Element>(
    q: Rows<'_, T>,
    keys: KeyBlock<'_, T>,
    m: Mask,
    acc_o: &mut [f32],
    acc_lse: &mut [f32],
) -> Result<()> {
    if keys.pos.is_empty() {
        return Ok(());
    }
    let d = m.d;
    let qr = BlockRows::new(q.data, q.stride, q.pos);
    let (kr, vr) = (BlockRows::new(keys.k, keys.stride, keys.pos), BlockRows::new(keys.v, keys.stride, keys.pos));
    attend_block(&m.pat, m.causal, m.scale, d, &qr, &kr, &vr, acc_o, acc_lse)
}

/// Add the share of `keys` in the gradients: `dq` (like `q`), `dk`/`dv` (like `keys`).
pub(crate) fn attend_backward<T: Element>(
    q: Rows<'_, T>,
    keys: KeyBlock<'_, T>,
    m: Mask,
    gr: GradRows<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) -> Result<()> {
    if keys.pos.is_empty() {
        return Ok(());
    }
    let d = m.d;
    let qr = BlockRows::new(q.data, q.stride, q.pos);
    let (kr, vr) = (BlockRows::new(keys.k, keys.stride, keys.pos), BlockRows::new(keys.v, keys.stride, keys.pos));
    attend_block_backward(&m.pat, m.causal, m.scale, d, &qr, &kr, &vr, gr.g, gr.lse, gr.delta, dq, dk, dv)
}
