//! The CUDA device handle: library and device checks (typed errors, never a panic),
//! the context and stream, and the NVRTC-compiled kernel module, cached per device (and
//! on disk, [`crate::cuda::compile::kernel_cache`]).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use attn_core::{AttnError, Result};
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError};

use super::scratch::{ScratchAlloc, ScratchBuffer, ScratchPool, ScratchSlot};
use crate::cuda::compile::kernel_cache::KernelCache;
use crate::cuda::compile::nvrtc::{ArchFeatures, ImageKind, ImageSource, Target, process_image, recompile_for_process};
use crate::cuda::compile::nvrtc_library::{NVRTC_PATH_ENV, nvrtc_library};
use crate::cuda::compile::slots::Slots;
use crate::cuda::plan::patterns::{
    BackwardDq, BackwardKeys, BackwardLoads, BackwardMma, BackwardOptions, BackwardQueries, BackwardWrites, ForwardMma,
    ForwardOptions, ForwardRows, ForwardStages, PatternFusion,
};
use crate::cuda::plan::source::{
    MIN_COMPUTE_CAPABILITY, dtype_define, full_source, kernel_names_for, sm90a_kernel_names_for,
};

const BACKEND: &str = "cuda";

/// The one compute capability the sm_90a kernels run on (H100, H200).
const SM90A: (i32, i32) = (9, 0);

/// Wrap a CUDA driver / NVRTC error.
pub(crate) fn cuda_err(e: impl std::error::Error + Send + Sync + 'static) -> AttnError {
    AttnError::backend(BACKEND, e)
}

fn unavailable(reason: impl Into<String>) -> AttnError {
    AttnError::BackendUnavailable { backend: BACKEND, reason: reason.into() }
}

