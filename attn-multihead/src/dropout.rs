//! Dropout: off in evaluation, a seeded inverted-dropout mask in training, a function of GLOBAL token positions.
//!
//! Whether element `(b, t, f)` of a `[batch, seq, width]` activation is dropped depends
//! only on `(seed, site, b, position(t), f)`, where `position(t)` is the global
//! sequence position of local row `t` (the backend reports it: `0..seq` on one
//! device, the rank's rows on the ring). So every split of the sequence over ranks
//! draws the same mask as one device, and the mask never depends on the float type.
//! Callers vary `seed` per training step (the encoder derives one per layer).

use crate::float::LayerFloat;

/// Whether a forward pass trains (dropout on, seeded) or evaluates (dropout off).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    #[default]
    Eval,
    /// Training: every dropout site draws its mask from `seed`, its own site id and
    /// the global position of each element (use a fresh seed for every step).
    Train { seed: u64 },
}

/// Where a layer drops activations; each site draws its own mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropoutSite {
    /// The multihead layer's merged attention output, before sub-LayerNorm.
    Attention,
    /// The encoder layer's attention branch, before its residual add.
    AttentionResidual,
    /// The encoder layer's feed-forward hidden activation, after ReLU.
    FeedForwardHidden,
    /// The encoder layer's feed-forward branch, before its residual add.
    FeedForwardResidual,
}

impl DropoutSite {
    /// The site's part of every mask's seed.
    const fn id(self) -> u64 {
        match self {
            DropoutSite::Attention => 1,
            DropoutSite::AttentionResidual => 2,
            DropoutSite::FeedForwardHidden => 3,
            DropoutSite::FeedForwardResidual => 4,
        }
    }
}

/// The inverted-dropout mask (`0` or `1/(1-p)`) of `site` over `[batch, positions.len(),
/// width]`, rows at the global sequence `positions`: the mask this crate's layers apply
/// there, for front ends that compose the layer from their own ops. `None` when dropout
/// is off (evaluation or `p == 0`).
pub fn site_mask<F: LayerFloat>(
    mode: Mode,
    p: f64,
    site: DropoutSite,
    batch: usize,
    positions: &[usize],
    width: usize,
) -> Option<Vec<F>> {
    dropout_mask(mode, p, site, &MaskRows { batch, positions: positions.to_vec() }, width)
}

/// The rows a mask covers: `batch` copies of the local rows, whose global sequence
/// positions are `positions` (local row order).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct MaskRows {
    pub batch: usize,
    pub positions: Vec<usize>,
}

impl MaskRows {
    /// `batch` copies of the rows `0..seq` (a whole sequence on one device).
    #[cfg(test)]
    pub fn whole(batch: usize, seq: usize) -> Self {
        MaskRows { batch, positions: (0..seq).collect() }
    }
}

