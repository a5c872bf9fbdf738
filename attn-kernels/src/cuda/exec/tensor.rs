//! Device-memory tensors: strided `[batch, seq, heads, head_dim]` inputs/outputs, the f32
//! partial `(out, lse)` the forward merges into (its `lse` filled on the device), and the
//! f32 gradient accumulators; the masks a block reads (key padding, block mask).

use attn_core::error::TensorName;
use attn_core::{AttnError, Element, Result, Shape4, TensorView};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};
use half::{bf16, f16};

use super::device::{CudaDevice, cuda_err};
use super::launch::launch;
use crate::cuda::plan::launch_plan::BlockMaskShape;

/// Element types the CUDA kernels take (f64 has no kernels).
pub trait CudaElement: Element + DeviceRepr + ValidAsZeroBits + Unpin {
    /// Kernel-name suffix.
    const SUFFIX: &'static str;
}
impl CudaElement for f32 {
    const SUFFIX: &'static str = "f32";
}
impl CudaElement for f16 {
    const SUFFIX: &'static str = "f16";
}
impl CudaElement for bf16 {
    const SUFFIX: &'static str = "bf16";
}

/// A strided `[batch, seq, heads, head_dim]` tensor in device memory (head_dim stride 1).
#[derive(Debug)]
pub struct DeviceTensor<T> {
    pub data: CudaSlice<T>,
    pub shape: Shape4,
    pub strides: [usize; 4],
}

impl<T: CudaElement> DeviceTensor<T> {
    /// Upload a host view, keeping its strides (a fused-QKV view uploads its whole buffer).
    pub fn from_view(dev: &CudaDevice, view: &TensorView<'_, T>) -> Result<Self> {
        let shape = view.shape();
        let strides = view.strides();
        let extent = extent(shape, strides);
        let data = dev.stream.clone_htod(&view.data()[..extent]).map_err(cuda_err)?;
        Ok(DeviceTensor { data, shape, strides })
    }

    /// A zeroed contiguous tensor.
    pub fn zeros(dev: &CudaDevice, shape: Shape4) -> Result<Self> {
        let data = dev.stream.alloc_zeros::<T>(shape.numel()).map_err(cuda_err)?;
        Ok(DeviceTensor { data, shape, strides: shape.contiguous_strides() })
    }

    /// Download as a contiguous host vector (row-major, whatever the device strides).
    pub fn to_host_contiguous(&self, dev: &CudaDevice) -> Result<Vec<T>> {
        let raw = dev.stream.clone_dtoh(&self.data).map_err(cuda_err)?;
        // Device-to-pageable copies complete before returning; synchronise anyway so kernel
        // errors surface here as typed errors.
        dev.synchronize()?;
        let view = TensorView::strided(TensorName::Output, &raw, self.shape, self.strides)?;
        let mut v = Vec::with_capacity(self.shape.numel());
        for b in 0..self.shape.batch {
            for s in 0..self.shape.seq {
                for h in 0..self.shape.heads {
                    v.extend_from_slice(view.row(b, s, h));
                }
            }
        }
        Ok(v)
    }
}

/// Elements a strided view reaches (largest offset + 1).
pub(crate) fn extent(shape: Shape4, strides: [usize; 4]) -> usize {
    shape.dims().iter().zip(strides).map(|(d, s)| (d - 1) * s).sum::<usize>() + 1
}

/// The f32 partial of the forward: `out` `[batch, rows, heads, d]` (normalised over the
/// keys merged so far) and `lse` `[batch, rows, heads]` (`-inf` = nothing yet).
#[derive(Debug)]
pub struct DevicePartial {
    pub out: CudaSlice<f32>,
    pub lse: CudaSlice<f32>,
    pub shape: Shape4,
}

impl DevicePartial {
    /// An empty partial for inputs of dtype `T`: `out = 0`, `lse = -inf` (filled on the
    /// device by `T`'s kernel module, so no host copy and no other module's compile).
    pub fn empty<T: CudaElement>(dev: &CudaDevice, shape: Shape4) -> Result<Self> {
        let out = dev.stream.alloc_zeros::<f32>(shape.numel()).map_err(cuda_err)?;
        let lse = fill_lse::<T>(dev, shape.lse_len(), f32::NEG_INFINITY)?;
        Ok(DevicePartial { out, lse, shape })
    }
}

