//! Block-level entry points on the GPU, the counterpart of `attn_kernels::block` for the
//! ring: a block of q rows (global positions `q_start..`) attends a block of k/v rows
//! (global positions `k_start..`) over all batches and heads; the forward LSE-merges into
//! a [`DevicePartial`], the backward accumulates into [`DeviceGrads`]. Like the CPU block
//! API a block carries a [`Band`] (window / causal), an optional key padding mask over
//! global key positions, optional packed sequences and an optional block mask over global
//! positions; k/v may have fewer heads (grouped).
//!
//! Difference from the CPU block API: positions are one contiguous range per block
//! (ring chunks; zigzag = two calls), not an arbitrary position list. Packed sequences
//! become one launch per (sequence, pattern) with the blocks' pointers offset to the
//! sequence's rows and positions relative to its start. A block holding the whole call
//! ([`forward_call`]) may write its output straight from the kernel instead.

use attn_core::error::TensorName;
use attn_core::{AttnError, Band, DilatedConfig, PackedSequences, Result, Shape4};
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::device::{CudaDevice, cuda_err};
use super::launch::launch;
use super::scratch::{ScratchSlot, WORK_COUNTER_LEN};
use super::tensor::{
    CudaElement, DeviceBlockMask, DeviceGrads, DeviceGradsMut, DeviceKeyPadding, DevicePartial, DeviceTensor,
    check_len, fill_into,
};
use super::tensor_map::hopper_launch;
use crate::cuda::plan::head_window::HeadWindow;
use crate::cuda::plan::launch_plan::{
    BlockGeometry, DirectBackward, DirectGrads, Planned, Signature, plan_backward, plan_backward_direct, plan_forward,
    plan_forward_direct,
};
use crate::cuda::plan::params::MAX_INDEX;
use crate::cuda::plan::patterns::BackwardWrites;
use crate::cuda::plan::source::MAX_HEAD_DIM;
use crate::cuda::plan::tensor_maps::MapBases;

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
    match &block.window {
        Some(w) => w.check(cfg, qs.heads, ks.heads)?,
        None if !qs.heads.is_multiple_of(ks.heads) => {
            return Err(AttnError::KvHeadsNotDividing { heads: qs.heads, kv_heads: ks.heads });
        }
        None => cfg.validate_heads(qs.heads)?,
    }
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
    if let Some(m) = block.block_mask {
        check_device_block_mask(m, block)?;
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

/// A device block mask must cover the block's batch and heads and its global positions:
/// `batch` 1 or q's, `heads` 1 or q's, every query and key block of the rows.
fn check_device_block_mask<T: CudaElement>(m: &DeviceBlockMask, block: &DeviceBlock<'_, T>) -> Result<()> {
    let (d, bs) = (m.shape.dims, m.shape.block_size);
    let (qs, ks) = (block.q.shape, block.k.shape);
    let blocks = |start: usize, rows: usize| (start + rows).div_ceil(bs.max(1));
    // Positions restart per packed sequence: the longest one bounds them.
    let (q_end, k_end) = match block.packing {
        Some(p) => {
            let longest = p.iter().map(|r| r.len()).max().unwrap_or(0);
            (longest, longest)
        }
        None => (block.q_start + qs.seq, block.k_start + ks.seq),
    };
    // A head window's tensors hold a run of the mask's rows of heads.
    let heads = block.window.map_or(qs.heads, |w| w.heads);
    let fits = (d.batch == 1 || d.batch == qs.batch)
        && (d.heads == 1 || d.heads == heads)
        && (qs.seq == 0 || blocks(0, q_end) <= d.q_blocks)
        && (ks.seq == 0 || blocks(0, k_end) <= d.k_blocks)
        && d.len() == Some(m.keep.len());
    if !fits || bs == 0 || bs > MAX_INDEX {
        return Err(AttnError::InvalidBlockMask(format!(
            "sizes {:?} of blocks of {bs} do not cover queries {}+{} and keys {}+{} of batch {}, {} heads",
            [d.batch, d.heads, d.q_blocks, d.k_blocks],
            block.q_start,
            qs.seq,
            block.k_start,
            ks.seq,
            qs.batch,
            qs.heads
        )));
    }
    Ok(())
}

/// A block on the device: q rows starting at global position `q_start`, k/v rows at
/// `k_start` (k/v may have fewer heads, dividing q's, or under a head window the key/value
/// heads its query heads read), under every pattern of `cfg`.
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
    /// A block mask over global positions (relative to each packed sequence); it must
    /// cover the blocks' rows.
    pub block_mask: Option<&'a DeviceBlockMask>,
    /// The run of a problem's heads q, k and v hold (a Ulysses slot), each head attended
    /// with the pattern, block-mask row and key/value head of its global index; `None`:
    /// they hold every head. The sm_90a forward does not take a window (the mma.sync
    /// forward runs), nor do a whole call's direct writes.
    pub window: Option<HeadWindow>,
}

