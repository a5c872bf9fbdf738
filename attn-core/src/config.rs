//! `DilatedConfig`: which patterns run (dilated segments or a sliding window), how they
//! mix, causality, scale; with validation. Causality is one [`Causality`] and window
//! mode one [`Window`] held in the config's pattern set; [`Mixing::Window`] is that
//! mode's name (in files, on command lines, in `match`es on [`DilatedConfig::mixing`]).

use crate::band::Band;
pub use crate::causality::Causality;
use crate::error::{AttnError, Result};
use crate::pattern::SegmentPattern;

/// How the patterns of a config are combined (see SPEC.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mixing {
    /// Heads split into G groups, group `i` runs pattern `i`, output divided by G.
    /// Equals `dilated-attention-pytorch` `DilatedAttention`.
    #[default]
    HeadGroups,
    /// Every head runs every pattern; the patterns are merged by their softmax
    /// denominators (LongNet, arXiv 2307.02486 eq. 10).
    LongNet,
    /// One sliding window `(left, right)` that every head runs, over the whole sequence
    /// (no segments, no dilation, no 1/G factor).
    Window,
}

/// A sliding window: query `p` sees the keys `p - left ..= p + right` (and none after
/// `p` when causal), so at most `left + right + 1` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Window {
    pub left: usize,
    pub right: usize,
}

impl Mixing {
    /// Name used in golden files and on command lines.
    pub fn as_str(self) -> &'static str {
        match self {
            Mixing::HeadGroups => "head_groups",
            Mixing::LongNet => "longnet",
            Mixing::Window => "window",
        }
    }

    /// Parse `head_groups` / `longnet` / `window` (also `headgroups`, `long_net`).
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "headgroups" => Ok(Mixing::HeadGroups),
            "longnet" => Ok(Mixing::LongNet),
            "window" => Ok(Mixing::Window),
            _ => Err(AttnError::InvalidArgument(format!("unknown mixing mode `{s}`"))),
        }
    }
}

/// A validated attention configuration: dilated patterns mixed by head groups or
/// LongNet, or one sliding window.
///
/// Built with [`DilatedConfig::builder`], [`DilatedConfig::new`] or
/// [`DilatedConfig::sliding_window`]; all validate, so a value of this type always
/// satisfies the definition's rules except the head-count rule, which needs the tensor
/// shape ([`DilatedConfig::validate_heads`]).
#[derive(Debug, Clone, PartialEq)]
pub struct DilatedConfig {
    patterns: PatternSet,
    causality: Causality,
    scale: Option<f64>,
}

/// The patterns a config runs: dilated segments mixed across heads, or one sliding
/// window; the one place window mode is held.
#[derive(Debug, Clone, PartialEq)]
enum PatternSet {
    /// `mixing` is [`Mixing::HeadGroups`] or [`Mixing::LongNet`].
    Dilated {
        segment_lengths: Vec<usize>,
        dilation_rates: Vec<usize>,
        mixing: Mixing,
    },
    Window(Window),
}

impl DilatedConfig {
    /// A config with the given patterns, HeadGroups mixing, full (non-causal), default scale.
    pub fn new(segment_lengths: &[usize], dilation_rates: &[usize]) -> Result<Self> {
        Self::builder().segments(segment_lengths).dilations(dilation_rates).build()
    }

    /// A sliding window `(left, right)`, full (non-causal), default scale.
    pub fn sliding_window(left: usize, right: usize) -> Result<Self> {
        Self::builder().window(left, right).build()
    }

    /// Start building a config.
    pub fn builder() -> DilatedConfigBuilder {
        DilatedConfigBuilder::default()
    }

    /// The dilated segment lengths (empty in window mode).
    pub fn segment_lengths(&self) -> &[usize] {
        match &self.patterns {
            PatternSet::Dilated { segment_lengths, .. } => segment_lengths,
            PatternSet::Window(_) => &[],
        }
    }
    /// The dilation rates (empty in window mode).
    pub fn dilation_rates(&self) -> &[usize] {
        match &self.patterns {
            PatternSet::Dilated { dilation_rates, .. } => dilation_rates,
            PatternSet::Window(_) => &[],
        }
    }
    /// How the patterns mix: [`Mixing::Window`] exactly in window mode.
    pub fn mixing(&self) -> Mixing {
        match &self.patterns {
            PatternSet::Dilated { mixing, .. } => *mixing,
            PatternSet::Window(_) => Mixing::Window,
        }
    }
    /// The sliding window (window mode only).
    pub fn window(&self) -> Option<Window> {
        match &self.patterns {
            PatternSet::Dilated { .. } => None,
            PatternSet::Window(w) => Some(*w),
        }
    }
    /// Which keys a query may see by distance: the window, or (dilated) every key, or
    /// none after the query when causal.
    pub fn band(&self) -> Band {
        let (left, right) = match self.window() {
            Some(w) => (w.left, w.right),
            None => (usize::MAX, usize::MAX),
        };
        Band::new(left, if self.causality.is_causal() { 0 } else { right })
    }
    /// Whether a query sees keys after it.
    pub fn causality(&self) -> Causality {
        self.causality
    }
    /// Shorthand for `causality().is_causal()`.
    pub fn causal(&self) -> bool {
        self.causality.is_causal()
    }
    /// The explicit scale, if the caller set one.
    pub fn explicit_scale(&self) -> Option<f64> {
        self.scale
    }
    /// Number of patterns G (1 in window mode: the window's one whole-sequence pattern).
    pub fn num_patterns(&self) -> usize {
        match &self.patterns {
            PatternSet::Dilated { segment_lengths, .. } => segment_lengths.len(),
            PatternSet::Window(_) => 1,
        }
    }

