//! A small GPU timing entry for the bench harness: forward of random inputs on the
//! device, timed around stream synchronisation, with the attended FLOP count.

use std::time::Instant;

use attn_core::{DilatedConfig, Result, SegmentPattern, Shape4};

use super::block::{DeviceBlock, forward_block};
use super::device::{CudaDevice, cuda_err};
use super::plan::{SelectedIndex, pattern_launches};
use super::tensor::{CudaElement, DevicePartial, DeviceTensor};

/// Result of [`bench_forward`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuTiming {
    /// Median milliseconds per forward (attention kernels only, no transfers).
    pub median_ms: f64,
    /// Useful FLOPs per forward: `4 * head_dim` per attended (query, key) pair.
    pub flops: f64,
}

impl GpuTiming {
    pub fn tflops(&self) -> f64 {
        self.flops / (self.median_ms * 1e-3) / 1e12
    }
}

/// Attended (query, key) pairs of a self-attention forward over `shape` (all heads and batches).
pub fn attended_pairs(cfg: &DilatedConfig, shape: Shape4) -> u64 {
    let n = shape.seq;
    let mut pairs = 0u64;
    for pl in pattern_launches(cfg, shape.heads) {
        for h in pl.heads.clone() {
            let s = SelectedIndex::new(&SegmentPattern::new(pl.w, pl.r, pl.fixed_off.unwrap_or(h % pl.r)));
            let total = s.below(n);
            let mut t = 0;
            while t < total {
                let seg_end = ((t / s.per_seg + 1) * s.per_seg).min(total);
                let c = (seg_end - t) as u64;
                pairs += if cfg.causal() { c * (c + 1) / 2 } else { c * c };
                t = seg_end;
            }
        }
    }
    pairs * shape.batch as u64
}

/// Time `iters` forwards (after one warm-up) on inputs of `shape` filled with `fill(i)`.
pub fn bench_forward<T: CudaElement>(
    dev: &CudaDevice,
    cfg: &DilatedConfig,
    shape: Shape4,
    iters: usize,
    fill: impl Fn(usize) -> f32,
) -> Result<GpuTiming> {
    let host: Vec<T> = (0..shape.numel()).map(|i| T::from_f32(fill(i))).collect();
    let upload = || -> Result<DeviceTensor<T>> {
        let data = dev.stream.clone_htod(&host).map_err(cuda_err)?;
        Ok(DeviceTensor { data, shape, strides: shape.contiguous_strides() })
    };
    let (q, k, v) = (upload()?, upload()?, upload()?);
    let mut times = Vec::with_capacity(iters.max(1));
    for i in 0..=iters.max(1) {
        let mut partial = DevicePartial::empty(dev, shape)?;
        dev.synchronize()?;
        let t0 = Instant::now();
        forward_block(dev, &DeviceBlock::new(cfg, (&q, 0), (&k, &v, 0)), &mut partial)?;
        dev.synchronize()?;
        if i > 0 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    let flops = 4.0 * shape.head_dim as f64 * attended_pairs(cfg, shape) as f64;
    Ok(GpuTiming { median_ms: times[times.len() / 2], flops })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_count_matches_the_mask() {
        for causal in [false, true] {
            for mixing in [attn_core::Mixing::HeadGroups, attn_core::Mixing::LongNet] {
                let cfg = DilatedConfig::builder()
                    .segments(&[4, 6])
                    .dilations(&[1, 2])
                    .mixing(mixing)
                    .causal(causal)
                    .build()
                    .unwrap();
                let shape = Shape4::new(2, 11, 3, 8).unwrap();
                let mut brute = 0u64;
                for h in 0..3 {
                    for (_, p) in cfg.head_patterns(3, h).patterns {
                        for qp in 0..11 {
                            brute += (0..11).filter(|&kp| p.attends(qp, kp, causal.into())).count() as u64;
                        }
                    }
                }
                assert_eq!(attended_pairs(&cfg, shape), 2 * brute);
            }
        }
    }
}
