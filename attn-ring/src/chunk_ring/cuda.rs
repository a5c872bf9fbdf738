//! [`CudaChunks`]: the chunk ring's blocks on the CUDA kernels. Pieces, partials, lse,
//! delta and gradient accumulators stay in device memory, each counted in the rank's
//! [`DeviceMeter`]; the LSE merge is the forward kernels' own. Host bytes are made only
//! where a host-staged transport asks for them. Blocks over a [`HeadSlot`] (Ulysses and the
//! hybrid) pass the slot to the kernels as a [`HeadWindow`]; the head copies of those
//! strategies are device-to-device copies of each row's run of heads.

use std::ops::Range;
use std::sync::Arc;

use attn_core::error::TensorName;
use attn_core::{AttnError, PackedSequences, Result, Shape4};
use attn_kernels::cuda::plan::head_window::HeadWindow;
use attn_kernels::cuda::{
    CudaDevice, CudaElement, DeviceBlock, DeviceBlockMask, DeviceGradsMut, DeviceKeyPadding, DevicePartial,
    DeviceTensor, DeviceUpstream, backward_block_into, delta, finish_forward, forward_block, store_scaled,
};
use cudarc::driver::{CudaSlice, DeviceRepr};

use super::device_meter::{DeviceMeter, Metered};
use super::{ChunkBlock, ChunkCompute, ChunkGrads, ChunkUpstream, HeadSlot, check_bsh_len, check_stats};
use crate::plan::RingProblem;
use crate::protocol::wire::{elems_exact, f32s_exact, put_elems, put_f32s};

fn cuda_err(e: impl std::error::Error + Send + Sync + 'static) -> AttnError {
    AttnError::backend("cuda", e)
}

/// f32 values in device memory with the shape they belong to (`[batch, rows, heads,
/// head_dim]` for accumulators, `[batch, rows, heads]` of `shape` for per-row values).
#[derive(Debug)]
pub struct DeviceRowStats {
    pub data: CudaSlice<f32>,
    pub shape: Shape4,
}

/// The problem's masks on the device: the key padding flags and the packed sequences.
#[derive(Debug)]
pub struct DeviceMasks {
    key_padding: Option<Metered<DeviceKeyPadding>>,
    block_mask: Option<Metered<DeviceBlockMask>>,
    cu_seqlens: Option<Vec<usize>>,
}

/// The chunk ring's blocks on one CUDA device (every launch on its stream); the device
/// memory the rank holds is counted in `meter`.
#[derive(Debug, Clone)]
pub struct CudaChunks {
    pub dev: CudaDevice,
    pub meter: Arc<DeviceMeter>,
}

type Rows<T> = Metered<DeviceTensor<T>>;
type Stats = Metered<DeviceRowStats>;

fn f32_bytes(n: usize) -> u64 {
    n as u64 * 4
}

impl CudaChunks {
    /// A compute on `dev` with a fresh meter.
    pub fn new(dev: CudaDevice) -> Self {
        CudaChunks { dev, meter: Arc::new(DeviceMeter::default()) }
    }

    /// A caller's tensor (an input piece) as this rank's rows, counted in its meter.
    pub fn adopt<T: CudaElement>(&self, t: DeviceTensor<T>) -> Rows<T> {
        let bytes = (t.data.len() * T::DTYPE.size()) as u64;
        Metered::new(t, bytes, &self.meter)
    }

    fn stats(&self, data: CudaSlice<f32>, shape: Shape4) -> Stats {
        let bytes = f32_bytes(data.len());
        Metered::new(DeviceRowStats { data, shape }, bytes, &self.meter)
    }

    fn device_block<'a, T: CudaElement>(
        block: &ChunkBlock<'a, Rows<T>, DeviceMasks>,
        packing: Option<PackedSequences<'a>>,
    ) -> DeviceBlock<'a, T> {
        let ChunkBlock { problem, masks, q, q_start, k, v, k_start, heads } = *block;
        DeviceBlock {
            cfg: &problem.cfg,
            q,
            q_start,
            k,
            v,
            k_start,
            band: problem.cfg.band(),
            key_padding: masks.key_padding.as_deref(),
            packing,
            block_mask: masks.block_mask.as_deref(),
            window: head_window(problem, heads),
        }
    }
}

