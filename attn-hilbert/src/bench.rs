//! Plain-number measurements for `cargo xtask bench --case hilbert`.
//!
//! Timings are the minimum over repetitions (wall clock, one thread), so they
//! are noisy on shared machines: compare the ratios within one run.

use std::hint::black_box;
use std::time::Instant;

use attn_core::error::{AttnError, Result};

use crate::grid::Grid;
use crate::order::{OrderKind, TokenOrder};
use crate::permutation::{TokenLayout, try_vec};

/// Best-of-`reps` seconds to generate the order of `kind` on `grid`, bypassing
/// the cache (includes the `O(n)` validation and the inverse table).
pub fn measure_generation(kind: OrderKind, grid: Grid, reps: usize) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let order = TokenOrder::generate_uncached(kind, grid)?;
        best = best.min(t.elapsed().as_secs_f64());
        black_box(order);
    }
    Ok(best)
}

/// Timings of permuting a `[batch, seq, token_len]` f32 tensor, against a plain copy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PermuteTiming {
    /// Bytes of one tensor.
    pub bytes: usize,
    /// Best seconds of `dst.copy_from_slice(src)`.
    pub copy_s: f64,
    /// Best seconds of the out-of-place permutation (row-major to curve order).
    pub apply_s: f64,
    /// Best seconds of the out-of-place inverse (curve to row-major order).
    pub unapply_s: f64,
    /// Best seconds of the in-place permutation.
    pub in_place_s: f64,
}

impl PermuteTiming {
    /// Throughput of `apply` as a fraction of a plain copy (goal: at least 0.5).
    pub fn apply_fraction(&self) -> f64 {
        self.copy_s / self.apply_s
    }
    /// Throughput of `unapply` as a fraction of a plain copy.
    pub fn unapply_fraction(&self) -> f64 {
        self.copy_s / self.unapply_s
    }
    /// Throughput of the in-place permutation as a fraction of a plain copy.
    pub fn in_place_fraction(&self) -> f64 {
        self.copy_s / self.in_place_s
    }
    /// Copy bandwidth in GB/s (read + write counted once each).
    pub fn copy_gbps(&self) -> f64 {
        2.0 * self.bytes as f64 / self.copy_s / 1e9
    }
}

fn best_of(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Time permuting a `[batch, order.len(), token_len]` f32 tensor by `order`.
pub fn measure_permute(order: &TokenOrder, batch: usize, token_len: usize, reps: usize) -> Result<PermuteTiming> {
    let layout = TokenLayout::bse(batch, order.len(), token_len)?;
    let n = layout.numel()?;
    let bytes = n.checked_mul(4).ok_or_else(|| AttnError::InvalidArgument("tensor too large".into()))?;
    let mut src: Vec<f32> = try_vec(n)?;
    src.extend((0..n).map(|i| (i % 1021) as f32));
    let mut dst: Vec<f32> = try_vec(n)?;
    dst.resize(n, 0.0);
    let perm = order.permutation();
    // Warm up: page in both buffers.
    dst.copy_from_slice(&src);
    let copy_s = best_of(reps, || {
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
        Ok(())
    })?;
    let apply_s = best_of(reps, || perm.apply(&layout, black_box(&src), black_box(&mut dst)))?;
    let unapply_s = best_of(reps, || perm.unapply(&layout, black_box(&src), black_box(&mut dst)))?;
    let in_place_s = best_of(reps, || perm.apply_in_place(&layout, black_box(&mut dst)))?;
    Ok(PermuteTiming { bytes, copy_s, apply_s, unapply_s, in_place_s })
}

/// The numbers `cargo xtask bench --case hilbert` reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HilbertReport {
    /// Seconds to generate the Hilbert order of a 1024x1024 grid (uncached).
    pub generate_2d_s: f64,
    /// Seconds to generate the Hilbert order of a 128x128x64 volume (uncached).
    pub generate_3d_s: f64,
    /// Permuting a `[1, 128*128, 512]` f32 tensor (32 MiB) by the 128x128 Hilbert order.
    pub permute: PermuteTiming,
}

/// Measure the standard case (about a second on one core with `reps = 5`).
pub fn standard_report(reps: usize) -> Result<HilbertReport> {
    let generate_2d_s = measure_generation(OrderKind::Hilbert, Grid::new_2d(1024, 1024)?, reps)?;
    let generate_3d_s = measure_generation(OrderKind::Hilbert, Grid::new_3d(64, 128, 128)?, reps)?;
    let order = TokenOrder::generate_uncached(OrderKind::Hilbert, Grid::new_2d(128, 128)?)?;
    let permute = measure_permute(&order, 1, 512, reps)?;
    Ok(HilbertReport { generate_2d_s, generate_3d_s, permute })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measurements_are_positive_and_finite() {
        let g = Grid::new_2d(8, 8).unwrap();
        assert!(measure_generation(OrderKind::Hilbert, g, 1).unwrap() > 0.0);
        let t = measure_permute(&TokenOrder::hilbert_2d(8, 8).unwrap(), 2, 4, 1).unwrap();
        assert_eq!(t.bytes, 2 * 64 * 4 * 4);
        for x in [t.copy_s, t.apply_s, t.unapply_s, t.in_place_s] {
            assert!(x.is_finite() && x >= 0.0);
        }
        assert!(measure_permute(&TokenOrder::hilbert_2d(8, 8).unwrap(), 0, 4, 1).is_err());
    }
}
