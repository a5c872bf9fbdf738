//! Primitives and their dispatch: the [`Isa`] detected once (`detect`, from
//! `cpu_features`), the tile primitives of `ops` (the only caller of `avx512`, `avx2`,
//! `portable` and the bf16 pair engines `bf16_pairs`), and the plain data every layer
//! shares (`mat`: matrix views; `rows`: the rows of a piece).

pub(crate) mod avx2;
pub(crate) mod avx512;
pub(crate) mod bf16_pairs;
pub(crate) mod cpu_features;
mod detect;
pub(crate) mod mat;
pub(crate) mod ops;
pub(crate) mod portable;
pub(crate) mod rows;

pub use detect::Isa;
