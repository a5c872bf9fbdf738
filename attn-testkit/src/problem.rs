//! `Problem`: one attention problem as the judges and the backends under test see it.

use attn_core::{AttnShape, DilatedConfig, Masks};

/// One attention problem: the config, the q/kv shapes and the masks.
#[derive(Debug, Clone, Copy)]
pub struct Problem<'a> {
    pub cfg: &'a DilatedConfig,
    pub shape: AttnShape,
    pub masks: Masks<'a>,
}

impl<'a> Problem<'a> {
    /// A problem without masks.
    pub fn new(cfg: &'a DilatedConfig, shape: AttnShape) -> Self {
        Problem { cfg, shape, masks: Masks::default() }
    }

    /// The same problem with `masks`.
    pub fn with_masks(self, masks: Masks<'a>) -> Self {
        Problem { masks, ..self }
    }
}