/// The kernels' view of a block's heads: a slot's run of the problem's heads, or none
/// (the rows hold every head).
pub(super) fn head_window(problem: &RingProblem, slot: HeadSlot) -> Option<HeadWindow> {
    match slot {
        HeadSlot::Every => None,
        HeadSlot::Slot { first, kv_first } => {
            Some(HeadWindow { heads: problem.heads, kv_heads: problem.kv_heads, first, kv_first })
        }
    }
}

/// The shape of a contiguous tensor (the chunk ring's rows always are).
fn contiguous<T>(t: &DeviceTensor<T>) -> Result<Shape4> {
    if t.strides != t.shape.contiguous_strides() {
        return Err(AttnError::InvalidArgument(format!("rows with strides {:?} are not contiguous", t.strides)));
    }
    Ok(t.shape)
}

/// Copy `n` rows of every batch from `(src, its rows, first row)` to `(dst, its rows,
/// first row)`, device to device; `shape` gives batch and the row size.
fn copy_row_runs<T: CudaElement>(
    dev: &CudaDevice,
    (src, src_seq, from): (&CudaSlice<T>, usize, usize),
    (dst, dst_seq, to): (&mut CudaSlice<T>, usize, usize),
    n: usize,
    shape: Shape4,
) -> Result<()> {
    let row = shape.heads * shape.head_dim;
    if n == 0 {
        return Ok(());
    }
    for b in 0..shape.batch {
        let s = (b * src_seq + from) * row;
        let d = (b * dst_seq + to) * row;
        let mut view = dst.slice_mut(d..d + n * row);
        dev.stream().memcpy_dtod(&src.slice(s..s + n * row), &mut view).map_err(cuda_err)?;
    }
    Ok(())
}

/// Copy `n` heads of every row from `(src, its heads, first head)` to `(dst, its heads,
/// first head)`, device to device: one copy per row (`rows` rows of `d` values a head).
fn copy_head_runs<E: DeviceRepr>(
    dev: &CudaDevice,
    (src, src_heads, from): (&CudaSlice<E>, usize, usize),
    (dst, dst_heads, to): (&mut CudaSlice<E>, usize, usize),
    (n, rows, d): (usize, usize, usize),
) -> Result<()> {
    let run = n * d;
    if run == 0 {
        return Ok(());
    }
    if from + n > src_heads
        || to + n > dst_heads
        || src.len() < rows * src_heads * d
        || dst.len() < rows * dst_heads * d
    {
        return Err(AttnError::InvalidArgument(format!(
            "{n} heads from head {from} of {src_heads} to head {to} of {dst_heads}"
        )));
    }
    for r in 0..rows {
        let (s, t) = ((r * src_heads + from) * d, (r * dst_heads + to) * d);
        let mut view = dst.slice_mut(t..t + run);
        dev.stream().memcpy_dtod(&src.slice(s..s + run), &mut view).map_err(cuda_err)?;
    }
    Ok(())
}

/// Check that `src` fits heads `first..` of `dst` (same batch, rows, head_dim).
fn check_heads_fit(tensor: &'static str, dst: Shape4, first: usize, src: Shape4) -> Result<()> {
    if (src.batch, src.seq, src.head_dim) != (dst.batch, dst.seq, dst.head_dim) || first + src.heads > dst.heads {
        let expected = Shape4 { heads: dst.heads.saturating_sub(first).min(src.heads), ..dst }.dims().to_vec();
        return Err(AttnError::ShapeMismatch { tensor: TensorName::Other(tensor), expected, got: src.dims().to_vec() });
    }
    Ok(())
}

/// Check that `heads` is a non-empty run of the heads of `shape`.
fn check_heads_in(shape: Shape4, heads: &Range<usize>) -> Result<()> {
    if heads.end > shape.heads || heads.is_empty() {
        return Err(AttnError::InvalidArgument(format!("heads {heads:?} of rows with {} heads", shape.heads)));
    }
    Ok(())
}

