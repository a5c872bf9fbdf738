//! Backends of `attn`: flash-style fused dilated attention on the CPU (forward and
//! backward, f32/bf16/f16 with f32 accumulation), the block-level entry points the ring
//! uses, and CUDA kernels behind the `cuda` feature.
//!
//! ```
//! use attn_core::{DilatedConfig, Shape4};
//! use attn_kernels::CpuBackend;
//! # fn main() -> attn_core::Result<()> {
//! let cfg = DilatedConfig::builder().segments(&[16, 32]).dilations(&[1, 2]).causal().build()?;
//! let shape = Shape4::new(1, 64, 4, 16)?; // [batch, seq, heads, head_dim]
//! let q: Vec<f32> = (0..shape.numel()).map(|i| (i as f32 * 0.11).sin()).collect();
//! let (k, v) = (q.iter().map(|x| x * 0.5).collect::<Vec<_>>(), q.iter().rev().copied().collect::<Vec<_>>());
//! let cpu = CpuBackend::new(2)?; // threads are an explicit parameter
//! let (out, lse) = cpu.forward_vec(&cfg, shape, &q, &k, &v)?;
//! let grad_out = vec![1.0f32; out.len()];
//! let (dq, dk, dv) = cpu.backward_vec(&cfg, shape, [&q, &k, &v], &out, &lse, &grad_out)?;
//! assert_eq!((dq.len(), dk.len(), dv.len()), (q.len(), k.len(), v.len()));
//! # Ok(()) }
//! ```
//!
//! Layers, one folder each; a file imports only its own layer and those below it.
//! `cpu/schedule`: [`block`] (public block API, via `piece`) and [`CpuBackend`] (whole
//! tensors, via `units`) find pieces (the selected rows of one pattern segment) from
//! global positions. `cpu/tiles`: the forward (`piece_forward`: the kernel chosen once
//! per piece as a value, bf16 pairs, queries in lanes (`lane_forward`) or rows
//! (`tile_forward`), after packing what the choice reads) and the backward
//! (`tile_backward`: dq and dk/dv loops over one shared tile step) run a piece
//! flash-style, tile by tile, on packed f32 tiles (`f32_tiles`: the dilation gather and
//! dtype conversion fused into packing). `cpu/isa`: the tile primitives written once
//! over the `Simd` trait (`kernels`), implemented by `avx512`, `avx2` and `portable`,
//! whose vectors `ops` picks once per piece ([`Isa`], detected once at run time,
//! `ATTN_CPU_ISA` to override). With the `cuda`
//! feature, `cuda/plan` (host planning: kernel choices, names and source, launch plans),
//! `cuda/compile` (NVRTC, the kernel cache) and `cuda/exec` (device, tensors, launches,
//! whole calls, the emulation).
//!
//! With AMX-BF16 ([`Isa::Amx`]) or AVX512-BF16 ([`Isa::Avx512Bf16`], chosen on AMD only)
//! the bf16 forward runs its products on bf16 pairs (`bf16_pairs`: the tile unit or
//! `vdpbf16ps`); everything else uses the AVX-512 kernels.
//!
//! Unsafe code lives only in `avx512`, `avx2`, `portable`, `simd`, `row_io` and
//! `bf16_pairs::arch` (intrinsics, vector loads and tile instructions), `kernels` (the
//! primitives' pointer loops behind bounds-checked safe entry points), `cpu_features` (the AMX permission
//! request), `disjoint` (shared output buffer, disjoint rows), `backend` (the disjoint
//! row writes of work units), `huge_pages` (`madvise` on fresh buffers) and, with the
//! `cuda` feature, `cuda::device`, `cuda::launch`, `cuda::params`, `cuda::nvrtc` and
//! `cuda::nvrtc_library` (the driver and NVRTC calls), `cuda::foreign` (memory and
//! streams another library owns) and `cuda::emulation` (loading the CPU emulator library). Only `ops`, the dispatch module, calls into `avx512`,
//! `avx2`, `portable` and `bf16_pairs`; every CPU feature check is in `cpu_features`.
//!
//! # Structure
//!
//! The fast backends, `CpuBackend` and `CudaBackend`, both
//! `Attention<T>` (plus `forward_vec`/`backward_vec` on contiguous buffers; a
//! `Shape4` is self-attention, an `AttnShape` with its own key length
//! cross-attention). A CPU call is cut into fixed units (`units`) of one lane (a batch
//! row or a packed sequence), one head (a query head; a key/value head for dk/dv, over
//! the query heads reading it) and a range of rows; a unit (`unit_passes`) finds the
//! selected rows of each pattern segment from lane positions, the keys within its
//! queries' band and not padded, packs q/k/v rows (`f32_tiles`) straight from the
//! caller's strided views into f32 tiles (dilation gather and dtype conversion
//! happen there), and runs flash-style tiles (score block, online softmax in base
//! 2, P·V). On AVX-512 and AVX2 the f32/f16 forward runs `lane_forward`: scores
//! transposed (keys are rows, 64 queries in SIMD lanes), so the softmax's maxima,
//! sums and rescales are lane-wise with a lazily raised maximum; a causal piece
//! holding a non-finite value goes to the row kernel (`tile_forward`, also the
//! portable path). `score_bound` scans q and k for the score-overflow check
//! before anything runs. Under a block mask (`Masks::block`) each piece is cut into
//! sub-pieces of its kept blocks (`block_split`: runs of query blocks with equal mask rows,
//! or of key blocks with equal columns for dk/dv), so a removed tile is never packed nor
//! scored and every kernel below runs unchanged. The backward recomputes scores from the final LSE and does dq, dk, dv
//! in one pass per segment. Tile primitives are written once over `Simd` (`kernels`)
//! and monomorphised for AVX-512, AVX2+FMA or portable Rust; one module, `ops` (the
//! only caller of `avx512`, `avx2`, `portable` and `bf16_pairs`), picks them once per
//! piece on the `Isa` detected once from
//! `cpu_features` (the one place CPU and OS features are checked; `ATTN_CPU_ISA`
//! overrides). On CPUs with
//! AVX512-BF16 (`Isa::Avx512Bf16`, chosen on AMD Zen 4 and later, where `vdpbf16ps`
//! issues at the FMA rate; Intel cores without AMX run the f32 kernel) or AMX-BF16 (`Isa::Amx`,
//! Sapphire Rapids and later, once Linux grants the tile state) the bf16 forward
//! runs `q·kᵀ` and `p·v` on bf16 pairs (`bf16_pairs`: one pair packing (`pair_tiles`, AVX-512 where present) read by
//! two engines, `vdpbf16ps` register blocks or the tile unit with the output kept
//! in tiles; scores one step ahead of the AVX-512 online softmax, lazy
//! rescaling); a piece holding a NaN/Inf, or a head wider
//! than 512, goes to the f32 kernel. `block` is the
//! entry point the ring uses (a query block against a key block, both with
//! positions); its group lists and piece buffers live in a per-thread
//! `BlockScratch` (`piece`), so a warm thread's block calls allocate nothing. `cuda` (feature `cuda`) holds NVRTC-compiled `.cu` kernels
//! driven through cudarc (`CudaBackend` for whole calls, the block entry points for
//! ring steps, both with grouped k/v heads, a `Band`, a u8 key padding mask, packed
//! sequences as per-sequence launches and a block mask (`DeviceBlockMask`: a block-masked
//! block is planned on the warp-per-row kernels, whose key loops jump over removed blocks); `nvrtc` compiles each dtype's module to a cubin for
//! the device's own `sm_XX`, PTX for the newest architecture NVRTC knows only where it
//! cannot, with the libnvrtc `nvrtc_library` finds (12 or 13, by linker name or directory,
//! not cudarc's lookup), keeps each image for the process (one compile for all devices of
//! an architecture), and `kernel_cache` keeps it on disk under its whole key (NVRTC
//! version, options, source); `device` loads a module per (device, dtype), each behind its
//! own lock so a compile holds up only its own callers; index arithmetic in 32 bits, so
//! positions stay below 2^31). A whole call (`forward_call`) whose heads each have one pattern writes the
//! output and lse straight from the tensor-core kernel (`plan_forward_direct`); ring
//! blocks and LongNet heads LSE-merge into an f32 partial that an epilogue writes out.
//! Whole calls on device tensors (`call`: `forward_call_into`, `backward_call`) also run
//! on memory and a stream another library owns (`foreign`: `Foreign` handles forget the
//! memory instead of freeing it, and are made only where the driver places the span's ends
//! on the device; `with_foreign_stream` queues on the caller's stream).
//! The tensor-core forward takes 64 query rows a block over 4 warps, 128 over 8, or 128
//! over 4 with two row tiles a warp (`ForwardRows`, a device's choice,
//! `ATTN_CUDA_FWD_ROWS`); where every head has one
//! pattern, the patterns' launches can be one launch of the fused kernel, whose blocks
//! find their pattern in a table in the parameters, or one persistent launch of a grid
//! sized to the machine whose blocks take the table's entries from a work counter
//! (`PatternFusion`, `ATTN_CUDA_FWD_LAUNCH`), its K/V tiles in two stages or three (`ForwardStages`,
//! `ATTN_CUDA_FWD_STAGES`; `dilated_fwd_mma3.cu`, one barrier a key tile; both kernels
//! share `attend_tile.cu`). The tensor-core backward loads its query tiles before each
//! tile's compute, or in two `cp.async` stages (`BackwardLoads`, `ATTN_CUDA_BWD_LOADS`;
//! both give the same bits), over 64 keys a block or 128 (`BackwardKeys`,
//! `ATTN_CUDA_BWD_KEYS`), query tiles of 32 rows or 64 (`BackwardQueries`,
//! `ATTN_CUDA_BWD_QUERIES`; the same bits), summing dq by atomics or deterministically (`BackwardDq`,
//! `ATTN_CUDA_BWD_DQ`: the tensor-core kernel without dq, then the query-major
//! tensor-core dq kernel, `dilated_bwd_dq_mma.cu`), and a whole call writes its gradients
//! through f32 accumulators or, where each row has one writer (dk/dv; dq under the
//! deterministic dq), straight into them (`BackwardWrites`, `ATTN_CUDA_BWD_WRITES`,
//! `plan_backward_direct`). Unset, each is the architecture's measured fastest
//! (`measured_fastest`: sm_90) or, untimed, the shape with the least shared memory.
//! Whole calls (`call`) take their f32 scratch from the caller (`backward_call_in`) or
//! from the stream's `scratch` pool, so a repeated shape allocates nothing; the emulation
//! runs the same pool code on host memory.
//! The sm_90a forward (`dilated_fwd_wgmma.cu` over `tma_mbarrier.cu` and `wgmma.cu`: TMA
//! tiles from stride-r tensor maps, an mbarrier ring, a producer and a consumer warpgroup,
//! wgmma) compiles only for `sm_90a` (`source::sm90a_kernel_names_for`, assembled by
//! `attn-ptx`). Under `ForwardMma::Wgmma` (`ATTN_CUDA_FWD_MMA=wgmma` on an sm_90 device,
//! its modules then compiled for sm_90a: `nvrtc::Target`) the forward plan runs it one
//! launch a pattern wherever it takes the launch (`launch_plan::hopper_forward`), each such
//! launch keeping its `mma.sync` launch as `Planned::fallback`; the executor encodes the
//! launch's tensor maps (`plan::tensor_maps`: the selected rows of each (batch, head), `r`
//! rows apart) with the driver's `cuTensorMapEncodeTiled` (`exec::tensor_map`) or the
//! emulation's stand-in, and runs the fallback where they cannot be encoded (rows not one
//! stride, rows off 16 bytes). The sm_90a backward (`dilated_bwd_wgmma.cu`, 64 keys a
//! block, dQ added by bulk reductions) runs the same way under `BackwardMma::Wgmma`
//! (`ATTN_CUDA_BWD_MMA=wgmma`; `launch_plan::hopper_backward`, with grad_out's map after
//! v's) in place of the atomic-dQ `mma.sync` launches.
//! A block's launches are planned as data (`launch_plan`:
//! kernel, grid, argument offsets, parameters) and executed either on the device or by
//! `emulation`, which loads `kernels/emulation/emu_capi.cpp` (the `.cu` files over a fiber
//! runtime, one fiber per CUDA thread; a cp.async copy lands only when its wait_group
//! covers it, and a block ending with one in flight, writing past the dynamic shared
//! memory its plan launched it with, or making a vector access (global or shared memory,
//! `ldmatrix` rows, `cp.async`) off its alignment, fails the launch) as a shared library, so the Rust planning and the
//! kernels are tested together without a GPU. Both executors turn a tensor's 16-byte loads
//! off where its first row as launched is off a 16-byte boundary (`Planned::params_at`):
//! a view of a framework's tensor may start anywhere. Without the feature `cuda` is a stub whose
//! `CudaBackend` returns `AttnError::NotCompiled`. `zeroed_buffer` (module `huge_pages`) allocates
//! fresh outputs and gradients (`forward_vec`, the multihead layer, the bench)
//! with their whole 2 MiB pages advised as transparent huge pages before the
//! first touch, so a 134 MB output faults dozens of times instead of 32,768.
#![deny(unsafe_code)]

mod cpu;
/// CUDA backend (feature `cuda`; without it, a stub returning `AttnError::NotCompiled`).
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda/stub.rs"]
pub mod cuda;
mod flops;
mod huge_pages;

pub use block::{Block, BlockGradients, BlockRows, Upstream, attend_block, attend_block_backward};
pub use cpu::isa;
pub use cpu::schedule::backend::CpuBackend;
pub use cpu::schedule::block;
pub use flops::model_flops;
pub use huge_pages::zeroed_buffer;
pub use isa::Isa;

/// Keys per tile of the f32 forward kernel: a forward call packs its keys and values
/// as f32 in whole tiles of this many rows (what the ring's buffer formula counts).
pub const FORWARD_KEY_TILE: usize = cpu::isa::ops::FORWARD_KEY_TILE;
