//! The forward kernels' per-worker scratch, shared by the row kernel (`tile_forward`),
//! the lane kernel (`lane_forward`) and the bf16 pair engines.

/// Reusable buffers of the forward kernel (one per worker). The lane kernel
/// (`lane_forward`) borrows the same buffers, so a piece it hands back reuses them and the
/// scratch bound covers both.
#[derive(Debug, Default)]
pub(crate) struct ForwardScratch {
    pub(crate) pairs: crate::cpu::isa::ops::PairScratch,
    pub(crate) kt: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) q: Vec<f32>,
    pub(crate) o: Vec<f32>,
    pub(crate) m: Vec<f32>,
    pub(crate) l: Vec<f32>,
    pub(crate) s: Vec<f32>,
    pub(crate) finite: Vec<bool>,
}
