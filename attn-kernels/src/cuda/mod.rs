//! CUDA backend (feature `cuda`): fused dilated attention forward and backward on NVIDIA
//! GPUs, kernels in `kernels/*.cu` compiled by NVRTC at run time (once per device).
//!
//! - [`CudaDevice::new`](crate::cuda::CudaDevice::new) checks libcuda, libnvrtc and the device first and returns
//!   `AttnError::BackendUnavailable` (never a panic) when any is missing; sm_80+ only.
//! - Whole calls from host views: [`CudaBackend`](crate::cuda::CudaBackend), the shared
//!   `Attention` interface (out + f32 LSE, exact backward); on device buffers
//!   [`forward_call`](crate::cuda::forward_call), which writes the output straight from
//!   the kernel where every head has one pattern, and [`backward_call`](crate::cuda::backward_call).
//!   A framework's tensors and stream become such buffers without copies through
//!   [`Foreign`](crate::cuda::Foreign) handles and [`CudaDevice::with_foreign_stream`](crate::cuda::CudaDevice::with_foreign_stream).
//! - Ring steps: [`forward_block`](crate::cuda::forward_block) LSE-merges a (q block, k block) pair into a
//!   [`DevicePartial`](crate::cuda::DevicePartial), [`finish_forward`](crate::cuda::finish_forward) applies the heads' `out_scale`;
//!   [`backward_block`](crate::cuda::backward_block) accumulates f32 gradients given the final LSE and [`delta`](crate::cuda::delta).
//! - Kernels: f16/bf16 forward (head dims up to 256) and backward (up to 128) on tensor
//!   cores (`mma.sync.m16n8k16`, f32 accumulation, dilation gather fused into the tile
//!   loads); f32, and the backward of wider heads, use the warp-per-row kernels (f32
//!   accumulation).

mod compile;
mod exec;
pub mod plan;

pub use compile::{kernel_cache, nvrtc};
pub use exec::{emulation, scratch};
pub use plan::{launch_plan, params, source};

pub use compile::library_search::{LibrarySearch, OpenedOnce, add_library_search_dirs, library_files_in};
pub use compile::nvrtc_library::{NVRTC_PATH_ENV, NvrtcLibrary, nvrtc_library, nvrtc_search, open_nvrtc};
pub use exec::bench::{BenchRun, Between, GpuTiming, attended_pairs, bench_forward, bench_pass};
pub use exec::block::{DeviceBlock, DeviceUpstream, backward_block, backward_block_into, forward_block};
pub use exec::call::{
    BackwardScratch, DeviceSaved, ForwardPath, backward_call, backward_call_in, backward_scratch_lens, forward_call,
    forward_call_by, forward_call_into,
};
pub use exec::device::{CudaDevice, check_available, device_count, driver_library_present};
pub use exec::epilogue::{delta, delta_into, finish_forward, store_scaled};
pub use exec::foreign::{
    Foreign, Forget, RawStream, check_device_span, foreign_key_padding, foreign_slice, foreign_tensor,
};
pub use exec::host::CudaBackend;
pub use exec::tensor::{
    CudaElement, DeviceBlockMask, DeviceGrads, DeviceGradsMut, DeviceKeyPadding, DevicePartial, DeviceTensor,
};