impl<'a, T: CudaElement> DeviceBlock<'a, T> {
    /// A block with the config's band and no padding or packing.
    pub fn new(
        cfg: &'a DilatedConfig,
        (q, q_start): (&'a DeviceTensor<T>, usize),
        (k, v, k_start): (&'a DeviceTensor<T>, &'a DeviceTensor<T>, usize),
    ) -> Self {
        DeviceBlock {
            cfg,
            q,
            q_start,
            k,
            v,
            k_start,
            band: cfg.band(),
            key_padding: None,
            packing: None,
            block_mask: None,
            window: None,
        }
    }
}

/// What the backward of a block reads for its q rows: `grad_out` (q's shape), the heads'
/// FINAL lse and `delta = dot(grad_out, out) - grad_lse` (both f32 `[batch, q_rows, heads]`).
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
    check_partial(partial, block.q.shape)?;
    let DevicePartial { out, lse, .. } = partial;
    forward_block_into(dev, block, out, lse)
}

/// [`forward_block`] into an f32 partial output and lse held apart (q's shape and
/// `[batch, rows, heads]`), such as a whole call's own lse.
pub(crate) fn forward_block_into<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    out: &mut CudaSlice<f32>,
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    check_block(block)?;
    check_len(TensorName::Output, out.len(), block.q.shape.numel())?;
    check_len(TensorName::Lse, lse.len(), block.q.shape.lse_len())?;
    let plan = plan_forward(&geometry(block, None), T::DTYPE, T::SUFFIX, dev.forward_options())?;
    let DeviceBlock { q, k, v, .. } = *block;
    let bufs = DeviceArgs { q: &q.data, k: &k.data, v: &v.data, g: None, lse: None, delta: None };
    let accs = Accs { q_acc: Some(out), out: None, lse: Some(lse), dk: None, dv: None, dq_out: None, dkv_out: None };
    execute(dev, &plan, &bufs, masks(block), accs)
}

/// The direct forward of a whole call where it applies (every head one pattern, the
/// tensor-core kernel): `out` (contiguous, q's shape) and `lse` written straight from the
/// kernel; `Ok(false)`, with nothing written, where it does not apply.
pub(crate) fn forward_direct_into<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    out: &mut DeviceTensor<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<bool> {
    check_block(block)?;
    let shape = block.q.shape;
    check_contiguous_out(out, shape)?;
    check_len(TensorName::Lse, lse.len(), shape.lse_len())?;
    let geometry = geometry(block, Some(out.strides));
    let Some(plan) = plan_forward_direct(&geometry, T::DTYPE, T::SUFFIX, dev.forward_options())? else {
        return Ok(false);
    };
    dev.stream.memset_zeros(&mut out.data).map_err(cuda_err)?;
    fill_into::<T>(dev, lse, f32::NEG_INFINITY)?;
    let DeviceBlock { q, k, v, .. } = *block;
    let bufs = DeviceArgs { q: &q.data, k: &k.data, v: &v.data, g: None, lse: None, delta: None };
    let accs =
        Accs { q_acc: None, out: Some(&mut out.data), lse: Some(lse), dk: None, dv: None, dq_out: None, dkv_out: None };
    execute(dev, &plan, &bufs, masks(block), accs)?;
    Ok(true)
}

/// A whole call's output: contiguous, of q's shape.
pub(crate) fn check_contiguous_out<T>(out: &DeviceTensor<T>, shape: Shape4) -> Result<()> {
    if out.shape != shape || out.strides != shape.contiguous_strides() || out.data.len() != shape.numel() {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::Output,
            expected: shape.dims().to_vec(),
            got: out.shape.dims().to_vec(),
        });
    }
    Ok(())
}

