//! `Causality`: whether a query also sees keys at later positions, the one rule every
//! pattern, mask and kernel applies on top of its selection.

/// Whether a query also sees keys at later positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Causality {
    /// Every key the pattern selects in the query's segment.
    #[default]
    Full,
    /// Only keys at positions `<=` the query's.
    Causal,
}

impl Causality {
    pub fn is_causal(self) -> bool {
        self == Causality::Causal
    }
}

impl From<bool> for Causality {
    /// `true` is [`Causality::Causal`] (the config and file fields are booleans).
    fn from(causal: bool) -> Self {
        if causal { Causality::Causal } else { Causality::Full }
    }
}
