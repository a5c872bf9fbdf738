//! Primitives and their dispatch: the [`Isa`] detected once (`detect`, from
//! `cpu_features`); the vector operations of one instruction set (`simd`: the `Simd`
//! trait, implemented once each by `portable`, `avx2` and `avx512`) and the tile
//! primitives written once over them (`kernels`); the dispatch module (`ops`: the
//! vectors picked once per piece, scalar helpers, `row_io`, the bf16 pair engines
//! `bf16_pairs`); and the plain data every layer shares (`mat`: matrix views; `rows`:
//! the rows of a piece).

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod bf16_pairs;
pub(crate) mod cpu_features;
mod detect;
pub(crate) mod kernels;
pub(crate) mod mat;
pub(crate) mod ops;
pub(crate) mod portable;
mod row_io;
pub(crate) mod rows;
pub(crate) mod simd;

pub use detect::Isa;
