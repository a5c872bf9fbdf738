//! Dropout: off in evaluation, a seeded inverted-dropout mask in training.

use crate::float::LayerFloat;
use crate::init::SeededRng;

/// Whether a forward pass trains (dropout on, seeded) or evaluates (dropout off).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    #[default]
    Eval,
    /// Training: every dropout site draws its mask from `seed` and its own site id.
    Train { seed: u64 },
}

/// The inverted-dropout mask (`0` or `1/(1-p)`) for one site, or `None` when dropout
/// is off (evaluation or `p == 0`).
pub(crate) fn dropout_mask<F: LayerFloat>(mode: Mode, p: f64, site: u64, len: usize) -> Option<Vec<F>> {
    let Mode::Train { seed } = mode else { return None };
    if p <= 0.0 {
        return None;
    }
    let mut rng = SeededRng::new(seed ^ site.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let keep = F::of(1.0 / (1.0 - p));
    Some((0..len).map(|_| if rng.uniform() < p { F::zero() } else { keep }).collect())
}

/// `x * mask` elementwise (a no-op copy when there is no mask).
pub(crate) fn apply_mask<F: LayerFloat>(x: &[F], mask: Option<&[F]>) -> Vec<F> {
    match mask {
        Some(m) => x.iter().zip(m).map(|(&a, &b)| a * b).collect(),
        None => x.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eval_is_identity_and_train_is_seeded() {
        assert!(dropout_mask::<f64>(Mode::Eval, 0.5, 0, 10).is_none());
        assert!(dropout_mask::<f64>(Mode::Train { seed: 1 }, 0.0, 0, 10).is_none());
        let a = dropout_mask::<f64>(Mode::Train { seed: 1 }, 0.25, 3, 10_000).unwrap();
        assert_eq!(Some(a.clone()), dropout_mask::<f64>(Mode::Train { seed: 1 }, 0.25, 3, 10_000));
        assert_ne!(Some(a.clone()), dropout_mask::<f64>(Mode::Train { seed: 2 }, 0.25, 3, 10_000));
        assert_ne!(Some(a.clone()), dropout_mask::<f64>(Mode::Train { seed: 1 }, 0.25, 4, 10_000));
        let dropped = a.iter().filter(|&&m| m == 0.0).count() as f64 / a.len() as f64;
        assert!((dropped - 0.25).abs() < 0.02, "{dropped}");
        assert!(a.iter().all(|&m| m == 0.0 || (m - 1.0 / 0.75).abs() < 1e-15));
    }
}