impl<T: CudaElement> ChunkCompute<T> for CudaChunks {
    type Rows = Rows<T>;
    type Partial = Metered<DevicePartial>;
    type Acc = Stats;
    type RowStats = Stats;
    type Masks = DeviceMasks;

    fn shape_of(&self, rows: &Rows<T>) -> Shape4 {
        rows.shape
    }

    fn masks(&self, problem: &RingProblem) -> Result<DeviceMasks> {
        // Every kernel loaded before the first round is posted (see `load_kernels`).
        self.dev.load_kernels(T::SUFFIX)?;
        let m = problem.core_masks()?;
        let key_padding = match m.key_padding {
            Some(k) => {
                Some(Metered::new(DeviceKeyPadding::upload(&self.dev, &k)?, k.flags().len() as u64, &self.meter))
            }
            None => None,
        };
        let block_mask = match m.block {
            Some(b) => Some(Metered::new(DeviceBlockMask::upload(&self.dev, &b)?, b.keep().len() as u64, &self.meter)),
            None => None,
        };
        Ok(DeviceMasks { key_padding, block_mask, cu_seqlens: problem.masks.cu_seqlens().map(<[usize]>::to_vec) })
    }

    fn empty_partial(&self, q: Shape4) -> Result<Metered<DevicePartial>> {
        let bytes = f32_bytes(q.numel() + q.lse_len());
        Ok(Metered::new(DevicePartial::empty::<T>(&self.dev, q)?, bytes, &self.meter))
    }

    fn zero_acc(&self, shape: Shape4) -> Result<Stats> {
        Ok(self.stats(self.dev.stream().alloc_zeros::<f32>(shape.numel()).map_err(cuda_err)?, shape))
    }

    fn forward_block(
        &self,
        block: &ChunkBlock<'_, Rows<T>, DeviceMasks>,
        partial: &mut Metered<DevicePartial>,
    ) -> Result<()> {
        let packing = block.masks.cu_seqlens.as_deref().map(PackedSequences::new).transpose()?;
        forward_block(&self.dev, &Self::device_block(block, packing), partial)
    }

    fn finish_forward(&self, problem: &RingProblem, partial: &Metered<DevicePartial>) -> Result<(Rows<T>, Stats)> {
        let mut out = DeviceTensor::<T>::zeros(&self.dev, partial.shape)?;
        let lse = finish_forward(&self.dev, &problem.cfg, partial, &mut out)?;
        let lse = self.dev.stream().clone_dtod(lse).map_err(cuda_err)?;
        Ok((self.adopt(out), self.stats(lse, partial.shape)))
    }

    fn delta(&self, grad_out: &Rows<T>, out: &Rows<T>, lse_grad: Option<(&Stats, &Stats)>) -> Result<Stats> {
        for (name, stats) in lse_grad.iter().flat_map(|(g, l)| [(TensorName::GradLse, *g), (TensorName::Lse, *l)]) {
            check_stats(name, <Self as ChunkCompute<T>>::stats_shape(self, stats), stats.shape, out.shape)?;
        }
        let lse_grad = lse_grad.map(|(g, l)| (&g.data, &l.data));
        Ok(self.stats(delta(&self.dev, grad_out, out, lse_grad)?, out.shape))
    }

    fn stats_shape(&self, stats: &Stats) -> Option<Shape4> {
        (stats.data.len() == stats.shape.lse_len()).then_some(Shape4 { head_dim: 1, ..stats.shape })
    }

    fn stats_from_bsh(&self, shape: Shape4, values: &[f32]) -> Result<Stats> {
        check_bsh_len(shape, values.len())?;
        Ok(self.stats(self.dev.stream().clone_htod(values).map_err(cuda_err)?, shape))
    }