/// Whether the NVIDIA driver library loads, without calling into it. This works whichever
/// way cudarc reaches libcuda: loaded at run time (this workspace's choice) or linked
/// (`dynamic-linking`, which candle's `cuda` feature selects and which then wins).
pub fn driver_library_present() -> bool {
    DRIVER_LIBRARY_NAMES.iter().any(|name| {
        // SAFETY: loading libcuda runs only its initialisers, which have no preconditions;
        // no symbol is read and the handle is closed when it drops.
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}

/// The names the driver installs (`libcuda.so` only comes with development packages).
const DRIVER_LIBRARY_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Check, in order, that libcuda and libnvrtc load and that device `ordinal` exists.
/// Every failure is `AttnError::BackendUnavailable` with the reason.
pub fn check_available(ordinal: usize) -> Result<()> {
    if !driver_library_present() {
        return Err(unavailable("libcuda (the NVIDIA driver library) was not found"));
    }
    nvrtc_library()?;
    let count = device_count()?;
    if ordinal >= count {
        return Err(unavailable(format!("device {ordinal} requested but {count} CUDA device(s) found")));
    }
    Ok(())
}

/// Whether the driver refused a module image as such (not memory or an earlier fault).
fn refused_image(e: &DriverError) -> bool {
    use cudarc::driver::sys::CUresult::*;
    matches!(
        e.0,
        CUDA_ERROR_INVALID_IMAGE
            | CUDA_ERROR_INVALID_PTX
            | CUDA_ERROR_UNSUPPORTED_PTX_VERSION
            | CUDA_ERROR_NO_BINARY_FOR_GPU
            | CUDA_ERROR_INVALID_SOURCE
    )
}

/// How many CUDA devices this process sees (`CUDA_VISIBLE_DEVICES` applied); a typed
/// error without the driver.
pub fn device_count() -> Result<usize> {
    if !driver_library_present() {
        return Err(unavailable("libcuda (the NVIDIA driver library) was not found"));
    }
    let count = CudaContext::device_count().map_err(|e| unavailable(format!("cuInit/cuDeviceGetCount: {e:?}")))?;
    Ok(count.max(0) as usize)
}

/// A module and the kind of image it was loaded from.
type Loaded = (Arc<CudaModule>, ImageKind);

/// A module's key: device ordinal, dtype suffix, and whether it has the
/// architecture-specific kernels.
type ModuleKey = (usize, &'static str, ArchFeatures);

/// The modules by [`ModuleKey`], each loaded once behind its own lock, so a slow compile
/// holds up only the callers that need that same module.
fn modules() -> &'static Slots<ModuleKey, Loaded> {
    static MODULES: OnceLock<Slots<ModuleKey, Loaded>> = OnceLock::new();
    MODULES.get_or_init(Slots::new)
}

/// The driver's refusal of an image, with what the image was and the usual cause.
fn load_error(e: DriverError, kind: ImageKind, target: Target) -> AttnError {
    let image = match kind {
        ImageKind::Cubin => format!("a cubin for sm_{}", target.arch()),
        ImageKind::Ptx => "PTX".to_string(),
    };
    let nvrtc = nvrtc_library().map(|l| format!("NVRTC {}.{} ({})", l.version().0, l.version().1, l.path()));
    let nvrtc = nvrtc.unwrap_or_else(|_| "NVRTC".into());
    let hint = match refused_image(&e) {
        true => format!("; a driver older than {nvrtc} refuses its images: set {NVRTC_PATH_ENV} to an older NVRTC"),
        false => String::new(),
    };
    AttnError::backend(
        BACKEND,
        std::io::Error::other(format!("the driver did not load the kernels ({image} from {nvrtc}): {e:?}{hint}")),
    )
}

/// A CUDA device ready to run the dilated-attention kernels.
#[derive(Debug, Clone)]
pub struct CudaDevice {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    compute_capability: (i32, i32),
    forward: ForwardOptions,
    backward: BackwardOptions,
    /// The whole calls' scratch, one pool per stream (by its handle), shared by every
    /// handle made from this one: work on one stream runs in order, so a buffer given back
    /// after its launches were queued is free for the next call on that stream.
    scratch: Arc<Mutex<HashMap<usize, ScratchPool<CudaSlice<f32>>>>>,
}

impl ScratchBuffer for CudaSlice<f32> {
    fn len(&self) -> usize {
        CudaSlice::len(self)
    }
}

impl ScratchAlloc for CudaDevice {
    type Buffer = CudaSlice<f32>;

    fn alloc_f32(&self, len: usize) -> Result<CudaSlice<f32>> {
        self.stream.alloc_zeros::<f32>(len).map_err(cuda_err)
    }
}

impl CudaDevice {
    /// Open device `ordinal`: check libraries and device and require sm_80+. Kernels are
    /// compiled by NVRTC for this device's architecture on first use, one module per
    /// dtype, cached for the process. The forward's rows a block and pattern fusion come
    /// from `ATTN_CUDA_FWD_ROWS` and `ATTN_CUDA_FWD_LAUNCH`, the backward's query-tile loads
    /// keys a block and dq sum from `ATTN_CUDA_BWD_LOADS`, `ATTN_CUDA_BWD_KEYS` and
    /// `ATTN_CUDA_BWD_DQ`; an unknown
    /// value is an error, and an unset one is the architecture's measured fastest
    /// ([`ForwardOptions::measured_fastest`], [`BackwardOptions::measured_fastest`]).
    pub fn new(ordinal: usize) -> Result<Self> {
        check_available(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err)?;
        let cc = ctx.compute_capability().map_err(cuda_err)?;
        if cc < MIN_COMPUTE_CAPABILITY {
            return Err(unavailable(format!("device {ordinal} is sm_{}{}; sm_80 or newer is required", cc.0, cc.1)));
        }
        let forward = ForwardOptions::from_env_or(ForwardOptions::measured_fastest(cc))?;
        let backward = BackwardOptions::from_env_or(BackwardOptions::measured_fastest(cc))?;
        let stream = ctx.default_stream();
        let dev = CudaDevice { ctx, stream, compute_capability: cc, forward, backward, scratch: Arc::default() };
        dev.with_forward_mma(forward.mma)?.with_backward_mma(backward.mma)
    }

    /// The same device and stream with the f16/bf16 forward's instructions as `mma` says;
    /// [`ForwardMma::Wgmma`] (modules compiled for sm_90a) on a device other than sm_90 is
    /// `BackendUnavailable`.
    pub fn with_forward_mma(&self, mma: ForwardMma) -> Result<Self> {
        if mma == ForwardMma::Wgmma {
            self.require_sm90("the wgmma forward (ATTN_CUDA_FWD_MMA=wgmma)")?;
        }
        Ok(CudaDevice { forward: ForwardOptions { mma, ..self.forward }, ..self.clone() })
    }

    /// `BackendUnavailable` naming `what` unless this device is sm_90 (its modules can then
    /// be compiled for sm_90a).
    fn require_sm90(&self, what: &str) -> Result<()> {
        let cc = self.compute_capability;
        if cc == SM90A {
            return Ok(());
        }
        let ordinal = self.ctx.ordinal();
        Err(unavailable(format!("{what} needs an sm_90 device; device {ordinal} is sm_{}{}", cc.0, cc.1)))
    }

    /// The same device and stream with the f16/bf16 backward's instructions as `mma` says;
    /// [`BackwardMma::Wgmma`] (modules compiled for sm_90a) on a device other than sm_90 is
    /// `BackendUnavailable`.
    pub fn with_backward_mma(&self, mma: BackwardMma) -> Result<Self> {
        if mma == BackwardMma::Wgmma {
            self.require_sm90("the wgmma backward (ATTN_CUDA_BWD_MMA=wgmma)")?;
        }
        Ok(CudaDevice { backward: BackwardOptions { mma, ..self.backward }, ..self.clone() })
    }

    /// The same device and stream with the tensor-core forward taking `rows` query rows a
    /// block (128 needs more shared memory a block than some sm_86/sm_89 parts allow: their
    /// launches then fail with a typed error).
    pub fn with_forward_rows(&self, rows: ForwardRows) -> Self {
        CudaDevice { forward: ForwardOptions { rows, ..self.forward }, ..self.clone() }
    }

    /// The same device and stream with the tensor-core forward running `stages` K/V stages.
    pub fn with_forward_stages(&self, stages: ForwardStages) -> Self {
        CudaDevice { forward: ForwardOptions { stages, ..self.forward }, ..self.clone() }
    }

    /// The same device and stream with the tensor-core forward's patterns launched as
    /// `fusion` says.
    pub fn with_pattern_fusion(&self, fusion: PatternFusion) -> Self {
        CudaDevice { forward: ForwardOptions { fusion, ..self.forward }, ..self.clone() }
    }

    /// The same device and stream with the tensor-core backward loading its query tiles as
    /// `loads` says.
    pub fn with_backward_loads(&self, loads: BackwardLoads) -> Self {
        CudaDevice { backward: BackwardOptions { loads, ..self.backward }, ..self.clone() }
    }

    /// The same device and stream with the tensor-core backward taking `keys` keys a block.
    pub fn with_backward_keys(&self, keys: BackwardKeys) -> Self {
        CudaDevice { backward: BackwardOptions { keys, ..self.backward }, ..self.clone() }
    }

    /// The same device and stream with the backward summing dq as `dq` says.
    pub fn with_backward_dq(&self, dq: BackwardDq) -> Self {
        CudaDevice { backward: BackwardOptions { dq, ..self.backward }, ..self.clone() }
    }

    /// The same device and stream with a whole call's backward writing dk and dv as
    /// `writes` says.
    pub fn with_backward_writes(&self, writes: BackwardWrites) -> Self {
        CudaDevice { backward: BackwardOptions { writes, ..self.backward }, ..self.clone() }
    }

    /// The same device and stream, the tensor-core backward's query tiles of `queries` rows.
    pub fn with_backward_queries(&self, queries: BackwardQueries) -> Self {
        CudaDevice { backward: BackwardOptions { queries, ..self.backward }, ..self.clone() }
    }

    /// The tensor-core backward's query-tile loads, keys a block, dq sum and dk/dv writes.
    pub fn backward_options(&self) -> BackwardOptions {
        self.backward
    }

    /// Query rows a block of the tensor-core forward.
    pub fn forward_rows(&self) -> ForwardRows {
        self.forward.rows
    }

    /// The tensor-core forward's rows a block, pattern fusion and K/V stages.
    pub fn forward_options(&self) -> ForwardOptions {
        self.forward
    }

    /// What this device's modules are compiled for: sm_90a where the forward or the
    /// backward runs the wgmma kernels (only an sm_90 device opens with them), else the
    /// device's own architecture.
    fn target(&self) -> Target {
        let features = match (self.forward.mma, self.backward.mma) {
            (ForwardMma::Wgmma, _) | (_, BackwardMma::Wgmma) => ArchFeatures::Specific,
            (ForwardMma::MmaSync, BackwardMma::MmaSync) => ArchFeatures::Portable,
        };
        Target { cc: self.compute_capability, features }
    }

    /// The module holding the kernels of dtype `suffix` (`f32`, `f16`, `bf16`), compiled
    /// on first use: a cubin for this device's architecture, PTX where NVRTC cannot.
    fn module(&self, suffix: &'static str) -> Result<Arc<CudaModule>> {
        Ok(self.module_and_kind(suffix)?.0)
    }

    /// [`Self::module`] and whether it was loaded from a cubin or from PTX.
    fn module_and_kind(&self, suffix: &'static str) -> Result<Loaded> {
        let key = (self.ctx.ordinal(), suffix, self.target().features);
        Ok(modules().get_or_make(key, || self.load(suffix))?.0)
    }

    /// The module of dtype `suffix` from the kernel cache or NVRTC, loaded on this device.
    fn load(&self, suffix: &'static str) -> Result<Loaded> {
        let (src, extra, cc) = (full_source(), [dtype_define(suffix)?], self.target());
        let disk = KernelCache::from_env();
        let (image, from) = process_image(&src, cc, &extra, disk.as_ref())?;
        match self.ctx.load_module(image.to_ptx()) {
            Ok(m) => Ok((m, image.kind)),
            // A kept image this driver refuses as an image: compile afresh and keep that,
            // unless the compile gives the same bytes (the driver would refuse them again).
            Err(e) if from != ImageSource::Nvrtc && refused_image(&e) => {
                let fresh = recompile_for_process(&src, cc, &extra, disk.as_ref())?;
                if fresh == image {
                    return Err(load_error(e, image.kind, cc));
                }
                let m = self.ctx.load_module(fresh.to_ptx()).map_err(|e| load_error(e, fresh.kind, cc))?;
                Ok((m, fresh.kind))
            }
            Err(e) => Err(load_error(e, image.kind, cc)),
        }
    }

    /// How the kernels of dtype `suffix` reach this device (compiling them if needed):
    /// `"cubin sm_XX"` or `"ptx compute_XX"` (`sm_90a` where a wgmma kernel runs).
    pub fn kernel_image(&self, suffix: &'static str) -> Result<String> {
        let arch = self.target().arch();
        Ok(match self.module_and_kind(suffix)?.1 {
            ImageKind::Cubin => format!("cubin sm_{arch}"),
            ImageKind::Ptx => format!("ptx compute_{arch}"),
        })
    }

    /// A handle on the same device and context whose launches go to a new stream of its
    /// own (ranks sharing one GPU each take one).
    pub fn with_own_stream(&self) -> Result<Self> {
        let stream = self.ctx.new_stream().map_err(cuda_err)?;
        Ok(CudaDevice { stream, ..self.clone() })
    }

    /// The same device launching on `stream`, a stream another library made on this
    /// device's (primary) context, such as candle's: the kernels are then ordered with
    /// that library's work. A stream of another context is an error.
    pub fn with_stream(&self, stream: Arc<CudaStream>) -> Result<Self> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(AttnError::InvalidArgument(format!(
                "the stream belongs to another CUDA context than device {}'s primary context",
                self.ctx.ordinal()
            )));
        }
        Ok(CudaDevice { stream, ..self.clone() })
    }

    /// The scratch pool of this handle's stream, locked (the pools stay whole whatever a
    /// panicking holder did: a slot holds a buffer or nothing).
    fn with_pool<R>(&self, f: impl FnOnce(&mut ScratchPool<CudaSlice<f32>>) -> R) -> R {
        let mut pools = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        f(pools.entry(self.stream.cu_stream() as usize).or_default())
    }

    /// Scratch buffer `slot` of `len` values from this stream's pool (allocated where the
    /// pool keeps none of that length).
    pub(crate) fn take_scratch(&self, slot: ScratchSlot, len: usize) -> Result<CudaSlice<f32>> {
        self.with_pool(|pool| pool.take(self, slot, len))
    }

    /// Keep `buffer` for the next call on this stream.
    pub(crate) fn give_scratch(&self, slot: ScratchSlot, buffer: CudaSlice<f32>) {
        self.with_pool(|pool| pool.give(slot, buffer));
    }

    /// Device buffers the whole calls on this handle's stream have allocated for scratch
    /// (none after the first call while the shapes repeat).
    pub fn scratch_allocations(&self) -> u64 {
        self.with_pool(|pool| pool.allocations())
    }

    /// Drop the scratch kept for this handle's stream (the next whole call allocates anew).
    pub fn release_scratch(&self) {
        self.scratch.lock().unwrap_or_else(PoisonError::into_inner).remove(&(self.stream.cu_stream() as usize));
    }

    /// Blocks of kernel `f` (`threads` a block, `smem_bytes` of dynamic shared memory) the
    /// device holds at once: its SM count times the blocks an SM holds (at least one), the
    /// grid of a persistent launch.
    pub(crate) fn resident_blocks(&self, f: &CudaFunction, threads: u32, smem_bytes: u32) -> Result<u32> {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        let sms = self.ctx.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(cuda_err)?;
        let per_sm = f.occupancy_max_active_blocks_per_multiprocessor(threads, smem_bytes as usize, None);
        Ok(u32::try_from(sms).unwrap_or(1).max(1) * per_sm.map_err(cuda_err)?.max(1))
    }

    /// `(major, minor)` compute capability.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// The CUDA context (for callers that share the device, e.g. an NCCL communicator).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launch of this handle goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Load kernel `name` of the dtype module `suffix`, allowing `smem_bytes` of dynamic
    /// shared memory.
    pub(crate) fn function(&self, suffix: &'static str, name: &str, smem_bytes: usize) -> Result<CudaFunction> {
        let f = self.module(suffix)?.load_function(name).map_err(cuda_err)?;
        if smem_bytes > 48 * 1024 {
            f.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                i32::try_from(smem_bytes).map_err(|_| AttnError::InvalidArgument("shared memory size".into()))?,
            )
            .map_err(cuda_err)?;
        }
        Ok(f)
    }

    /// Compile (or read from the kernel cache) and load every kernel of the dtype module
    /// `suffix` now, so no later launch loads one: under lazy loading (CUDA 12.2's default)
    /// loading a kernel may synchronise the context, which a ring rank must not do while a
    /// collective it posted waits for its peers.
    pub fn load_kernels(&self, suffix: &'static str) -> Result<()> {
        let m = self.module(suffix)?;
        let hopper = match self.target().features {
            ArchFeatures::Specific => sm90a_kernel_names_for(suffix),
            ArchFeatures::Portable => Vec::new(),
        };
        for name in kernel_names_for(suffix).into_iter().chain(hopper) {
            m.load_function(&name).map_err(cuda_err)?;
        }
        Ok(())
    }

    /// Wait for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda_err)
    }
}
