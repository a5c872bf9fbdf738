//! qk-LN ([`NormLayout::QkLn`](crate::NormLayout::QkLn)): `q_ln` over the projected q
//! and `k_ln` over the projected k, applied in place in the projection buffers before
//! attention, and their backward (the q_ln over the merged heads is the sub-LN stage's).

use std::ops::Range;

use attn_core::Result;

use super::{MultiheadDilatedAttention, ProjLayout};
use crate::float::LayerFloat;
use crate::layer_norm::LayerNorm;
use crate::qk_pre::{QkPre, normalize_columns, stats_rows};
use crate::weights::MultiheadWeights;
use crate::workspace::MultiheadWorkspace;

impl<F: LayerFloat> MultiheadDilatedAttention<F> {
    /// `q_ln` and `k_ln` when the layer is qk-LN.
    pub(super) fn qk_norms(&self) -> Option<(&LayerNorm<F>, &LayerNorm<F>)> {
        match (&self.weights.norm, &self.weights.k_ln) {
            (Some(q_ln), Some(k_ln)) if self.config.qk_ln() => Some((q_ln, k_ln)),
            _ => None,
        }
    }

    /// Apply `q_ln` to q and `k_ln` to k in `ws` (fused in `ws.qkv`, or q there and
    /// k/v in `ws.kv`); returns what they replaced. Nothing unless qk-LN.
    pub(super) fn normalize_qk(&self, ws: &mut MultiheadWorkspace<F>, layout: ProjLayout) -> Result<Option<QkPre<F>>> {
        let Some((q_ln, k_ln)) = self.qk_norms() else { return Ok(None) };
        let (e, kvd) = (self.config.embed_dim, self.config.kv_dim());
        let ((q, q_stats), (k, k_stats)) = match layout {
            ProjLayout::Fused => {
                let row = e + 2 * kvd;
                (
                    normalize_columns(q_ln, &mut ws.qkv, row, 0..e)?,
                    normalize_columns(k_ln, &mut ws.qkv, row, e..e + kvd)?,
                )
            }
            ProjLayout::Split => {
                (normalize_columns(q_ln, &mut ws.qkv, e, 0..e)?, normalize_columns(k_ln, &mut ws.kv, 2 * kvd, 0..kvd)?)
            }
        };
        Ok(Some(QkPre { q, q_stats, k, k_stats }))
    }

    /// The backward of `q_ln` over q rows `q_rows` and `k_ln` over k rows `k_rows` of
    /// `pre`: `dq` and `dk` (gradients of the normalised q and k, `[rows, width]`) become
    /// those of the projections, and the norms' weight gradients accumulate into
    /// `grads.norm` (`q_ln`'s) and `grads.k_ln`. Nothing without `pre` (not qk-LN).
    pub(super) fn qk_norm_backward(
        &self,
        pre: Option<&QkPre<F>>,
        [q_rows, k_rows]: [Range<usize>; 2],
        [dq, dk]: [&mut [F]; 2],
        grads: &mut MultiheadWeights<F>,
    ) -> Result<()> {
        let (Some(pre), Some((q_ln, k_ln))) = (pre, self.qk_norms()) else { return Ok(()) };
        let (e, kvd) = (self.config.embed_dim, self.config.kv_dim());
        let (Some(gq), Some(gk)) = (grads.norm.as_mut(), grads.k_ln.as_mut()) else {
            return Err(attn_core::AttnError::InvalidArgument(
                "gradient accumulator has no q_ln/k_ln for a qk-LN layer".into(),
            ));
        };
        let x = &pre.q[q_rows.start * e..q_rows.end * e];
        let d = q_ln.backward(x, &stats_rows(&pre.q_stats, q_rows), dq, gq)?;
        dq.copy_from_slice(&d);
        let x = &pre.k[k_rows.start * kvd..k_rows.end * kvd];
        let d = k_ln.backward(x, &stats_rows(&pre.k_stats, k_rows), dk, gk)?;
        dk.copy_from_slice(&d);
        Ok(())
    }
}