    fn backward_block(
        &self,
        block: &ChunkBlock<'_, Rows<T>, DeviceMasks>,
        upstream: &ChunkUpstream<'_, Rows<T>, Stats>,
        grads: ChunkGrads<'_, Stats>,
    ) -> Result<()> {
        let packing = block.masks.cu_seqlens.as_deref().map(PackedSequences::new).transpose()?;
        let up = DeviceUpstream { grad_out: upstream.grad_out, lse: &upstream.lse.data, delta: &upstream.delta.data };
        let (q_shape, kv_shape) = (grads.dq.shape, grads.dk.shape);
        if grads.dv.shape != kv_shape {
            let (expected, got) = (kv_shape.dims().to_vec(), grads.dv.shape.dims().to_vec());
            return Err(AttnError::ShapeMismatch { tensor: TensorName::GradValue, expected, got });
        }
        let g = DeviceGradsMut {
            dq: &mut grads.dq.data,
            dk: &mut grads.dk.data,
            dv: &mut grads.dv.data,
            q_shape,
            kv_shape,
        };
        backward_block_into(&self.dev, &Self::device_block(block, packing), &up, g)
    }

    fn store_acc(&self, acc: &Stats) -> Result<Rows<T>> {
        let mut t = DeviceTensor::<T>::zeros(&self.dev, acc.shape)?;
        store_scaled(&self.dev, TensorName::Other("gradient"), &acc.data, 1.0, &mut t)?;
        Ok(self.adopt(t))
    }

    fn rows_to_bytes(&self, rows: &Rows<T>, out: &mut Vec<u8>) -> Result<()> {
        put_elems(out, &rows.to_host_contiguous(&self.dev)?);
        Ok(())
    }

    fn rows_from_bytes(&self, shape: Shape4, bytes: &[u8]) -> Result<Rows<T>> {
        let host: Vec<T> = elems_exact(bytes, shape.numel())?;
        let data = self.dev.stream().clone_htod(&host).map_err(cuda_err)?;
        Ok(self.adopt(DeviceTensor { data, shape, strides: shape.contiguous_strides() }))
    }

    fn acc_to_bytes(&self, acc: &Stats, out: &mut Vec<u8>) -> Result<()> {
        let host = self.dev.stream().clone_dtoh(&acc.data).map_err(cuda_err)?;
        self.dev.synchronize()?;
        put_f32s(out, &host);
        Ok(())
    }

    fn acc_from_bytes(&self, shape: Shape4, bytes: &[u8]) -> Result<Stats> {
        let host = f32s_exact(bytes, shape.numel())?;
        Ok(self.stats(self.dev.stream().clone_htod(&host).map_err(cuda_err)?, shape))
    }

    fn acc_bytes(&self, acc: &Stats) -> usize {
        acc.data.len() * 4
    }

    fn slice_rows(&self, src: &Rows<T>, rows: Range<usize>) -> Result<Rows<T>> {
        let s = contiguous(src)?;
        if rows.end > s.seq || rows.start > rows.end {
            return Err(AttnError::InvalidArgument(format!("rows {rows:?} of a piece with {} rows", s.seq)));
        }
        let mut dst = DeviceTensor::<T>::zeros(&self.dev, Shape4 { seq: rows.len(), ..s })?;
        copy_row_runs(&self.dev, (&src.data, s.seq, rows.start), (&mut dst.data, rows.len(), 0), rows.len(), s)?;
        Ok(self.adopt(dst))
    }

    fn zero_rows(&self, shape: Shape4) -> Result<Rows<T>> {
        Ok(self.adopt(DeviceTensor::<T>::zeros(&self.dev, shape)?))
    }

    fn write_rows(&self, dst: &mut Rows<T>, at: usize, src: &Rows<T>) -> Result<()> {
        let (s, o) = (contiguous(dst)?, contiguous(src)?);
        if (o.batch, o.heads, o.head_dim) != (s.batch, s.heads, s.head_dim) || at + o.seq > s.seq {
            let (expected, got) = (Shape4 { seq: o.seq, ..s }.dims().to_vec(), o.dims().to_vec());
            return Err(AttnError::ShapeMismatch { tensor: TensorName::Other("rows written"), expected, got });
        }
        copy_row_runs(&self.dev, (&src.data, o.seq, 0), (&mut dst.data, s.seq, at), o.seq, s)
    }

    fn sync(&self) -> Result<()> {
        self.dev.synchronize()
    }