/// The planning view of a block (`g_strides`: grad_out's, in the backward).
fn geometry<'a, T: CudaElement>(block: &DeviceBlock<'a, T>, g_strides: Option<[usize; 4]>) -> BlockGeometry<'a> {
    BlockGeometry {
        cfg: block.cfg,
        q: (block.q.shape, block.q.strides),
        q_start: block.q_start,
        k: (block.k.shape, block.k.strides),
        v_strides: block.v.strides,
        k_start: block.k_start,
        g_strides,
        band: block.band,
        kpad_seq: block.key_padding.map(|m| m.seq),
        packing: block.packing,
        block_mask: block.block_mask.map(|m| m.shape),
        window: block.window,
    }
}

/// The inputs of a block's launches.
struct DeviceArgs<'a, T> {
    q: &'a CudaSlice<T>,
    k: &'a CudaSlice<T>,
    v: &'a CudaSlice<T>,
    g: Option<&'a CudaSlice<T>>,
    lse: Option<&'a CudaSlice<f32>>,
    delta: Option<&'a CudaSlice<f32>>,
}

/// The accumulators of a block's launches: out or dq, the output of a direct forward, the
/// forward's lse, dk and dv.
struct Accs<'a, T> {
    q_acc: Option<&'a mut CudaSlice<f32>>,
    out: Option<&'a mut CudaSlice<T>>,
    lse: Option<&'a mut CudaSlice<f32>>,
    dk: Option<&'a mut CudaSlice<f32>>,
    dv: Option<&'a mut CudaSlice<f32>>,
    /// The gradients themselves, for launches that write dq, or dk and dv, directly.
    dq_out: Option<&'a mut CudaSlice<T>>,
    dkv_out: Option<(&'a mut CudaSlice<T>, &'a mut CudaSlice<T>)>,
}

fn missing(what: &str) -> AttnError {
    AttnError::InvalidArgument(format!("a planned launch needs {what}, which the call does not have"))
}

/// The masks a block's launches read.
#[derive(Clone, Copy)]
struct BlockMasks<'a> {
    key_padding: Option<&'a DeviceKeyPadding>,
    block_mask: Option<&'a DeviceBlockMask>,
}

fn masks<'a, T: CudaElement>(block: &DeviceBlock<'a, T>) -> BlockMasks<'a> {
    BlockMasks { key_padding: block.key_padding, block_mask: block.block_mask }
}