    /// Softmax scale for a head dimension: the explicit one or `1/sqrt(head_dim)`.
    pub fn scale_for(&self, head_dim: usize) -> f64 {
        self.scale.unwrap_or_else(|| 1.0 / (head_dim as f64).sqrt())
    }

    /// Pattern `i` with offset `off` (HeadGroups uses `i mod r_i`, LongNet `head mod r_i`;
    /// window mode has the one [`SegmentPattern::whole`]). Panics, like slice indexing,
    /// when `i >= num_patterns()`.
    pub fn pattern(&self, i: usize, off: usize) -> SegmentPattern {
        match &self.patterns {
            PatternSet::Dilated { segment_lengths, dilation_rates, .. } => {
                SegmentPattern::new(segment_lengths[i], dilation_rates[i], off)
            }
            PatternSet::Window(_) => {
                assert!(i == 0, "window mode has one pattern, asked for pattern {i}");
                SegmentPattern::whole()
            }
        }
    }

    /// Dilation rate of pattern `i` (1 in window mode).
    pub fn rate(&self, i: usize) -> usize {
        match &self.patterns {
            PatternSet::Dilated { dilation_rates, .. } => dilation_rates[i],
            PatternSet::Window(_) => 1,
        }
    }

    /// A copy with another causality.
    pub fn with_causality(mut self, causality: Causality) -> Self {
        self.causality = causality;
        self
    }

    /// Check the head-count rule: HeadGroups needs `heads >= G`; zero heads is an error.
    pub fn validate_heads(&self, heads: usize) -> Result<()> {
        if heads == 0 {
            return Err(AttnError::ZeroDim { tensor: crate::error::TensorName::Query, dim: "heads" });
        }
        if self.mixing() == Mixing::HeadGroups && heads < self.num_patterns() {
            return Err(AttnError::TooFewHeads { heads, groups: self.num_patterns() });
        }
        Ok(())
    }

    fn validate_scale(&self) -> Result<()> {
        if let Some(s) = self.scale
            && !(s.is_finite() && s > 0.0)
        {
            return Err(AttnError::InvalidScale(s));
        }
        Ok(())
    }
}

/// Builder for [`DilatedConfig`]; `build` validates.
#[derive(Debug, Clone, Default)]
pub struct DilatedConfigBuilder {
    segment_lengths: Vec<usize>,
    dilation_rates: Vec<usize>,
    mixing: Mixing,
    window: Option<Window>,
    causality: Causality,
    scale: Option<f64>,
}

impl DilatedConfigBuilder {
    pub fn segments(mut self, w: &[usize]) -> Self {
        self.segment_lengths = w.to_vec();
        self
    }
    pub fn dilations(mut self, r: &[usize]) -> Self {
        self.dilation_rates = r.to_vec();
        self
    }
    pub fn mixing(mut self, m: Mixing) -> Self {
        self.mixing = m;
        self
    }
    /// A sliding window `(left, right)`: sets the mixing to [`Mixing::Window`] (segments
    /// and rates must then stay empty).
    pub fn window(mut self, left: usize, right: usize) -> Self {
        self.window = Some(Window { left, right });
        self.mixing = Mixing::Window;
        self
    }
    pub fn causality(mut self, c: Causality) -> Self {
        self.causality = c;
        self
    }
    /// Shorthand for `causality(Causality::Causal)`.
    pub fn causal(self) -> Self {
        self.causality(Causality::Causal)
    }
    /// Set an explicit softmax scale (must be finite and positive).
    pub fn scale(mut self, s: f64) -> Self {
        self.scale = Some(s);
        self
    }
    /// Set or clear the explicit scale.
    pub fn maybe_scale(mut self, s: Option<f64>) -> Self {
        self.scale = s;
        self
    }
    pub fn build(self) -> Result<DilatedConfig> {
        let (causality, scale) = (self.causality, self.scale);
        let cfg = DilatedConfig { patterns: self.patterns()?, causality, scale };
        cfg.validate_scale()?;
        Ok(cfg)
    }