/// The launch of `fill_lse_*` over `len` values (a grid-stride loop, 256 threads a block).
pub(crate) fn fill_launch(len: usize) -> LaunchConfig {
    let blocks = len.div_ceil(256).clamp(1, 65_535) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// A new f32 buffer of `len` values, each `value` (filled by `T`'s module: a call
/// compiles no other dtype's kernels).
pub(crate) fn fill_lse<T: CudaElement>(dev: &CudaDevice, len: usize, value: f32) -> Result<CudaSlice<f32>> {
    let mut dst = dev.stream.alloc_zeros::<f32>(len).map_err(cuda_err)?;
    fill_into::<T>(dev, &mut dst, value)?;
    Ok(dst)
}

/// Every value of `dst` set to `value` by `T`'s module.
pub(crate) fn fill_into<T: CudaElement>(dev: &CudaDevice, dst: &mut CudaSlice<f32>, value: f32) -> Result<()> {
    let len = dst.len();
    let lc = fill_launch(len);
    let f = dev.function(T::SUFFIX, &format!("fill_lse_{}", T::SUFFIX), 0)?;
    let n = len as i64;
    // Signature: (float* dst, float value, long long n).
    let mut args = dev.stream.launch_builder(&f);
    args.arg(dst).arg(&value).arg(&n);
    launch(args, lc)
}

/// f32 gradient accumulators: `dq` like q, `dk` and `dv` like k.
#[derive(Debug)]
pub struct DeviceGrads {
    pub dq: CudaSlice<f32>,
    pub dk: CudaSlice<f32>,
    pub dv: CudaSlice<f32>,
    pub q_shape: Shape4,
    pub kv_shape: Shape4,
}

impl DeviceGrads {
    pub fn zeros(dev: &CudaDevice, q_shape: Shape4, kv_shape: Shape4) -> Result<Self> {
        let z = |n| dev.stream.alloc_zeros::<f32>(n).map_err(cuda_err);
        Ok(DeviceGrads {
            dq: z(q_shape.numel())?,
            dk: z(kv_shape.numel())?,
            dv: z(kv_shape.numel())?,
            q_shape,
            kv_shape,
        })
    }
}

/// Gradient accumulators borrowed one by one, with the shapes they hold.
#[derive(Debug)]
pub struct DeviceGradsMut<'a> {
    pub dq: &'a mut CudaSlice<f32>,
    pub dk: &'a mut CudaSlice<f32>,
    pub dv: &'a mut CudaSlice<f32>,
    pub q_shape: Shape4,
    pub kv_shape: Shape4,
}

impl DeviceGrads {
    /// The accumulators borrowed one by one.
    pub fn as_mut(&mut self) -> DeviceGradsMut<'_> {
        let (q_shape, kv_shape) = (self.q_shape, self.kv_shape);
        DeviceGradsMut { dq: &mut self.dq, dk: &mut self.dk, dv: &mut self.dv, q_shape, kv_shape }
    }
}

pub(crate) fn check_len(tensor: TensorName, got: usize, expected: usize) -> Result<()> {
    if got != expected {
        return Err(AttnError::ShapeMismatch { tensor, expected: vec![expected], got: vec![got] });
    }
    Ok(())
}

/// A key padding mask in device memory: u8 flags `[batch, seq]` over GLOBAL key
/// positions (1 = padding, never attended), as `attn_core::KeyPadding` on the host.
#[derive(Debug)]
pub struct DeviceKeyPadding {
    pub flags: CudaSlice<u8>,
    pub batch: usize,
    pub seq: usize,
}

impl DeviceKeyPadding {
    /// Upload a host mask.
    pub fn upload(dev: &CudaDevice, mask: &attn_core::KeyPadding<'_>) -> Result<Self> {
        let bytes: Vec<u8> = mask.flags().iter().map(|&f| u8::from(f)).collect();
        let flags = dev.stream.clone_htod(&bytes).map_err(cuda_err)?;
        Ok(DeviceKeyPadding { flags, batch: mask.batch(), seq: mask.seq() })
    }
}

/// A block mask on the device: its entries (u8, 1 = kept) and sizes. A function of global
/// positions, so every block of a ring call reads the one mask of the whole call.
#[derive(Debug)]
pub struct DeviceBlockMask {
    pub keep: CudaSlice<u8>,
    pub shape: BlockMaskShape,
}

impl DeviceBlockMask {
    /// Upload a host mask.
    pub fn upload(dev: &CudaDevice, mask: &attn_core::BlockMask<'_>) -> Result<Self> {
        let keep = dev.stream.clone_htod(mask.keep()).map_err(cuda_err)?;
        Ok(DeviceBlockMask { keep, shape: BlockMaskShape::from(*mask) })
    }
}
