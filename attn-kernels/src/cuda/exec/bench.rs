//! GPU timing entries for the bench harness: forward (and forward+backward) of random
//! inputs on the device, timed with CUDA events around each call after a warm-up call,
//! including the epilogues that write the caller's output (and gradients), with the
//! attended FLOP count.

use attn_core::{DilatedConfig, Pass, Result, SegmentPattern, Shape4};
use cudarc::driver::sys::CUevent_flags;

use super::block::DeviceBlock;
use super::call::{DeviceSaved, ForwardPath, backward_call, forward_call_by};
use super::device::{CudaDevice, cuda_err};
use super::tensor::{CudaElement, DeviceTensor};
use crate::cuda::plan::patterns::{SelectedIndex, pattern_launches};

/// Result of [`bench_forward`] / [`bench_pass`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuTiming {
    /// Median milliseconds per call (CUDA events; kernels and epilogues, no transfers).
    pub median_ms: f64,
    /// Useful FLOPs per call: `4 * head_dim` per attended (query, key) pair, times 2.5
    /// more for the backward (five products where the forward has two).
    pub flops: f64,
    /// Scratch buffers the timed calls allocated (0 where the warm-up left the stream's
    /// pool holding every buffer the shape needs).
    pub allocations: u64,
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

/// What [`bench_pass`] times: the pass, the untimed warm-up calls before the timed ones
/// (one for a timing; none under a checker such as compute-sanitizer, which slows every
/// call alike), the timed calls, the forward's [`ForwardPath`] and what comes between
/// timed calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BenchRun {
    pub pass: Pass,
    pub warmups: usize,
    pub iters: usize,
    pub path: ForwardPath,
    pub between: Between,
}

/// What comes between two timed calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Between {
    /// Nothing: the calls queue back to back on the stream.
    Queued,
    /// A device synchronisation, as a framework's step ends with one: the driver's memory
    /// pool may then hand the calls' freed scratch back, and the next call allocates it anew.
    Synchronized,
}

impl Between {
    /// The name the bench prints and parses.
    pub fn name(self) -> &'static str {
        match self {
            Between::Queued => "queued",
            Between::Synchronized => "synchronized",
        }
    }
}

/// [`bench_pass`] of the forward on its direct path.
pub fn bench_forward<T: CudaElement>(
    dev: &CudaDevice,
    cfg: &DilatedConfig,
    shape: Shape4,
    iters: usize,
    fill: impl Fn(usize) -> f32,
) -> Result<GpuTiming> {
    bench_pass::<T>(
        dev,
        cfg,
        shape,
        BenchRun { pass: Pass::Forward, warmups: 1, iters, path: ForwardPath::Direct, between: Between::Queued },
        fill,
    )
}

/// Time `run.iters` calls (after `run.warmups` untimed ones) of `run.pass` on inputs of `shape`
/// filled with `fill(i)`: the forward writes `out` and the LSE; `Pass::Backward` times the
/// forward and the backward together (delta, dq/dk/dv accumulation, the gradients written).
pub fn bench_pass<T: CudaElement>(
    dev: &CudaDevice,
    cfg: &DilatedConfig,
    shape: Shape4,
    run: BenchRun,
    fill: impl Fn(usize) -> f32,
) -> Result<GpuTiming> {
    let BenchRun { pass, warmups, iters, path, between } = run;
    let host: Vec<T> = (0..shape.numel()).map(|i| T::from_f32(fill(i))).collect();
    let upload = || -> Result<DeviceTensor<T>> {
        let data = dev.stream.clone_htod(&host).map_err(cuda_err)?;
        Ok(DeviceTensor { data, shape, strides: shape.contiguous_strides() })
    };
    let (q, k, v, go) = (upload()?, upload()?, upload()?, upload()?);
    let mut out = DeviceTensor::<T>::zeros(dev, shape)?;
    let mut lse = dev.stream.alloc_zeros::<f32>(shape.lse_len()).map_err(cuda_err)?;
    let [mut dq, mut dk, mut dv] =
        [DeviceTensor::<T>::zeros(dev, shape)?, DeviceTensor::zeros(dev, shape)?, DeviceTensor::zeros(dev, shape)?];
    let block = DeviceBlock::new(cfg, (&q, 0), (&k, &v, 0));
    // The lean path a framework takes: output, lse and gradients in its buffers, scratch
    // from the stream's pool.
    let mut call = || -> Result<()> {
        forward_call_by(dev, &block, &mut out, &mut lse, path)?;
        if pass == Pass::Backward {
            let saved = DeviceSaved { out: &out, lse: &lse };
            backward_call(dev, &block, saved, &go, None, [&mut dq, &mut dk, &mut dv])?;
        }
        Ok(())
    };
    for _ in 0..warmups {
        call()?;
    }
    dev.synchronize()?;
    let allocated_before = dev.scratch_allocations();
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::with_capacity(iters.max(1));
    for _ in 0..iters.max(1) {
        let start = dev.stream.record_event(timing).map_err(cuda_err)?;
        call()?;
        let end = dev.stream.record_event(timing).map_err(cuda_err)?;
        times.push(f64::from(start.elapsed_ms(&end).map_err(cuda_err)?));
        if between == Between::Synchronized {
            dev.synchronize()?;
        }
    }
    times.sort_by(f64::total_cmp);
    let factor = if pass == Pass::Backward { 3.5 } else { 1.0 };
    let flops = factor * 4.0 * shape.head_dim as f64 * attended_pairs(cfg, shape) as f64;
    let allocations = dev.scratch_allocations() - allocated_before;
    Ok(GpuTiming { median_ms: times[times.len() / 2], flops, allocations })
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
                    .causality(causal.into())
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