/// SplitMix64's output function.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Uniform `[0, 1)` (53 bits) of element `f` of a row whose key is `row_key`: the
/// `(f + 1)`-th output of a SplitMix64 stream seeded with `row_key`.
fn uniform_at(row_key: u64, f: usize) -> f64 {
    let z = mix(row_key.wrapping_add((f as u64).wrapping_add(1).wrapping_mul(GOLDEN)));
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The key of row `(b, position)` of a site.
fn row_key(site_key: u64, b: usize, position: usize) -> u64 {
    mix(mix(site_key ^ (b as u64).wrapping_mul(GOLDEN)) ^ (position as u64))
}

/// The inverted-dropout mask (`0` or `1/(1-p)`) for one site over `[rows.batch,
/// rows.positions.len(), width]`, or `None` when dropout is off (evaluation or `p == 0`).
pub(crate) fn dropout_mask<F: LayerFloat>(
    mode: Mode,
    p: f64,
    site: DropoutSite,
    rows: &MaskRows,
    width: usize,
) -> Option<Vec<F>> {
    let Mode::Train { seed } = mode else { return None };
    if p <= 0.0 {
        return None;
    }
    let site_key = mix(seed ^ mix(site.id().wrapping_mul(0xD6E8_FEB8_6659_FD93)));
    let keep = F::of(1.0 / (1.0 - p));
    let mut mask = Vec::with_capacity(rows.batch * rows.positions.len() * width);
    for b in 0..rows.batch {
        for &pos in &rows.positions {
            let key = row_key(site_key, b, pos);
            mask.extend((0..width).map(|f| if uniform_at(key, f) < p { F::zero() } else { keep }));
        }
    }
    Some(mask)
}

/// `x * mask` elementwise (`x` itself, borrowed, when there is no mask).
pub(crate) fn apply_mask<'a, F: LayerFloat>(x: &'a [F], mask: Option<&[F]>) -> std::borrow::Cow<'a, [F]> {
    match mask {
        Some(m) => x.iter().zip(m).map(|(&a, &b)| a * b).collect(),
        None => std::borrow::Cow::Borrowed(x),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eval_is_identity_and_train_is_seeded() {
        let rows = MaskRows::whole(2, 50);
        assert!(dropout_mask::<f64>(Mode::Eval, 0.5, DropoutSite::Attention, &rows, 100).is_none());
        assert!(dropout_mask::<f64>(Mode::Train { seed: 1 }, 0.0, DropoutSite::Attention, &rows, 100).is_none());
        let a = dropout_mask::<f64>(Mode::Train { seed: 1 }, 0.25, DropoutSite::FeedForwardHidden, &rows, 100).unwrap();
        assert_eq!(a.len(), 2 * 50 * 100);
        assert_eq!(
            Some(a.clone()),
            dropout_mask::<f64>(Mode::Train { seed: 1 }, 0.25, DropoutSite::FeedForwardHidden, &rows, 100)
        );
        assert_ne!(
            Some(a.clone()),
            dropout_mask::<f64>(Mode::Train { seed: 2 }, 0.25, DropoutSite::FeedForwardHidden, &rows, 100)
        );
        assert_ne!(
            Some(a.clone()),
            dropout_mask::<f64>(Mode::Train { seed: 1 }, 0.25, DropoutSite::FeedForwardResidual, &rows, 100)
        );
        let dropped = a.iter().filter(|&&m| m == 0.0).count() as f64 / a.len() as f64;
        assert!((dropped - 0.25).abs() < 0.02, "{dropped}");
        assert!(a.iter().all(|&m| m == 0.0 || (m - 1.0 / 0.75).abs() < 1e-15));
        // Batches and positions draw different masks.
        assert_ne!(a[..50 * 100], a[50 * 100..]);
        assert_ne!(a[..100], a[100..200]);
    }

    #[test]
    fn mask_is_a_function_of_global_positions() {
        let (batch, seq, width, mode) = (2, 37, 12, Mode::Train { seed: 9 });
        let whole =
            dropout_mask::<f32>(mode, 0.3, DropoutSite::Attention, &MaskRows::whole(batch, seq), width).unwrap();
        // Any subset of positions (a ring rank's rows, e.g. zigzag) gets exactly the
        // whole sequence's rows at those positions.
        let positions = vec![0, 1, 2, 30, 31, 36];
        let part = dropout_mask::<f32>(
            mode,
            0.3,
            DropoutSite::Attention,
            &MaskRows { batch, positions: positions.clone() },
            width,
        )
        .unwrap();
        for b in 0..batch {
            for (j, &p) in positions.iter().enumerate() {
                let got = &part[(b * positions.len() + j) * width..][..width];
                assert_eq!(got, &whole[(b * seq + p) * width..][..width], "b {b} position {p}");
            }
        }
        // The float type does not change which elements are dropped.
        let m64 = dropout_mask::<f64>(mode, 0.3, DropoutSite::Attention, &MaskRows::whole(batch, seq), width).unwrap();
        assert!(m64.iter().zip(&whole).all(|(&a, &b)| (a == 0.0) == (b == 0.0)));
    }
}
