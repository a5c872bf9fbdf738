//! The emulation's host buffers: a block's inputs, accumulators and direct outputs, each
//! checked against what the planned launches index before any launch reads it.

use attn_core::error::TensorName;
use attn_core::{AttnError, Result};

use super::emu_err;
use crate::cuda::exec::tensor::extent;
use crate::cuda::plan::launch_plan::BlockGeometry;
use crate::cuda::plan::source::MAX_HEAD_DIM;

/// A block's inputs in host memory (as the device call's buffers): q, k, v, grad_out in
/// their geometry's strides, the final lse and delta `[batch, q rows, heads]`, the key
/// padding flags `[batch, kpad_seq]`, the block mask's entries (sizes in the geometry).
#[derive(Debug, Clone, Copy)]
pub struct HostArgs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub g: Option<&'a [T]>,
    pub lse: Option<&'a [f32]>,
    pub delta: Option<&'a [f32]>,
    pub kpad: Option<&'a [u8]>,
    pub bmask: Option<&'a [u8]>,
}

/// What direct launches write on the host: a direct forward's output, or a whole call's
/// dq, dk and dv ([`plan_backward_direct`]).
#[derive(Default)]
pub(super) struct HostOuts<'a, T> {
    pub(super) out: Option<&'a mut [T]>,
    pub(super) dq: Option<&'a mut [T]>,
    pub(super) dkv: Option<(&'a mut [T], &'a mut [T])>,
}

/// A block's f32 accumulators in host memory: out (forward) or dq (backward) like q, the
/// forward's lse, dk and dv like k.
#[derive(Debug)]
pub struct HostAccs<'a> {
    pub q_acc: &'a mut [f32],
    pub lse: Option<&'a mut [f32]>,
    pub dk: Option<&'a mut [f32]>,
    pub dv: Option<&'a mut [f32]>,
}

pub(super) fn too_small(tensor: TensorName, len: usize, needed: usize) -> AttnError {
    AttnError::BufferTooSmall { tensor, len, needed }
}

pub(super) fn need(tensor: TensorName, len: usize, needed: usize) -> Result<()> {
    if len < needed { Err(too_small(tensor, len, needed)) } else { Ok(()) }
}

/// Check that every buffer covers what the block's launches index.
pub(super) fn check_buffers<T>(g: &BlockGeometry<'_>, a: &HostArgs<'_, T>, acc: &HostAccs<'_>) -> Result<()> {
    let ((qs, qst), (ks, kst)) = (g.q, g.k);
    if qs.head_dim > MAX_HEAD_DIM || ks.head_dim != qs.head_dim || ks.batch != qs.batch {
        return Err(AttnError::InvalidArgument(format!("emulated block of q {:?} and k {:?}", qs.dims(), ks.dims())));
    }
    if let Some(w) = &g.window {
        w.check(g.cfg, qs.heads, ks.heads)?;
    }
    need(TensorName::Query, a.q.len(), extent(qs, qst))?;
    need(TensorName::Key, a.k.len(), extent(ks, kst))?;
    need(TensorName::Value, a.v.len(), extent(ks, g.v_strides))?;
    if let (Some(gs), Some(go)) = (g.g_strides, a.g) {
        need(TensorName::GradOutput, go.len(), extent(qs, gs))?;
    }
    for (name, x) in [(TensorName::Lse, a.lse), (TensorName::Other("delta"), a.delta)] {
        need(name, x.map_or(usize::MAX, <[f32]>::len), qs.lse_len())?;
    }
    need(TensorName::Output, acc.q_acc.len(), qs.numel())?;
    for (name, x) in [(TensorName::GradKey, &acc.dk), (TensorName::GradValue, &acc.dv)] {
        need(name, x.as_ref().map_or(usize::MAX, |x| x.len()), ks.numel())?;
    }
    need(TensorName::Lse, acc.lse.as_ref().map_or(usize::MAX, |x| x.len()), qs.lse_len())?;
    if let Some(seq) = g.kpad_seq {
        let flags = a.kpad.ok_or_else(|| emu_err("the plan reads a key padding mask the call does not have"))?;
        need(TensorName::KeyPaddingMask, flags.len(), ks.batch * seq)?;
        if g.k_start + ks.seq > seq {
            return Err(AttnError::InvalidArgument(format!("the mask's {seq} keys end before the block's")));
        }
    }
    if let Some(m) = g.block_mask {
        let keep = a.bmask.ok_or_else(|| emu_err("the plan reads a block mask the call does not have"))?;
        let (d, rows) = (m.dims, |n: usize| n.div_ceil(m.block_size.max(1)));
        let longest = g.packing.map(|p| p.iter().map(|r| r.len()).max().unwrap_or(0));
        let (q_end, k_end) = longest.map_or((g.q_start + qs.seq, g.k_start + ks.seq), |n| (n, n));
        if d.len() != Some(keep.len()) || rows(q_end) > d.q_blocks || rows(k_end) > d.k_blocks {
            return Err(AttnError::InvalidBlockMask(format!(
                "{} entries of sizes {:?} for queries to {q_end} and keys to {k_end}",
                keep.len(),
                [d.batch, d.heads, d.q_blocks, d.k_blocks]
            )));
        }
        // A head window's tensors hold a run of the mask's rows of heads.
        let heads = g.window.map_or(qs.heads, |w| w.heads);
        if (d.batch != 1 && d.batch != qs.batch) || (d.heads != 1 && d.heads != heads) {
            return Err(AttnError::InvalidBlockMask(format!("sizes {:?} for q {:?}", [d.batch, d.heads], qs.dims())));
        }
    }
    Ok(())
}

/// The address of element `at` of `x`, or an error naming `tensor` when it lies beyond.
pub(super) fn at<T>(tensor: TensorName, x: &[T], at: usize) -> Result<*const T> {
    x.get(at..).map(<[T]>::as_ptr).ok_or_else(|| too_small(tensor, x.len(), at))
}

pub(super) fn at_mut<T>(tensor: TensorName, x: &mut [T], at: usize) -> Result<*mut T> {
    let len = x.len();
    x.get_mut(at..).map(<[T]>::as_mut_ptr).ok_or_else(|| too_small(tensor, len, at))
}

pub(super) fn missing(what: &str) -> AttnError {
    AttnError::InvalidArgument(format!("a planned launch needs {what}, which the call does not have"))
}
