//! Deterministic benchmark inputs: seeded normal(0, 1) values, any element type.

use attn_core::Element;
use rayon::prelude::*;

/// A small SplitMix64 stream (no dependency; benchmark inputs need no more).
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n >= 1`; multiply-shift, biased by at most `n / 2^64`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
    /// Two independent standard normals (Box-Muller, both the cosine and the sine).
    pub fn normal_pair(&mut self) -> (f64, f64) {
        let (u, v) = (self.unit(), self.unit());
        let r = (-2.0 * u.ln()).sqrt();
        let (s, c) = (std::f64::consts::TAU * v).sin_cos();
        (r * c, r * s)
    }
}

/// Values per independently seeded chunk of [`normal_vec`] (even, so pairs never split).
const CHUNK: usize = 1 << 16;

/// `n` normal(0, 1) values converted to `T`. The buffer is allocated on the calling
/// thread (so the counting allocator charges it there) and filled in parallel on the
/// current rayon pool, chunk `i` from its own stream, so the values depend only on
/// `seed` and `n`, never on the thread count.
pub fn normal_vec<T: Element>(seed: u64, n: usize) -> Vec<T> {
    let mut out = vec![T::default(); n];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, chunk)| {
        let mut rng =
            SplitMix::new(seed.wrapping_mul(0xA24B_AED4_963E_E407) ^ (i as u64).wrapping_mul(0x9FB2_1C65_1E98_DF25));
        for pair in chunk.chunks_mut(2) {
            let (a, b) = rng.normal_pair();
            pair[0] = T::from_f64(a);
            if let Some(x) = pair.get_mut(1) {
                *x = T::from_f64(b);
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_values_have_unit_moments_and_are_reproducible() {
        // Allocates and frees megabytes: kept out of the measuring tests' windows, whose
        // process-wide live-byte figures another thread's frees would lower.
        let _guard = crate::memory::TEST_WINDOW_LOCK.lock();
        let v: Vec<f64> = normal_vec(7, 20_000);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "mean {mean} var {var}");
        assert_eq!(v, normal_vec::<f64>(7, 20_000));
        // Independent of the thread count, and chunks are not copies of each other.
        let n = 3 * CHUNK + 5;
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let serial: Vec<f32> = one.install(|| normal_vec(9, n));
        assert_eq!(serial, normal_vec::<f32>(9, n));
        assert_ne!(serial[..16], serial[CHUNK..CHUNK + 16]);
    }
}
