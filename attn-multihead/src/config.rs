//! `MultiheadConfig`: the hyper-parameters of `MultiheadDilatedAttention`, validated as PyTorch users expect.

use attn_core::{AttnError, Causality, DilatedConfig, Result, TensorName};

use crate::projection::Bias;

/// Where the layer's LayerNorms sit when `layer_norm` is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NormLayout {
    /// One `norm` over the merged heads before `out_proj` (MAGNETO's sub-LN, as the
    /// published dilated-attention-pytorch builds it).
    #[default]
    SubLn,
    /// That library's development line: `q_ln` over the projected q and again (the same
    /// weights) over the merged heads, `k_ln` over the projected k (`kv_dim` wide); no
    /// `norm`.
    QkLn,
}

impl NormLayout {
    /// `sub_ln` or `qk_ln` (the names of the Python layer's `norm_layout` and of the
    /// conformance files' metadata).
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "sub_ln" => Ok(NormLayout::SubLn),
            "qk_ln" => Ok(NormLayout::QkLn),
            other => Err(AttnError::InvalidArgument(format!("norm_layout must be `sub_ln` or `qk_ln`, got `{other}`"))),
        }
    }
}

/// Hyper-parameters of a multihead dilated attention layer (names as in
/// `dilated-attention-pytorch`'s `MultiheadDilatedAttention`); the attention itself
/// (dilated segments or a sliding window, causality, softmax scale) is `attention`.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiheadConfig {
    pub embed_dim: usize,
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`; must divide
    /// it): `k_proj` and `v_proj` have `num_kv_heads * head_dim` rows.
    pub num_kv_heads: usize,
    /// What attention runs: its patterns (segments and rates with their mixing, or a
    /// sliding window), causality (global positions; see SPEC.md) and softmax scale
    /// (`None`: `1/sqrt(head_dim)`). Valid by construction; `validate` checks it
    /// against the head count.
    pub attention: DilatedConfig,
    /// Whether the q/k/v/out projections have biases.
    pub bias: bool,
    /// LayerNorms as `norm_layout` places them (sub-LN by default).
    pub layer_norm: bool,
    pub norm_layout: NormLayout,
    pub layer_norm_eps: f64,
    /// MAGNETO gain for the v and out projections.
    pub gamma_init: f64,
    /// Dropout probability on the merged attention output in training mode.
    pub dropout: f64,
}

/// Whether the layer has its LayerNorms (placed by [`NormLayout`]) or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerNorms {
    Present,
    Absent,
}

impl From<bool> for LayerNorms {
    /// `true` (the configs' `layer_norm=True`) is [`LayerNorms::Present`].
    fn from(present: bool) -> Self {
        if present { LayerNorms::Present } else { LayerNorms::Absent }
    }
}

impl MultiheadConfig {
    /// A layer of `num_heads` heads over `embed_dim` running `attention`, with the
    /// library's defaults: bias, sub-LN, eps 1e-5, gamma_init 1, no dropout.
    pub fn new(embed_dim: usize, num_heads: usize, attention: DilatedConfig) -> Self {
        MultiheadConfig {
            embed_dim,
            num_heads,
            num_kv_heads: num_heads,
            attention,
            bias: true,
            layer_norm: true,
            norm_layout: NormLayout::SubLn,
            layer_norm_eps: 1e-5,
            gamma_init: 1.0,
            dropout: 0.0,
        }
    }

    /// Grouped-query attention: `num_kv_heads` key/value heads (dividing `num_heads`).
    pub fn with_num_kv_heads(mut self, num_kv_heads: usize) -> Self {
        self.num_kv_heads = num_kv_heads;
        self
    }
    /// The same attention with another causality.
    pub fn with_causality(mut self, causality: Causality) -> Self {
        self.attention = self.attention.with_causality(causality);
        self
    }
    /// Bias vectors in the projections or none (PyTorch's `bias=`).
    pub fn with_bias(mut self, bias: Bias) -> Self {
        self.bias = bias == Bias::Zeros;
        self
    }
    /// The LayerNorms `norm_layout` places, or none.
    pub fn with_layer_norm(mut self, norm: LayerNorms) -> Self {
        self.layer_norm = norm == LayerNorms::Present;
        self
    }
    /// Where the LayerNorms sit (with `layer_norm`).
    pub fn with_norm_layout(mut self, norm_layout: NormLayout) -> Self {
        self.norm_layout = norm_layout;
        self
    }
    /// Whether the layer has `q_ln` and `k_ln` (`layer_norm` with [`NormLayout::QkLn`]).
    pub fn qk_ln(&self) -> bool {
        self.layer_norm && self.norm_layout == NormLayout::QkLn
    }
    pub fn with_gamma_init(mut self, gamma_init: f64) -> Self {
        self.gamma_init = gamma_init;
        self
    }
    pub fn with_dropout(mut self, dropout: f64) -> Self {
        self.dropout = dropout;
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

    /// Check every field (the attention against the head count).
    pub fn validate(&self) -> Result<()> {
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
        self.attention.validate_heads(self.num_heads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_core::Mixing;

    fn dilated(w: &[usize], r: &[usize]) -> DilatedConfig {
        DilatedConfig::new(w, r).unwrap()
    }

    #[test]
    fn pytorch_style_validation() {
        let ok = MultiheadConfig::new(32, 4, dilated(&[8, 16], &[1, 2]));
        assert!(ok.validate().is_ok());
        assert_eq!(ok.head_dim(), 8);
        let msg = MultiheadConfig::new(30, 4, dilated(&[8], &[1])).validate().unwrap_err().to_string();
        assert!(msg.contains("divisible"), "{msg}");
        assert!(MultiheadConfig::new(0, 4, dilated(&[8], &[1])).validate().is_err());
        assert!(MultiheadConfig::new(8, 0, dilated(&[8], &[1])).validate().is_err());
        assert!(matches!(
            MultiheadConfig::new(8, 2, dilated(&[8, 16, 32], &[1, 2, 4])).validate(),
            Err(AttnError::TooFewHeads { heads: 2, groups: 3 })
        ));
        let longnet = DilatedConfig::builder().segments(&[8, 16, 32]).dilations(&[1, 2, 4]).mixing(Mixing::LongNet);
        assert!(MultiheadConfig::new(8, 2, longnet.build().unwrap()).validate().is_ok());
        for p in [-0.1, 1.0, f64::NAN] {
            assert!(MultiheadConfig::new(8, 2, dilated(&[8], &[1])).with_dropout(p).validate().is_err());
        }
        assert!(MultiheadConfig::new(8, 2, dilated(&[8], &[1])).with_gamma_init(0.0).validate().is_err());
        let scaled = DilatedConfig::builder().segments(&[8]).dilations(&[1]).scale(0.5).build().unwrap();
        assert_eq!(MultiheadConfig::new(8, 2, scaled).attention.scale_for(4), 0.5);
        let gqa = MultiheadConfig::new(32, 4, dilated(&[8], &[1])).with_num_kv_heads(2);
        assert!(gqa.validate().is_ok() && gqa.kv_dim() == 16);
        for kv in [0, 3] {
            assert!(matches!(
                MultiheadConfig::new(32, 4, dilated(&[8], &[1])).with_num_kv_heads(kv).validate(),
                Err(AttnError::KvHeadsNotDividing { heads: 4, kv_heads: _ })
            ));
        }
        let window = MultiheadConfig::new(8, 2, DilatedConfig::sliding_window(3, 0).unwrap());
        assert!(window.validate().is_ok(), "a window runs with any head count");
        let causal = MultiheadConfig::new(8, 2, dilated(&[8], &[1])).with_causality(Causality::Causal);
        assert!(causal.attention.causal());
    }
}
