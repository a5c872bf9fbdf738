//! Block-level entry points on the GPU, the counterpart of `attn_kernels::block` for the
//! ring: a block of q rows (global positions `q_start..`) attends a block of k/v rows
//! (global positions `k_start..`) over all batches and heads; the forward LSE-merges into
//! a [`DevicePartial`], the backward accumulates into [`DeviceGrads`]. Like the CPU block
//! API a block carries a [`Band`] (window / causal), an optional key padding mask over
//! global key positions and optional packed sequences; k/v may have fewer heads (grouped).
//!
//! Difference from the CPU block API: positions are one contiguous range per block
//! (ring chunks; zigzag = two calls), not an arbitrary position list. Packed sequences
//! become one launch per (sequence, pattern) with the blocks' pointers offset to the
//! sequence's rows and positions relative to its start.

use attn_core::error::TensorName;
use attn_core::{AttnError, Band, DilatedConfig, PackedSequences, Result, Shape4};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::device::CudaDevice;
use super::launch::launch;
use super::params::{AttnParams, BlockLayout, MAX_INDEX, attn_params};
use super::plan::{
    BackwardKernel, ForwardKernel, MMA_BLOCK_M, PatternLaunch, SeqPiece, THREADS, backward_kernel, forward_kernel,
    head_sweeps, pattern_launches, seq_pieces,
};
use super::source::MAX_HEAD_DIM;
use super::tensor::{
    CudaElement, DeviceGrads, DeviceGradsMut, DeviceKeyPadding, DevicePartial, DeviceTensor, check_len,
};

/// Check that q, k, v agree (batch, head_dim; k and v identical; k/v heads dividing the
/// query heads), the config fits, and the masks cover the block.
fn check_block<T: CudaElement>(block: &DeviceBlock<'_, T>) -> Result<()> {
    let DeviceBlock { cfg, q, q_start, k, v, k_start, .. } = *block;
    let (qs, ks) = (q.shape, k.shape);
    if v.shape != ks {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::Value,
            expected: ks.dims().to_vec(),
            got: v.shape.dims().to_vec(),
        });
    }
    if (ks.batch, ks.head_dim) != (qs.batch, qs.head_dim) {
        let expected = vec![qs.batch, ks.seq, ks.heads, qs.head_dim];
        return Err(AttnError::ShapeMismatch { tensor: TensorName::Key, expected, got: ks.dims().to_vec() });
    }
    if !qs.heads.is_multiple_of(ks.heads) {
        return Err(AttnError::KvHeadsNotDividing { heads: qs.heads, kv_heads: ks.heads });
    }
    cfg.validate_heads(qs.heads)?;
    if qs.head_dim > MAX_HEAD_DIM {
        return Err(AttnError::InvalidArgument(format!(
            "the cuda backend supports head_dim <= {MAX_HEAD_DIM}, got {}",
            qs.head_dim
        )));
    }
    let fits = |start: usize, rows: usize| start.checked_add(rows).is_some_and(|e| e <= MAX_INDEX);
    if !fits(q_start, qs.seq) || !fits(k_start, ks.seq) {
        return Err(AttnError::InvalidArgument(format!(
            "the cuda kernels take positions up to {MAX_INDEX}: queries {q_start}+{}, keys {k_start}+{}",
            qs.seq, ks.seq
        )));
    }
    if let Some(r) = (0..cfg.num_patterns()).map(|i| cfg.rate(i)).find(|&r| r > MAX_INDEX) {
        return Err(AttnError::InvalidArgument(format!(
            "the cuda kernels take dilation rates up to {MAX_INDEX}, got {r}"
        )));
    }
    for (t, name) in [(q, TensorName::Query), (k, TensorName::Key), (v, TensorName::Value)] {
        if t.strides[3] != 1 {
            return Err(AttnError::NonUnitInnerStride { tensor: name, stride: t.strides[3] });
        }
        let needed = super::tensor::extent(t.shape, t.strides);
        if needed > t.data.len() {
            return Err(AttnError::BufferTooSmall { tensor: name, len: t.data.len(), needed });
        }
    }
    if let Some(m) = block.key_padding
        && (m.batch != ks.batch || k_start + ks.seq > m.seq || m.flags.len() != m.batch * m.seq)
    {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::KeyPaddingMask,
            expected: vec![ks.batch, k_start + ks.seq],
            got: vec![m.batch, m.seq],
        });
    }
    if let Some(p) = block.packing {
        if qs.batch != 1 {
            return Err(AttnError::PackedBatch { batch: qs.batch });
        }
        if p.total() < (q_start + qs.seq).max(k_start + ks.seq) {
            return Err(AttnError::InvalidCuSeqlens(format!(
                "ends at {} but the blocks reach position {}",
                p.total(),
                (q_start + qs.seq).max(k_start + ks.seq)
            )));
        }
    }
    Ok(())
}

