//! CUDA cases (feature `cuda`): `attn_kernels::cuda` on device 0, inputs uploaded once.
//!
//! A timed call allocates the output on the device, runs `forward_call` over the whole
//! sequence (the output straight from the kernel where every head has one pattern,
//! through an f32 partial otherwise; then `delta` and `backward_block` for forward +
//! backward) and synchronises the stream, so no host transfer is timed. The counting
//! allocator sees only host memory; the device memory a call holds is read with
//! `cuMemGetInfo` at the end of the first call and reported as `device_bytes`
//! (device-wide, so other processes on the GPU would show up in it).

use attn_core::error::TensorName;
use attn_core::{AttnError, DType, DilatedConfig, Result, Shape4, TensorView};
use attn_kernels::cuda::{self, CudaDevice, CudaElement, DeviceGrads, DeviceTensor, ForwardPath};
use half::{bf16, f16};

use crate::case::CaseSpec;
use crate::inputs::normal_vec;
use crate::runner::{RunStats, Runner};

/// Build the CUDA runner for `spec` in its dtype; `BackendUnavailable` without a GPU.
pub fn dilated(spec: &CaseSpec) -> Result<Box<dyn Runner>> {
    match spec.dtype {
        DType::F32 => Ok(Box::new(CudaRunner::<f32>::new(spec)?)),
        DType::BF16 => Ok(Box::new(CudaRunner::<bf16>::new(spec)?)),
        DType::F16 => Ok(Box::new(CudaRunner::<f16>::new(spec)?)),
        other => {
            Err(AttnError::InvalidArgument(format!("dtype {} is not benchmarked on the cuda backend", other.as_str())))
        }
    }
}

/// One line for the report: the device the CUDA cases ran on, or why they were skipped.
pub fn status() -> String {
    match CudaDevice::new(0) {
        Ok(dev) => {
            let (major, minor) = dev.compute_capability();
            format!("compiled in; CUDA cases run on device 0 (sm_{major}{minor})")
        }
        Err(e) => format!("compiled in, but CUDA cases are skipped: {e}"),
    }
}

/// Device memory in use (bytes), device-wide.
fn device_used(dev: &CudaDevice) -> Result<u64> {
    let (free, total) = dev.context().mem_get_info().map_err(|e| AttnError::backend("cuda", format!("{e:?}")))?;
    Ok(total.saturating_sub(free) as u64)
}

struct CudaRunner<T> {
    dev: CudaDevice,
    cfg: DilatedConfig,
    shape: Shape4,
    q: DeviceTensor<T>,
    k: DeviceTensor<T>,
    v: DeviceTensor<T>,
    grad_out: Option<DeviceTensor<T>>,
    /// Device memory in use before the inputs were uploaded; `None` once reported.
    used_before: Option<u64>,
}

impl<T: CudaElement> CudaRunner<T> {
    fn new(spec: &CaseSpec) -> Result<Self> {
        let dev = CudaDevice::new(0)?;
        let shape = spec.shape()?;
        let used_before = device_used(&dev)?;
        let upload = |seed: u64| -> Result<DeviceTensor<T>> {
            let host: Vec<T> = normal_vec(seed, shape.numel());
            DeviceTensor::from_view(&dev, &TensorView::contiguous(TensorName::Query, &host, shape)?)
        };
        let (q, k, v) = (upload(1)?, upload(2)?, upload(3)?);
        let grad_out = if spec.backward { Some(upload(4)?) } else { None };
        dev.synchronize()?;
        Ok(CudaRunner { cfg: spec.config()?, shape, q, k, v, grad_out, used_before: Some(used_before), dev })
    }
}

impl<T: CudaElement> Runner for CudaRunner<T> {
    fn run(&mut self) -> Result<RunStats> {
        let dev = &self.dev;
        let block = cuda::DeviceBlock::new(&self.cfg, (&self.q, 0), (&self.k, &self.v, 0));
        let mut out = DeviceTensor::<T>::zeros(dev, self.shape)?;
        let lse = cuda::forward_call(dev, &block, &mut out, ForwardPath::Direct)?;
        let grads = match &self.grad_out {
            Some(go) => {
                let delta = cuda::delta(dev, go, &out, None)?;
                let mut grads = DeviceGrads::zeros(dev, self.shape, self.shape)?;
                let upstream = cuda::DeviceUpstream { grad_out: go, lse: &lse, delta: &delta };
                cuda::backward_block(dev, &block, &upstream, &mut grads)?;
                Some((delta, grads))
            }
            None => None,
        };
        dev.synchronize()?;
        // Read while the call's buffers are still live (first call only: it is untimed).
        let device_bytes = match self.used_before.take() {
            Some(before) => Some(device_used(dev)?.saturating_sub(before)),
            None => None,
        };
        drop((grads, out, lse));
        Ok(RunStats { device_bytes, ..RunStats::default() })
    }
}
