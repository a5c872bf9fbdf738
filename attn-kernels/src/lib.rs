//! Backends of `attn`: flash-style fused dilated attention on the CPU (forward and
//! backward, f32/bf16/f16 with f32 accumulation), the block-level entry points the ring
//! uses, and CUDA kernels behind the `cuda` feature.
//!
//! ```
//! use attn_core::{DilatedConfig, Shape4};
//! use attn_kernels::CpuBackend;
//! # fn main() -> attn_core::Result<()> {
//! let cfg = DilatedConfig::builder().segments(&[16, 32]).dilations(&[1, 2]).causal(true).build()?;
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
//! Layers: [`block`] (public block API, via `piece`) and [`CpuBackend`] (whole tensors,
//! via `units`) find pieces (the selected rows of one pattern segment) from global
//! positions; `tile_forward` and `tile_backward` run them flash-style, tile by tile, on
//! packed f32 tiles (`f32_tiles`: the dilation gather and dtype conversion fused into
//! packing) with the `ops` primitives, which dispatch to `avx512`, `avx2` or `portable`
//! ([`Isa`], detected once at run time, `ATTN_CPU_ISA` to override).
//!
//! With AMX-BF16 ([`Isa::Amx`]) or AVX512-BF16 ([`Isa::Avx512Bf16`], chosen on AMD only)
//! the bf16 forward runs its products on bf16 pairs (`bf16_pairs`: the tile unit or
//! `vdpbf16ps`); everything else uses the AVX-512 kernels.
//!
//! Unsafe code lives only in `avx512`, `avx2` and `bf16_pairs::arch` (intrinsics and tile
//! instructions behind bounds-checked safe wrappers), `cpu_features` (the AMX permission
//! request), `disjoint` (shared output buffer, disjoint rows), `backend` (the disjoint
//! row writes of work units), `huge_pages` (`madvise` on fresh buffers) and, with the
//! `cuda` feature, `cuda::device`, `cuda::launch`, `cuda::params`, `cuda::nvrtc` and
//! `cuda::nvrtc_library` (the driver and NVRTC calls), `cuda::foreign` (memory and
//! streams another library owns) and `cuda::emulation` (loading the CPU emulator library). Only `ops`, the dispatch module, calls into `avx512`,
//! `avx2`, `portable` and `bf16_pairs`; every CPU feature check is in `cpu_features`.
#![deny(unsafe_code)]

mod avx2;
mod avx512;
mod backend;
mod bf16_pairs;
pub mod block;
mod cpu_features;
mod f32_tiles;
pub mod isa;
mod lane_forward;
mod mat;
mod ops;
mod piece;

/// CUDA backend (feature `cuda`; without it, a stub returning `AttnError::NotCompiled`).
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda/stub.rs"]
pub mod cuda;
mod disjoint;
mod flops;
mod forward_scratch;
mod huge_pages;
mod portable;
mod rows;
mod score_bound;
mod tile_backward;
mod tile_forward;
mod unit_passes;
mod units;

pub use backend::CpuBackend;
pub use block::{Block, BlockGradients, BlockRows, Upstream, attend_block, attend_block_backward};
pub use flops::model_flops;
pub use huge_pages::zeroed_buffer;
pub use isa::Isa;

/// Keys per tile of the f32 forward kernel: a forward call packs its keys and values
/// as f32 in whole tiles of this many rows (what the ring's buffer formula counts).
pub const FORWARD_KEY_TILE: usize = ops::FORWARD_KEY_TILE;