/// The parameters of one (sequence piece, pattern) launch: the blocks' strides, the
/// piece's rows with positions relative to its sequence, the band, and the address of
/// the padding flag of the piece's first key (`kpad_base` is the mask's, 0 = none).
fn piece_params<T: CudaElement>(
    block: &DeviceBlock<'_, T>,
    piece: &SeqPiece,
    g_strides: Option<[usize; 4]>,
    launch: &PatternLaunch,
    kpad_base: u64,
) -> Result<AttnParams> {
    let DeviceBlock { cfg, q, k, v, .. } = *block;
    let layout = BlockLayout {
        q: (q.shape.with_seq(piece.q.len())?, q.strides),
        k: (k.shape.with_seq(piece.k.len())?, k.strides),
        v_strides: v.strides,
        g_strides,
        q_start: block.q_start + piece.q.start - piece.seq_start,
        k_start: block.k_start + piece.k.start - piece.seq_start,
        band: block.band,
    };
    let mut p = attn_params(cfg, &layout, launch);
    if let Some(m) = block.key_padding {
        p.kpad = kpad_base + (block.k_start + piece.k.start) as u64;
        p.kpad_sb = m.seq as i64;
    }
    Ok(p)
}

/// The block's per-sequence pieces (one piece without packing).
fn pieces<T: CudaElement>(block: &DeviceBlock<'_, T>) -> Vec<SeqPiece> {
    let (q, k) = (block.q_start..block.q_start + block.q.shape.seq, block.k_start..block.k_start + block.k.shape.seq);
    seq_pieces(block.packing.map(|p| p.cu_seqlens()), q, k)
}

fn grid(rows: usize, per_block: usize, heads: usize, batch: usize) -> Result<Option<LaunchConfig>> {
    let x = rows.div_ceil(per_block);
    if x == 0 {
        return Ok(None);
    }
    let too_big = || AttnError::InvalidArgument(format!("launch grid too large ({x} x {heads} x {batch})"));
    let gx = u32::try_from(x).ok().filter(|&g| g < i32::MAX as u32).ok_or_else(too_big)?;
    let gy = u32::try_from(heads).ok().filter(|&g| g <= 65_535).ok_or_else(too_big)?;
    let gz = u32::try_from(batch).ok().filter(|&g| g <= 65_535).ok_or_else(too_big)?;
    Ok(Some(LaunchConfig { grid_dim: (gx, gy, gz), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }))
}

/// A block on the device: q rows starting at global position `q_start`, k/v rows at
/// `k_start` (k/v may have fewer heads, dividing q's), under every pattern of `cfg`.
#[derive(Debug, Clone, Copy)]
pub struct DeviceBlock<'a, T: CudaElement> {
    pub cfg: &'a DilatedConfig,
    pub q: &'a DeviceTensor<T>,
    pub q_start: usize,
    pub k: &'a DeviceTensor<T>,
    pub v: &'a DeviceTensor<T>,
    pub k_start: usize,
    /// Which keys a query sees by distance (`DilatedConfig::band`: window, causal).
    pub band: Band,
    /// Key padding over global key positions; it must cover `k_start + k rows`.
    pub key_padding: Option<&'a DeviceKeyPadding>,
    /// Packed sequences over global positions (batch 1): patterns, bands and causality
    /// apply relative to each sequence's start, and no query sees another sequence.
    pub packing: Option<PackedSequences<'a>>,
}

impl<'a, T: CudaElement> DeviceBlock<'a, T> {
    /// A block with the config's band and no padding or packing.
    pub fn new(
        cfg: &'a DilatedConfig,
        (q, q_start): (&'a DeviceTensor<T>, usize),
        (k, v, k_start): (&'a DeviceTensor<T>, &'a DeviceTensor<T>, usize),
    ) -> Self {
        DeviceBlock { cfg, q, q_start, k, v, k_start, band: cfg.band(), key_padding: None, packing: None }
    }
}

/// What the backward of a block reads for its q rows: `grad_out` (q's shape), the heads'
/// FINAL lse and `delta = dot(grad_out, out)` (both f32 `[batch, q_rows, heads]`).
#[derive(Debug, Clone, Copy)]
pub struct DeviceUpstream<'a, T: CudaElement> {
    pub grad_out: &'a DeviceTensor<T>,
    pub lse: &'a CudaSlice<f32>,
    pub delta: &'a CudaSlice<f32>,
}

