//! [`SiteDropout`]: `attn-multihead`'s seeded inverted dropout as a burn module. The mask of
//! a `[batch, seq, width]` activation is `attn_multihead::site_mask` (a function of the
//! step's seed, the site and each element's batch, global position and feature), so the
//! burn layers drop exactly what `attn-multihead`'s layers drop for the same [`Mode`].
//! Following burn's conventions it drops only in training: the module's `training` flag
//! on (burn's `Module::valid` turns it off, `train` restores it) and the activation on an
//! autodiff device; elsewhere it is the identity whatever the mode. On a ring rank the
//! rows' global positions come from the [`Compute`] (the ring's layout), so every rank
//! drops what one device drops at those positions.

use attn_core::{AttnError, Result};
use attn_multihead::{DropoutSite, Mode, site_mask};
use burn::module::{Flag, Module, Param};
use burn_tensor::{Tensor, TensorData};

use crate::compute::Compute;

/// Inverted dropout with probability `prob` at one site of a layer.
#[derive(Module, Debug)]
pub struct SiteDropout {
    /// Whether the module trains (burn's module-owned control flag).
    pub training: Param<Flag>,
    #[module(skip)]
    prob: f64,
    #[module(skip)]
    site: DropoutSite,
}

impl SiteDropout {
    /// Dropout of probability `prob` (in `[0, 1)`) at `site`, training.
    pub fn new(prob: f64, site: DropoutSite) -> Result<Self> {
        if !(0.0..1.0).contains(&prob) {
            return Err(AttnError::InvalidArgument(format!("dropout {prob} is outside [0, 1)")));
        }
        Ok(SiteDropout { training: Param::from_bool(true), prob, site })
    }

    pub fn prob(&self) -> f64 {
        self.prob
    }

    /// Whether a forward of `x` in `mode` drops anything.
    fn active(&self, x: &Tensor<3>, mode: Mode) -> bool {
        matches!(mode, Mode::Train { .. }) && self.prob > 0.0 && self.training.val().is_enabled() && x.is_autodiff()
    }

    /// `x` `[batch, seq, width]` (rows at positions `0..seq`) times the site's mask for
    /// `mode`, or `x` itself when not training.
    pub fn forward(&self, x: Tensor<3>, mode: Mode) -> Tensor<3> {
        if !self.active(&x, mode) {
            return x;
        }
        let positions: Vec<usize> = (0..x.dims()[1]).collect();
        self.apply(x, mode, &positions)
    }

    /// [`Self::forward`] of the rows a call computed where `compute` says passes: their
    /// global positions are `compute`'s (a ring rank's rows), looked up only in training.
    pub fn forward_on(&self, x: Tensor<3>, mode: Mode, compute: &Compute) -> Result<Tensor<3>> {
        if !self.active(&x, mode) {
            return Ok(x);
        }
        let positions = compute.query_positions(x.dims()[1])?;
        Ok(self.apply(x, mode, &positions))
    }

    /// `x` times the mask of rows at global `positions` (one per row of `x`).
    fn apply(&self, x: Tensor<3>, mode: Mode, positions: &[usize]) -> Tensor<3> {
        let [b, n, w] = x.dims();
        let Some(mask) = site_mask::<f32>(mode, self.prob, self.site, b, positions, w) else { return x };
        let mask = Tensor::<3>::from_data(TensorData::new(mask, [b, n, w]), (&x.device(), x.dtype()));
        x * mask
    }
}
