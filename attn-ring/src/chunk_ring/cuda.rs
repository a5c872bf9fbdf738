//! [`CudaChunks`]: the chunk ring's blocks on the CUDA kernels. Pieces, partials, lse,
//! delta and gradient accumulators stay in device memory, each counted in the rank's
//! [`DeviceMeter`]; the LSE merge is the forward kernels' own. Host bytes are made only
//! where a host-staged transport asks for them.

use std::ops::Range;
use std::sync::Arc;

use attn_core::error::TensorName;
use attn_core::{AttnError, PackedSequences, Result, Shape4};
use attn_kernels::cuda::{
    CudaDevice, CudaElement, DeviceBlock, DeviceBlockMask, DeviceGradsMut, DeviceKeyPadding, DevicePartial,
    DeviceTensor, DeviceUpstream, backward_block_into, delta, finish_forward, forward_block, store_scaled,
};
use cudarc::driver::CudaSlice;

use super::device_meter::{DeviceMeter, Metered};
use super::{
    ChunkBlock, ChunkCompute, ChunkGrads, ChunkUpstream, HeadSlot, check_bsh_len, check_stats, whole_heads_only,
};
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
        let ChunkBlock { problem, masks, q, q_start, k, v, k_start, .. } = *block;
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
        }
    }
}

/// The CUDA kernels attend every head of their rows: a block over a slot of heads is refused.
fn every_head<R, M>(block: &ChunkBlock<'_, R, M>) -> Result<()> {
    match block.heads {
        HeadSlot::Every => Ok(()),
        HeadSlot::Slot { .. } => Err(whole_heads_only("cuda")),
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
        every_head(block)?;
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
        every_head(block)?;
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
}