/// Attend the block's q rows to its k/v rows (global positions) with every pattern of
/// its config and LSE-merge into `partial` (shape of q). Calling it for every key block,
/// in any order, gives the attention over all of them; then [`finish_forward`](crate::cuda::finish_forward).
pub fn forward_block<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    partial: &mut DevicePartial,
) -> Result<()> {
    let DeviceBlock { cfg, q, k, v, .. } = *block;
    check_block(block)?;
    check_partial(partial, q.shape)?;
    let (kernel, per_block, smem) = match forward_kernel(T::DTYPE, T::SUFFIX, q.shape.head_dim) {
        ForwardKernel::Mma { name, smem_bytes, .. } => (name, MMA_BLOCK_M, smem_bytes),
        ForwardKernel::Rows { name } => (name, (THREADS / 32) as usize, 0),
    };
    let f = dev.function(T::SUFFIX, &kernel, smem)?;
    // The mask's address stays valid (and ordered after its upload) until `_kpad` drops.
    let kpad = block.key_padding.map(|m| m.flags.device_ptr(&dev.stream));
    let kpad_base = kpad.as_ref().map_or(0, |(p, _)| *p);
    let (heads, d) = (q.shape.heads, q.shape.head_dim);
    let launches = pattern_launches(cfg, heads);
    for piece in pieces(block) {
        // Packing has batch 1, so a piece is a row offset into every tensor.
        let qv = q.data.slice(piece.q.start * q.strides[1]..);
        let (kv, vv) = (k.data.slice(piece.k.start * k.strides[1]..), v.data.slice(piece.k.start * v.strides[1]..));
        let mut out = partial.out.slice_mut(piece.q.start * heads * d..);
        let mut lse = partial.lse.slice_mut(piece.q.start * heads..);
        for pl in &launches {
            let params = piece_params(block, &piece, None, pl, kpad_base)?;
            let rows = pl.max_selected(params.q_start as usize, piece.q.len());
            let Some(mut lc) = grid(rows, per_block, pl.heads.len(), q.shape.batch)? else {
                continue;
            };
            lc.shared_mem_bytes = smem as u32;
            // Signature: (q, k, v, o_acc, lse_acc, AttnParams) for both forward kernels.
            let mut args = dev.stream.launch_builder(&f);
            args.arg(&qv).arg(&kv).arg(&vv).arg(&mut out).arg(&mut lse).arg(&params);
            launch(args, lc)?;
        }
    }
    drop(kpad);
    Ok(())
}

fn check_partial(partial: &DevicePartial, q: Shape4) -> Result<()> {
    if partial.shape != q {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::Output,
            expected: q.dims().to_vec(),
            got: partial.shape.dims().to_vec(),
        });
    }
    check_len(TensorName::Output, partial.out.len(), q.numel())?;
    check_len(TensorName::Lse, partial.lse.len(), q.lse_len())
}

fn check_backward<T: CudaElement>(
    block: &DeviceBlock<'_, T>,
    upstream: &DeviceUpstream<'_, T>,
    grads: &DeviceGradsMut<'_>,
) -> Result<()> {
    let DeviceBlock { q, k, .. } = *block;
    let DeviceUpstream { grad_out, lse, delta } = *upstream;
    check_block(block)?;
    if grad_out.shape != q.shape || grad_out.strides[3] != 1 {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::GradOutput,
            expected: q.shape.dims().to_vec(),
            got: grad_out.shape.dims().to_vec(),
        });
    }
    let needed = super::tensor::extent(grad_out.shape, grad_out.strides);
    if needed > grad_out.data.len() {
        return Err(AttnError::BufferTooSmall { tensor: TensorName::GradOutput, len: grad_out.data.len(), needed });
    }
    check_len(TensorName::Lse, lse.len(), q.shape.lse_len())?;
    check_len(TensorName::Other("delta"), delta.len(), q.shape.lse_len())?;
    if grads.q_shape != q.shape || grads.kv_shape != k.shape {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::GradQuery,
            expected: [q.shape.dims(), k.shape.dims()].concat(),
            got: [grads.q_shape.dims(), grads.kv_shape.dims()].concat(),
        });
    }
    check_len(TensorName::GradQuery, grads.dq.len(), q.shape.numel())?;
    check_len(TensorName::GradKey, grads.dk.len(), k.shape.numel())?;
    check_len(TensorName::GradValue, grads.dv.len(), k.shape.numel())
}

/// Accumulate the gradients of one (q block, k block) pair into `grads` (f32; dk, dv per
/// key/value head, summed over the query heads of its group), given the
/// [`DeviceUpstream`] of its q rows.
pub fn backward_block<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    upstream: &DeviceUpstream<'_, T>,
    grads: &mut DeviceGrads,
) -> Result<()> {
    backward_block_into(dev, block, upstream, grads.as_mut())
}