    fn take_heads(&self, src: &Rows<T>, heads: Range<usize>) -> Result<Rows<T>> {
        let s = contiguous(src)?;
        check_heads_in(s, &heads)?;
        let mut dst = DeviceTensor::<T>::zeros(&self.dev, Shape4 { heads: heads.len(), ..s })?;
        let (n, rows) = (heads.len(), s.batch * s.seq);
        copy_head_runs(&self.dev, (&src.data, s.heads, heads.start), (&mut dst.data, n, 0), (n, rows, s.head_dim))?;
        Ok(self.adopt(dst))
    }

    fn put_heads(&self, dst: &mut Rows<T>, first: usize, src: &Rows<T>) -> Result<()> {
        let (d, o) = (contiguous(dst)?, contiguous(src)?);
        check_heads_fit("heads written", d, first, o)?;
        let (n, rows) = (o.heads, o.batch * o.seq);
        copy_head_runs(&self.dev, (&src.data, n, 0), (&mut dst.data, d.heads, first), (n, rows, o.head_dim))
    }

    fn take_acc_heads(&self, src: &Stats, heads: Range<usize>) -> Result<Stats> {
        let s = src.shape;
        check_heads_in(s, &heads)?;
        let shape = Shape4 { heads: heads.len(), ..s };
        let mut dst = self.dev.stream().alloc_zeros::<f32>(shape.numel()).map_err(cuda_err)?;
        let (n, rows) = (heads.len(), s.batch * s.seq);
        copy_head_runs(&self.dev, (&src.data, s.heads, heads.start), (&mut dst, n, 0), (n, rows, s.head_dim))?;
        Ok(self.stats(dst, shape))
    }

    fn add_acc_heads(&self, dst: &mut Stats, first: usize, src: &Stats) -> Result<()> {
        let (d, o) = (dst.shape, src.shape);
        check_heads_fit("heads added", d, first, o)?;
        // The sum runs on the host (the kernels have no strided f32 add): dk/dv of key/value
        // heads read by several slots, and the second all-to-all's pieces, once a call.
        let stream = self.dev.stream();
        let (mut acc, add) =
            (stream.clone_dtoh(&dst.data).map_err(cuda_err)?, stream.clone_dtoh(&src.data).map_err(cuda_err)?);
        self.dev.synchronize()?;
        let (run, rows) = (o.heads * o.head_dim, o.batch * o.seq);
        for r in 0..rows {
            let at = (r * d.heads + first) * d.head_dim;
            acc[at..at + run].iter_mut().zip(&add[r * run..(r + 1) * run]).for_each(|(a, &b)| *a += b);
        }
        stream.memcpy_htod(&acc, &mut dst.data).map_err(cuda_err)?;
        self.dev.synchronize()
    }

    fn stats_as_acc(&self, stats: &Stats) -> Result<Stats> {
        let shape = <Self as ChunkCompute<T>>::stats_shape(self, stats)
            .ok_or_else(|| AttnError::InvalidArgument("per-row values that do not fill their shape".into()))?;
        Ok(self.stats(self.dev.stream().clone_dtod(&stats.data).map_err(cuda_err)?, shape))
    }

    fn acc_as_stats(&self, acc: &Stats) -> Result<Stats> {
        if acc.shape.head_dim != 1 || acc.data.len() != acc.shape.lse_len() {
            let message = format!("an accumulator of head_dim {} as per-row values", acc.shape.head_dim);
            return Err(AttnError::InvalidArgument(message));
        }
        Ok(self.stats(self.dev.stream().clone_dtod(&acc.data).map_err(cuda_err)?, acc.shape))
    }

    fn finish_forward_slot(
        &self,
        problem: &RingProblem,
        partial: &Metered<DevicePartial>,
        slot: HeadSlot,
    ) -> Result<(Rows<T>, Stats)> {
        // Every head of a config takes one output scale, so a slot finishes as whole rows do.
        if slot.first() + partial.shape.heads > problem.heads.max(partial.shape.heads) {
            let message =
                format!("a partial of {} heads from head {} of {}", partial.shape.heads, slot.first(), problem.heads);
            return Err(AttnError::InvalidArgument(message));
        }
        <Self as ChunkCompute<T>>::finish_forward(self, problem, partial)
    }
}