/// Launch every planned kernel on the device, arguments at the planned offsets.
fn execute<T: CudaElement>(
    dev: &CudaDevice,
    plan: &[Planned],
    bufs: &DeviceArgs<'_, T>,
    masks: BlockMasks<'_>,
    accs: Accs<'_, T>,
) -> Result<()> {
    // The masks' addresses stay valid (and ordered after their uploads) until `kpad` and
    // `bmask` drop.
    let kpad = masks.key_padding.map(|m| m.flags.device_ptr(&dev.stream));
    let kpad_base = kpad.as_ref().map_or(0, |(p, _)| *p);
    let bmask = masks.block_mask.map(|m| m.keep.device_ptr(&dev.stream));
    let bmask_base = bmask.as_ref().map(|(p, _)| *p);
    let Accs { mut q_acc, mut out, mut lse, mut dk, mut dv, mut dq_out, mut dkv_out } = accs;
    // The persistent launches' work counter, from the stream's pool (zeroed when allocated;
    // each launch leaves it zeroed), given back once they are queued.
    let work = plan.iter().any(|p| p.work).then(|| dev.take_scratch(ScratchSlot::WorkCounter, WORK_COUNTER_LEN));
    let work = work.transpose()?;
    let work_ptr = work.as_ref().map(|w| w.device_ptr(&dev.stream));
    // Where each tensor starts, for the alignment of its 16-byte loads.
    let start = |s: &CudaSlice<T>| s.device_ptr(&dev.stream).0;
    let g_start = bufs.g.map(start).or_else(|| out.as_deref().map(start));
    let starts = [Some(start(bufs.q)), Some(start(bufs.k)), Some(start(bufs.v)), g_start];
    // A plan's launches mostly share one kernel: load each function once per run of it.
    let mut loaded: Option<(&str, CudaFunction)> = None;
    for planned in plan {
        let addr = |s: &CudaSlice<T>, at: usize| start(s) + (at * size_of::<T>()) as u64;
        let o = planned.offsets;
        let g = bufs.g.filter(|_| planned.signature == Signature::BackwardAll).map(|g| addr(g, o.g));
        let bases = MapBases { q: addr(bufs.q, o.q), k: addr(bufs.k, o.k), v: addr(bufs.v, o.v), g };
        let (p, maps) = hopper_launch(dev, planned, T::DTYPE, (starts, size_of::<T>()), bases)?;
        if loaded.as_ref().is_none_or(|(name, _)| *name != p.kernel) {
            loaded = Some((&p.kernel, dev.function(T::SUFFIX, &p.kernel, p.smem_bytes as usize)?));
        }
        let Some((_, f)) = &loaded else { continue };
        let mut params = p.params_at(starts, size_of::<T>());
        if p.kpad {
            params.kpad += kpad_base;
        }
        if p.bmask {
            params.bmask += bmask_base.ok_or_else(|| missing("a block mask"))?;
        }
        let mut grid_dim = p.grid;
        if p.work {
            params.work = work_ptr.as_ref().map(|(w, _)| *w).ok_or_else(|| missing("a work counter"))?;
            grid_dim.0 = grid_dim.0.min(dev.resident_blocks(f, p.threads, p.smem_bytes)?);
        }
        let lc = LaunchConfig { grid_dim, block_dim: (p.threads, 1, 1), shared_mem_bytes: p.smem_bytes };
        let o = p.offsets;
        let (qv, kv, vv) = (bufs.q.slice(o.q..), bufs.k.slice(o.k..), bufs.v.slice(o.v..));
        let mut args = dev.stream.launch_builder(f);
        args.arg(&qv).arg(&kv).arg(&vv);
        if matches!(p.signature, Signature::Forward | Signature::ForwardDirect) {
            let mut lse = lse.as_deref_mut().ok_or_else(|| missing("an lse accumulator"))?.slice_mut(o.q_rows..);
            let (mut acc, mut direct);
            if p.signature == Signature::Forward {
                acc = q_acc.as_deref_mut().ok_or_else(|| missing("an f32 partial"))?.slice_mut(o.q_acc..);
                args.arg(&mut acc);
            } else {
                direct = out.as_deref_mut().ok_or_else(|| missing("an output"))?.slice_mut(o.g..);
                args.arg(&mut direct);
            }
            args.arg(&mut lse).arg(&params);
            if let Some(maps) = &maps {
                args.arg(maps);
            }
            launch(args, lc)?;
            continue;
        }
        let gv = bufs.g.ok_or_else(|| missing("grad_out"))?.slice(o.g..);
        let lv = bufs.lse.ok_or_else(|| missing("the lse"))?.slice(o.q_rows..);
        let dl = bufs.delta.ok_or_else(|| missing("delta"))?.slice(o.q_rows..);
        args.arg(&gv).arg(&lv).arg(&dl);
        let (mut dq, mut dqo);
        if p.signature == Signature::BackwardDq && p.params.out_direct != 0 {
            dqo = dq_out.as_deref_mut().ok_or_else(|| missing("dq"))?.slice_mut(o.q..);
            args.arg(&mut dqo);
        } else if matches!(p.signature, Signature::BackwardAll | Signature::BackwardDq) {
            dq = q_acc.as_deref_mut().ok_or_else(|| missing("dq"))?.slice_mut(o.q_acc..);
            args.arg(&mut dq);
        }
        let (mut dkv, mut dvv, mut dko, mut dvo);
        if matches!(p.signature, Signature::BackwardAll | Signature::BackwardDkv) {
            if p.params.out_direct != 0 {
                let (dk_out, dv_out) = dkv_out.as_mut().ok_or_else(|| missing("dk and dv"))?;
                (dko, dvo) = (dk_out.slice_mut(o.k..), dv_out.slice_mut(o.v..));
                args.arg(&mut dko).arg(&mut dvo);
            } else {
                dkv = dk.as_deref_mut().ok_or_else(|| missing("dk"))?.slice_mut(o.k_acc..);
                dvv = dv.as_deref_mut().ok_or_else(|| missing("dv"))?.slice_mut(o.k_acc..);
                args.arg(&mut dkv).arg(&mut dvv);
            }
        }
        args.arg(&params);
        if let Some(maps) = &maps {
            args.arg(maps);
        }
        launch(args, lc)?;
    }
    drop(kpad);
    drop(bmask);
    drop(work_ptr);
    if let Some(w) = work {
        dev.give_scratch(ScratchSlot::WorkCounter, w);
    }
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
    check_backward(block, upstream, &grads)?;
    let DeviceUpstream { grad_out, lse, delta } = *upstream;
    let plan = plan_backward(&geometry(block, Some(grad_out.strides)), T::DTYPE, T::SUFFIX, dev.backward_options())?;
    let DeviceBlock { q, k, v, .. } = *block;
    let bufs =
        DeviceArgs { q: &q.data, k: &k.data, v: &v.data, g: Some(&grad_out.data), lse: Some(lse), delta: Some(delta) };
    let accs = Accs {
        q_acc: Some(grads.dq),
        out: None,
        lse: None,
        dk: Some(grads.dk),
        dv: Some(grads.dv),
        dq_out: None,
        dkv_out: None,
    };
    execute(dev, &plan, &bufs, masks(block), accs)
}