/// [`backward_block`] into accumulators borrowed one by one (a ring keeps dq and moves
/// dk/dv between steps).
pub fn backward_block_into<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    upstream: &DeviceUpstream<'_, T>,
    grads: DeviceGradsMut<'_>,
) -> Result<()> {
    let DeviceBlock { cfg, q, k, v, .. } = *block;
    let DeviceUpstream { grad_out, lse, delta } = *upstream;
    check_backward(block, upstream, &grads)?;
    let kernel = backward_kernel(T::DTYPE, T::SUFFIX, q.shape.head_dim);
    let warps = (THREADS / 32) as usize;
    let kpad = block.key_padding.map(|m| m.flags.device_ptr(&dev.stream));
    let kpad_base = kpad.as_ref().map_or(0, |(p, _)| *p);
    let (heads, kv_heads, d) = (q.shape.heads, k.shape.heads, q.shape.head_dim);
    let group = heads / kv_heads;
    let launches = pattern_launches(cfg, heads);
    for piece in pieces(block) {
        let (qo, ko) = (piece.q.start, piece.k.start);
        let (qv, gv) = (q.data.slice(qo * q.strides[1]..), grad_out.data.slice(qo * grad_out.strides[1]..));
        let (kv, vv) = (k.data.slice(ko * k.strides[1]..), v.data.slice(ko * v.strides[1]..));
        let (lv, dl) = (lse.slice(qo * heads..), delta.slice(qo * heads..));
        let mut dq = grads.dq.slice_mut(qo * heads * d..);
        let mut dk = grads.dk.slice_mut(ko * kv_heads * d..);
        let mut dv = grads.dv.slice_mut(ko * kv_heads * d..);
        for pl in &launches {
            let base = piece_params(block, &piece, Some(grad_out.strides), pl, kpad_base)?;
            let q_rows = pl.max_selected(base.q_start as usize, piece.q.len());
            let k_rows = pl.max_selected(base.k_start as usize, piece.k.len());
            // dk/dv writes: one sweep per residue of the group (see `head_sweeps`).
            for sw in head_sweeps(pl.heads.clone(), group) {
                let params = AttnParams { head0: sw.head0 as i64, head_step: sw.step as i64, ..base };
                match &kernel {
                    BackwardKernel::Mma { name, block_n, smem_bytes } => {
                        let f = dev.function(T::SUFFIX, name, *smem_bytes)?;
                        if let Some(mut lc) = grid(k_rows, *block_n, sw.count, q.shape.batch)? {
                            lc.shared_mem_bytes = *smem_bytes as u32;
                            // Signature: (q, k, v, go, lse, delta, dq_acc, dk_acc, dv_acc, AttnParams).
                            let mut args = dev.stream.launch_builder(&f);
                            args.arg(&qv).arg(&kv).arg(&vv).arg(&gv).arg(&lv).arg(&dl);
                            args.arg(&mut dq).arg(&mut dk).arg(&mut dv).arg(&params);
                            launch(args, lc)?;
                        }
                    }
                    BackwardKernel::Rows { dkv, .. } => {
                        let f_dkv = dev.function(T::SUFFIX, dkv, 0)?;
                        if let Some(lc) = grid(k_rows, warps, sw.count, q.shape.batch)? {
                            // Signature: (q, k, v, go, lse, delta, dk_acc, dv_acc, AttnParams).
                            let mut args = dev.stream.launch_builder(&f_dkv);
                            args.arg(&qv).arg(&kv).arg(&vv).arg(&gv).arg(&lv).arg(&dl);
                            args.arg(&mut dk).arg(&mut dv).arg(&params);
                            launch(args, lc)?;
                        }
                    }
                }
            }
            // dq rows are per query head: one launch over the whole head range.
            if let BackwardKernel::Rows { dq: dq_name, .. } = &kernel {
                let f_dq = dev.function(T::SUFFIX, dq_name, 0)?;
                if let Some(lc) = grid(q_rows, warps, pl.heads.len(), q.shape.batch)? {
                    // Signature: (q, k, v, go, lse, delta, dq_acc, AttnParams).
                    let mut args = dev.stream.launch_builder(&f_dq);
                    args.arg(&qv).arg(&kv).arg(&vv).arg(&gv).arg(&lv).arg(&dl);
                    args.arg(&mut dq).arg(&base);
                    launch(args, lc)?;
                }
            }
        }
    }
    drop(kpad);
    Ok(())
}
