//! MAGNETO initialisation from a seeded RNG: xavier-normal weights, zero biases, gains from layer counts.

use crate::float::LayerFloat;

pub use attn_core::SeededRng;

/// `torch.nn.init.xavier_normal_` for an `[fan_out, fan_in]` weight: normal with
/// std `gain * sqrt(2 / (fan_in + fan_out))`.
pub fn xavier_normal<F: LayerFloat>(rng: &mut SeededRng, fan_out: usize, fan_in: usize, gain: f64) -> Vec<F> {
    let std = gain * (2.0 / (fan_in + fan_out) as f64).sqrt();
    (0..fan_out * fan_in).map(|_| F::of(std * rng.normal())).collect()
}

/// MAGNETO gains (arXiv 2210.06423, Fig. 2) for the v/out and FFN-output weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MagnetoGains {
    pub encoder: f64,
    pub decoder: f64,
}

impl MagnetoGains {
    /// Encoder-only model with `n` layers: `gamma = sqrt(log(2n))`.
    pub fn encoder_only(num_layers: usize) -> Self {
        let g = (2.0 * num_layers.max(1) as f64).ln().sqrt();
        MagnetoGains { encoder: g, decoder: g }
    }
    /// Encoder-decoder with `n` encoder and `m` decoder layers (as `dilated-attention-pytorch`'s
    /// `LongNet`): encoder `sqrt(log(3m) log(2n) / 3)`, decoder `sqrt(log(3m))`.
    pub fn encoder_decoder(encoder_layers: usize, decoder_layers: usize) -> Self {
        let (n, m) = (encoder_layers.max(1) as f64, decoder_layers.max(1) as f64);
        MagnetoGains { encoder: ((3.0 * m).ln() * (2.0 * n).ln() / 3.0).sqrt(), decoder: (3.0 * m).ln().sqrt() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xavier_std_and_determinism() {
        let mut rng = SeededRng::new(7);
        let w: Vec<f64> = xavier_normal(&mut rng, 200, 300, 2.0);
        let mean = w.iter().sum::<f64>() / w.len() as f64;
        let std = (w.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / w.len() as f64).sqrt();
        let want = 2.0 * (2.0f64 / 500.0).sqrt();
        assert!(mean.abs() < 0.01 && (std / want - 1.0).abs() < 0.02, "mean {mean} std {std} want {want}");
        let again: Vec<f64> = xavier_normal(&mut SeededRng::new(7), 200, 300, 2.0);
        assert_eq!(w, again);
        let other: Vec<f64> = xavier_normal(&mut SeededRng::new(8), 200, 300, 2.0);
        assert_ne!(w, other);
    }

    #[test]
    fn magneto_gains_match_the_formulas() {
        assert!((MagnetoGains::encoder_only(6).encoder - 12f64.ln().sqrt()).abs() < 1e-15);
        let g = MagnetoGains::encoder_decoder(6, 6);
        assert!((g.encoder - (18f64.ln() * 12f64.ln() / 3.0).sqrt()).abs() < 1e-15);
        assert!((g.decoder - 18f64.ln().sqrt()).abs() < 1e-15);
    }
}