/// The launches of a whole call's backward that write gradients straight into the
/// caller's tensors ([`plan_backward_direct`]), where the device's options ask for it and
/// the plan applies to the gradients laid out like their inputs (contiguous); `None`
/// otherwise.
pub(crate) fn direct_gradient_plan<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    grad_out: &DeviceTensor<T>,
    [dq, dk, dv]: [&DeviceTensor<T>; 3],
) -> Result<Option<DirectBackward>> {
    let like = |g: &DeviceTensor<T>, x: &DeviceTensor<T>| {
        g.shape == x.shape
            && g.strides == x.strides
            && g.strides == x.shape.contiguous_strides()
            && g.data.len() == x.shape.numel()
    };
    let allowed = DirectGrads::from_parts(like(dq, block.q), like(dk, block.k) && like(dv, block.v));
    let Some(allowed) = allowed.filter(|_| dev.backward_options().writes == BackwardWrites::Direct) else {
        return Ok(None);
    };
    let g = geometry(block, Some(grad_out.strides));
    plan_backward_direct(&g, T::DTYPE, T::SUFFIX, dev.backward_options(), allowed)
}

/// The f32 accumulators of a whole call's backward: dq's, and dk's and dv's, each `None`
/// where a [`DirectBackward`] writes that gradient itself.
pub(crate) struct CallAccs<'a> {
    pub dq: Option<&'a mut CudaSlice<f32>>,
    pub dkv: Option<(&'a mut CudaSlice<f32>, &'a mut CudaSlice<f32>)>,
}

/// Run a [`direct_gradient_plan`]: the direct gradients written into `grads` (zeroed by the
/// caller), the others added into `accs` (zeroed by the caller).
pub(crate) fn backward_block_direct<T: CudaElement>(
    dev: &CudaDevice,
    block: &DeviceBlock<'_, T>,
    upstream: &DeviceUpstream<'_, T>,
    plan: &DirectBackward,
    accs: CallAccs<'_>,
    [dq, dk, dv]: [&mut DeviceTensor<T>; 3],
) -> Result<()> {
    check_block(block)?;
    let DeviceUpstream { grad_out, lse, delta } = *upstream;
    let (qs, ks) = (block.q.shape, block.k.shape);
    if let Some(acc) = &accs.dq {
        check_len(TensorName::GradQuery, acc.len(), qs.numel())?;
    }
    if let Some((dk_acc, dv_acc)) = &accs.dkv {
        check_len(TensorName::GradKey, dk_acc.len(), ks.numel())?;
        check_len(TensorName::GradValue, dv_acc.len(), ks.numel())?;
    }
    let DeviceBlock { q, k, v, .. } = *block;
    let bufs =
        DeviceArgs { q: &q.data, k: &k.data, v: &v.data, g: Some(&grad_out.data), lse: Some(lse), delta: Some(delta) };
    let (dk_acc, dv_acc) = accs.dkv.map_or((None, None), |(k, v)| (Some(k), Some(v)));
    let dq_out = plan.grads.dq().then_some(&mut dq.data);
    let dkv_out = plan.grads.dkv().then_some((&mut dk.data, &mut dv.data));
    let accs = Accs { q_acc: accs.dq, out: None, lse: None, dk: dk_acc, dv: dv_acc, dq_out, dkv_out };
    execute(dev, &plan.launches, &bufs, masks(block), accs)
}
