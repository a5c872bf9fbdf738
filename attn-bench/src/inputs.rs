//! Deterministic benchmark inputs: seeded normal(0, 1) values, any element type.

use attn_core::Element;

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
    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit(), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// `n` normal(0, 1) values converted to `T`.
pub fn normal_vec<T: Element>(seed: u64, n: usize) -> Vec<T> {
    let mut rng = SplitMix::new(seed);
    (0..n).map(|_| T::from_f64(rng.normal())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_values_have_unit_moments_and_are_reproducible() {
        let v: Vec<f64> = normal_vec(7, 20_000);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "mean {mean} var {var}");
        assert_eq!(v, normal_vec::<f64>(7, 20_000));
    }
}
