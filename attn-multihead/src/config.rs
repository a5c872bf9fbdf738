//! `MultiheadConfig`: the hyper-parameters of `MultiheadDilatedAttention`, validated as PyTorch users expect.

use attn_core::{AttnError, DilatedConfig, Mixing, Result, TensorName};

/// Hyper-parameters of a multihead dilated attention layer (names as in
/// `dilated-attention-pytorch`'s `MultiheadDilatedAttention`).
#[derive(Debug, Clone, PartialEq)]
pub struct MultiheadConfig {
    pub embed_dim: usize,
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`; must divide
    /// it): `k_proj` and `v_proj` have `num_kv_heads * head_dim` rows.
    pub num_kv_heads: usize,
    pub segment_lengths: Vec<usize>,
    pub dilation_rates: Vec<usize>,
    pub mixing: Mixing,
    /// Causal masking (global positions; see SPEC.md).
    pub causal: bool,
    /// Whether the q/k/v/out projections have biases.
    pub bias: bool,
    /// Sub-LayerNorm before the output projection (MAGNETO / LongNet layout).
    pub layer_norm: bool,
    pub layer_norm_eps: f64,
    /// MAGNETO gain for the v and out projections.
    pub gamma_init: f64,
    /// Dropout probability on the merged attention output in training mode.
    pub dropout: f64,
    /// Softmax scale; `None` means `1/sqrt(head_dim)`.
    pub scale: Option<f64>,
}

impl MultiheadConfig {
    /// A config with the library's defaults: HeadGroups, non-causal, bias, sub-LN,
    /// eps 1e-5, gamma_init 1, no dropout.
    pub fn new(embed_dim: usize, num_heads: usize, segment_lengths: &[usize], dilation_rates: &[usize]) -> Self {
        MultiheadConfig {
            embed_dim,
            num_heads,
            num_kv_heads: num_heads,
            segment_lengths: segment_lengths.to_vec(),
            dilation_rates: dilation_rates.to_vec(),
            mixing: Mixing::HeadGroups,
            causal: false,
            bias: true,
            layer_norm: true,
            layer_norm_eps: 1e-5,
            gamma_init: 1.0,
            dropout: 0.0,
            scale: None,
        }
    }

    /// Grouped-query attention: `num_kv_heads` key/value heads (dividing `num_heads`).
    pub fn with_num_kv_heads(mut self, num_kv_heads: usize) -> Self {
        self.num_kv_heads = num_kv_heads;
        self
    }
    pub fn with_mixing(mut self, mixing: Mixing) -> Self {
        self.mixing = mixing;
        self
    }
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
    pub fn with_layer_norm(mut self, layer_norm: bool) -> Self {
        self.layer_norm = layer_norm;
        self
    }
    pub fn with_gamma_init(mut self, gamma_init: f64) -> Self {
        self.gamma_init = gamma_init;
        self
    }
    pub fn with_dropout(mut self, dropout: f64) -> Self {
        self.dropout = dropout;
        self
    }
    /// An explicit softmax scale (finite and positive; checked by `validate`).
    pub fn with_scale(mut self, scale: Option<f64>) -> Self {
        self.scale = scale;
        self
    }

    /// Per-head dimension `embed_dim / num_heads` (after [`MultiheadConfig::validate`]).
    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.num_heads.max(1)
    }

    /// Rows of `k_proj` and `v_proj`: `num_kv_heads * head_dim` (after `validate`).
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim()
    }

    /// Check every field; returns the attention config the layer runs.
    pub fn validate(&self) -> Result<DilatedConfig> {
        if self.embed_dim == 0 {
            return Err(AttnError::InvalidArgument("embed_dim must be positive".into()));
        }
        if self.num_heads == 0 {
            return Err(AttnError::InvalidArgument("num_heads must be positive".into()));
        }
        if !self.embed_dim.is_multiple_of(self.num_heads) {
            return Err(AttnError::InvalidArgument(format!(
                "embed_dim ({}) must be divisible by num_heads ({})",
                self.embed_dim, self.num_heads
            )));
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(AttnError::KvHeadsNotDividing { heads: self.num_heads, kv_heads: self.num_kv_heads });
        }
        // The four `embed_dim x embed_dim` projections must be addressable in 8-byte floats.
        let e = self.embed_dim;
        if e.checked_mul(e).and_then(|n| n.checked_mul(4 * 8)).is_none_or(|b| b > isize::MAX as usize) {
            return Err(AttnError::ShapeOverflow { tensor: TensorName::Other("weights"), dims: vec![4, e, e] });
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return Err(AttnError::InvalidArgument(format!(
                "layer_norm_eps must be finite and positive, got {}",
                self.layer_norm_eps
            )));
        }
        if !(self.gamma_init.is_finite() && self.gamma_init > 0.0) {
            return Err(AttnError::InvalidArgument(format!(
                "gamma_init must be finite and positive, got {}",
                self.gamma_init
            )));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(AttnError::InvalidArgument(format!("dropout must be in [0, 1), got {}", self.dropout)));
        }
        let cfg = DilatedConfig::builder()
            .segments(&self.segment_lengths)
            .dilations(&self.dilation_rates)
            .mixing(self.mixing)
            .causal(self.causal)
            .maybe_scale(self.scale)
            .build()?;
        cfg.validate_heads(self.num_heads)?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pytorch_style_validation() {
        let ok = MultiheadConfig::new(32, 4, &[8, 16], &[1, 2]);
        assert_eq!(ok.validate().unwrap().segment_lengths(), &[8, 16]);
        assert_eq!(ok.head_dim(), 8);
        let msg = MultiheadConfig::new(30, 4, &[8], &[1]).validate().unwrap_err().to_string();
        assert!(msg.contains("divisible"), "{msg}");
        assert!(MultiheadConfig::new(0, 4, &[8], &[1]).validate().is_err());
        assert!(MultiheadConfig::new(8, 0, &[8], &[1]).validate().is_err());
        assert!(matches!(
            MultiheadConfig::new(8, 2, &[8, 16, 32], &[1, 2, 4]).validate(),
            Err(AttnError::TooFewHeads { heads: 2, groups: 3 })
        ));
        assert!(MultiheadConfig::new(8, 2, &[8, 16, 32], &[1, 2, 4]).with_mixing(Mixing::LongNet).validate().is_ok());
        assert!(matches!(
            MultiheadConfig::new(8, 2, &[8], &[]).validate(),
            Err(AttnError::PatternCountMismatch { .. })
        ));
        for p in [-0.1, 1.0, f64::NAN] {
            assert!(MultiheadConfig::new(8, 2, &[8], &[1]).with_dropout(p).validate().is_err());
        }
        assert!(MultiheadConfig::new(8, 2, &[8], &[1]).with_gamma_init(0.0).validate().is_err());
        let scaled = MultiheadConfig::new(8, 2, &[8], &[1]).with_scale(Some(0.5)).validate().unwrap();
        assert_eq!(scaled.scale_for(4), 0.5);
        assert!(matches!(
            MultiheadConfig::new(8, 2, &[8], &[1]).with_scale(Some(-1.0)).validate(),
            Err(AttnError::InvalidScale(_))
        ));
        let gqa = MultiheadConfig::new(32, 4, &[8], &[1]).with_num_kv_heads(2);
        assert!(gqa.validate().is_ok() && gqa.kv_dim() == 16);
        for kv in [0, 3] {
            assert!(matches!(
                MultiheadConfig::new(32, 4, &[8], &[1]).with_num_kv_heads(kv).validate(),
                Err(AttnError::KvHeadsNotDividing { heads: 4, kv_heads: _ })
            ));
        }
    }
}