    /// The pattern set the builder describes, checked: a window with mixing `window` and
    /// no segments, or valid `(w, r)` pairs with mixing `head_groups` or `longnet`.
    fn patterns(self) -> Result<PatternSet> {
        let (segs, rates) = (self.segment_lengths, self.dilation_rates);
        match (self.window, self.mixing) {
            (Some(_), Mixing::Window) if !(segs.is_empty() && rates.is_empty()) => {
                return Err(AttnError::WindowWithSegments);
            }
            (Some(w), Mixing::Window) => return Ok(PatternSet::Window(w)),
            (Some(_), mixing) | (None, mixing @ Mixing::Window) => {
                return Err(AttnError::WindowMixing { mixing: mixing.as_str() });
            }
            (None, _) => {}
        }
        if segs.is_empty() && rates.is_empty() {
            return Err(AttnError::EmptyPatterns);
        }
        if segs.len() != rates.len() {
            return Err(AttnError::PatternCountMismatch { segments: segs.len(), rates: rates.len() });
        }
        for (index, (&w, &r)) in segs.iter().zip(&rates).enumerate() {
            if w == 0 {
                return Err(AttnError::ZeroSegmentLength { index });
            }
            if r == 0 {
                return Err(AttnError::ZeroDilationRate { index });
            }
            if r > w {
                return Err(AttnError::RateExceedsSegment { index, rate: r, segment: w });
            }
        }
        Ok(PatternSet::Dilated { segment_lengths: segs, dilation_rates: rates, mixing: self.mixing })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_each_bad_value() {
        let b = || DilatedConfig::builder();
        assert!(matches!(b().build(), Err(AttnError::EmptyPatterns)));
        assert!(matches!(
            b().segments(&[4, 8]).dilations(&[1]).build(),
            Err(AttnError::PatternCountMismatch { segments: 2, rates: 1 })
        ));
        assert!(matches!(
            b().segments(&[4, 0]).dilations(&[1, 1]).build(),
            Err(AttnError::ZeroSegmentLength { index: 1 })
        ));
        assert!(matches!(b().segments(&[4]).dilations(&[0]).build(), Err(AttnError::ZeroDilationRate { index: 0 })));
        assert!(matches!(
            b().segments(&[4]).dilations(&[5]).build(),
            Err(AttnError::RateExceedsSegment { index: 0, rate: 5, segment: 4 })
        ));
        for s in [f64::NAN, f64::INFINITY, 0.0, -1.0] {
            assert!(matches!(b().segments(&[4]).dilations(&[1]).scale(s).build(), Err(AttnError::InvalidScale(_))));
        }
        let cfg = DilatedConfig::new(&[4, 8, 16], &[1, 2, 4]).unwrap();
        assert!(matches!(cfg.validate_heads(2), Err(AttnError::TooFewHeads { heads: 2, groups: 3 })));
        assert!(cfg.validate_heads(3).is_ok());
        let ln = DilatedConfig::builder().segments(&[4, 8, 16]).dilations(&[1, 2, 4]).mixing(Mixing::LongNet);
        assert!(ln.build().unwrap().validate_heads(1).is_ok());
    }

    #[test]
    fn window_mode_rules() {
        let b = || DilatedConfig::builder();
        assert!(matches!(b().window(3, 1).segments(&[4]).dilations(&[1]).build(), Err(AttnError::WindowWithSegments)));
        assert!(matches!(b().window(3, 1).mixing(Mixing::LongNet).build(), Err(AttnError::WindowMixing { .. })));
        assert!(matches!(b().mixing(Mixing::Window).build(), Err(AttnError::WindowMixing { .. })));
        assert!(matches!(b().window(3, 1).scale(-1.0).build(), Err(AttnError::InvalidScale(_))));
        let cfg = DilatedConfig::sliding_window(4095, 0).unwrap();
        assert_eq!((cfg.num_patterns(), cfg.pattern(0, 0), cfg.rate(0)), (1, SegmentPattern::whole(), 1));
        assert!(cfg.validate_heads(1).is_ok() && cfg.segment_lengths().is_empty());
        assert_eq!(cfg.band(), Band::new(4095, 0));
        assert_eq!(cfg.clone().with_causality(Causality::Causal).band(), Band::new(4095, 0));
        assert_eq!(
            DilatedConfig::sliding_window(2, 5).unwrap().with_causality(Causality::Causal).band(),
            Band::new(2, 0)
        );
        assert_eq!((cfg.mixing(), cfg.window()), (Mixing::Window, Some(Window { left: 4095, right: 0 })));
        assert_eq!(DilatedConfig::new(&[4], &[1]).unwrap().band(), Band::new(usize::MAX, usize::MAX));
        assert_eq!(Mixing::parse("window").unwrap(), Mixing::Window);
    }

    #[test]
    fn default_scale_is_inverse_sqrt_head_dim() {
        let cfg = DilatedConfig::new(&[4], &[1]).unwrap();
        assert_eq!(cfg.scale_for(16), 0.25);
        let cfg = DilatedConfig::builder().segments(&[4]).dilations(&[1]).scale(0.5).build().unwrap();
        assert_eq!(cfg.scale_for(16), 0.5);
    }
}
