//! `MultiheadWorkspace`: the reusable buffers of a multihead forward pass, so repeated inference calls allocate nothing.
//!
//! A forward pass needs the fused q/k/v projections, the attention output and its
//! LSE, and the sub-LayerNorm output: at seq 8192 and embed 512, 50 MB + 16 MB + 16 MB.
//! Fresh buffers cost more than their allocation: every new page is zeroed by the
//! kernel on first touch (measured on the 2-core Xeon: about 20 ms of a 160 ms layer
//! forward). A workspace passed to [`crate::MultiheadDilatedAttention::forward_into`]
//! keeps them between calls (faer's style: scratch memory as an explicit parameter).

use attn_core::{DilatedConfig, Result};

use crate::float::LayerFloat;

/// What decides which rows of the fused projection buffer a row-sparse projection
/// writes (`sparse_projection`): equal keys write the same elements.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SelectionKey {
    pub cfg: DilatedConfig,
    pub heads: usize,
    pub head_dim: usize,
    pub batch: usize,
    pub seq: usize,
}

/// Buffers of [`crate::MultiheadDilatedAttention::forward_into`], kept between calls.
///
/// One workspace can serve any layer and any shape (buffers are resized when the
/// shape changes); reusing it with the same shapes allocates nothing. It holds no
/// result a caller needs: every call overwrites what it reads.
#[derive(Debug, Clone, Default)]
pub struct MultiheadWorkspace<F> {
    /// Fused `[b, s, 3, h, d]` projections (self-attention) or q `[b, n, h, d]`.
    pub(crate) qkv: Vec<F>,
    /// The selection whose unwritten elements of `qkv` are known to be zero (`None`:
    /// unknown, so a row-sparse projection re-zeroes the buffer first).
    pub(crate) zero_outside: Option<SelectionKey>,
    /// Fused `[b, m, 2, h, d]` key/value projections of cross-attention.
    pub(crate) kv: Vec<F>,
    /// Attention output `[b, n, h, d]` and its LSE `[b, n, h]`.
    pub(crate) attn: Vec<F>,
    pub(crate) lse: Vec<f32>,
    /// Input of the output projection (dropout and sub-LayerNorm applied).
    pub(crate) pre_out: Vec<F>,
}

/// `buf` resized to `len` elements; on reuse its old contents are left for the
/// caller to overwrite, a fresh buffer comes zeroed (`attn_kernels::zeroed_buffer`).
pub(crate) fn sized<F: LayerFloat>(buf: &mut Vec<F>, len: usize) -> Result<&mut [F]> {
    if buf.len() != len {
        resize_or_fresh(buf, len)?;
    }
    Ok(buf)
}

/// `buf` holding `len` elements: within its capacity when that suffices (an inference
/// pass's shorter last window, then the full windows of the next call, allocate
/// nothing), otherwise a fresh zeroed buffer. Elements past the old length are zero.
fn resize_or_fresh<F: LayerFloat>(buf: &mut Vec<F>, len: usize) -> Result<()> {
    if buf.capacity() >= len {
        buf.resize(len, F::zero());
    } else {
        *buf = attn_kernels::zeroed_buffer(len)?;
    }
    Ok(())
}

impl<F: LayerFloat> MultiheadWorkspace<F> {
    /// An empty workspace; the first forward pass sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes the workspace holds now (its buffers' capacities).
    pub fn bytes(&self) -> usize {
        let f = std::mem::size_of::<F>();
        (self.qkv.capacity() + self.kv.capacity() + self.attn.capacity() + self.pre_out.capacity()) * f
            + self.lse.capacity() * 4
    }

    /// The fused projection buffer of `len` elements for a projection that writes the
    /// elements `selection` decides (`None`: it writes every element). Elements it does
    /// not write are zero on return.
    pub(crate) fn projection_buffer(&mut self, len: usize, selection: Option<SelectionKey>) -> Result<&mut [F]> {
        match selection {
            None => {
                self.zero_outside = None;
                sized(&mut self.qkv, len)
            }
            Some(key) => {
                // Reused memory is re-zeroed unless it already holds this very selection.
                let stale = self.qkv.len() != len || self.zero_outside.as_ref() != Some(&key);
                let reused = self.qkv.capacity() >= len;
                resize_or_fresh(&mut self.qkv, len)?;
                if stale && reused {
                    self.qkv.fill(F::zero());
                }
                self.zero_outside = Some(key);
                Ok(&mut self.qkv)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(seq: usize) -> SelectionKey {
        let cfg = DilatedConfig::new(&[4, 8], &[1, 2]).unwrap();
        SelectionKey { cfg, heads: 2, head_dim: 4, batch: 1, seq }
    }

    #[test]
    fn a_sparse_projection_buffer_is_zero_outside_its_selection() {
        let mut ws = MultiheadWorkspace::<f32>::new();
        ws.projection_buffer(6, Some(key(8))).unwrap().fill(1.0); // stands for the written elements
        ws.projection_buffer(6, Some(key(8))).unwrap()[0] = 2.0;
        assert_eq!(ws.qkv[..2], [2.0, 1.0], "same selection: left as the projection wrote it");
        assert!(ws.projection_buffer(6, Some(key(16))).unwrap().iter().all(|&x| x == 0.0), "new selection: re-zeroed");
        ws.projection_buffer(6, None).unwrap().fill(f32::NAN); // a dense projection writes everything
        assert!(
            ws.projection_buffer(6, Some(key(16))).unwrap().iter().all(|&x| x == 0.0),
            "after a dense write: re-zeroed"
        );
        assert_eq!(ws.projection_buffer(9, Some(key(16))).unwrap().len(), 9);
    }
}
