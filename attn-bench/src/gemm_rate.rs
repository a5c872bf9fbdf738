//! The machine's measured f32 GEMM rate (the `gemm` crate), the yardstick for GFLOP/s.
//!
//! Holds the crate's one `unsafe` call outside the allocator: `gemm::gemm` takes raw
//! pointers and strides.

use std::time::Instant;

/// Median GFLOP/s of an `n x n x n` f32 product on `threads` threads (best of `runs`
/// after one warm-up; the median is reported, the best is returned alongside).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct GemmRate {
    pub n: usize,
    pub threads: usize,
    pub median_gflop_per_s: f64,
    pub best_gflop_per_s: f64,
}

/// `c = a * b` for row-major `n x n` matrices.
fn matmul(n: usize, a: &[f32], b: &[f32], c: &mut [f32], threads: usize) {
    assert!(a.len() == n * n && b.len() == n * n && c.len() == n * n, "matmul buffers must be n*n");
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    let n_i = n as isize;
    // SAFETY: a, b and c are distinct row-major n*n buffers (checked above), so with
    // row stride n and column stride 1 every index the product touches is in bounds;
    // c is exclusively borrowed, so nothing else reads or writes it meanwhile.
    unsafe {
        gemm::gemm(
            n,
            n,
            n,
            c.as_mut_ptr(),
            1,
            n_i,
            false,
            a.as_ptr(),
            1,
            n_i,
            b.as_ptr(),
            1,
            n_i,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            par,
        );
    }
}

/// The product size of the yardstick: 2048³ (17 GFLOP, about 50 ms on two AVX-512 cores)
/// amortises the gemm crate's per-call packing and thread start-up, which made 1024³
/// read 30-50% low and noisy inside the bench process.
pub const GEMM_N: usize = 2048;

/// Measure the f32 GEMM rate with `n x n x n` products.
pub fn measure(n: usize, threads: usize, runs: usize) -> GemmRate {
    let a: Vec<f32> = (0..n * n).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
    let b: Vec<f32> = (0..n * n).map(|i| ((i * 104_729) % 1000) as f32 * 1e-3 - 0.5).collect();
    let mut c = vec![0.0f32; n * n];
    matmul(n, &a, &b, &mut c, threads);
    let flops = 2.0 * (n as f64).powi(3);
    let mut rates: Vec<f64> = (0..runs.max(1))
        .map(|_| {
            let t = Instant::now();
            matmul(n, &a, &b, &mut c, threads);
            flops / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    GemmRate { n, threads, median_gflop_per_s: rates[rates.len() / 2], best_gflop_per_s: rates[rates.len() - 1] }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_matches_naive_product() {
        let n = 9;
        let a: Vec<f32> = (0..n * n).map(|i| (i % 5) as f32 - 2.0).collect();
        let b: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut c = vec![0.0f32; n * n];
        matmul(n, &a, &b, &mut c, 1);
        for i in 0..n {
            for j in 0..n {
                let want: f32 = (0..n).map(|k| a[i * n + k] * b[k * n + j]).sum();
                assert_eq!(c[i * n + j], want, "({i},{j})");
            }
        }
    }
}
