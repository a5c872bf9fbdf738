//! [`HeadWindow`]: a block whose tensors hold a run of a problem's heads (a Ulysses slot)
//! rather than all of them, so the kernels pick each head's pattern, block-mask row and
//! key/value head from its global index.

use std::ops::Range;

use attn_core::{AttnError, DilatedConfig, Result};

/// Which of a problem's heads a block's tensors hold: query heads `first..first + q heads`
/// of `heads`, key/value heads from `kv_first` of `kv_heads`. Query head `h` of the tensor
/// is global head `first + h`; it attends with that head's pattern (head-group mixing), its
/// block-mask row, and key/value head `(first + h) / (heads / kv_heads) - kv_first` of the
/// tensor. No window means the tensors hold every head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadWindow {
    /// The problem's query heads.
    pub heads: usize,
    /// The problem's key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// The global index of the tensor's first query head.
    pub first: usize,
    /// The global index of the tensor's first key/value head.
    pub kv_first: usize,
}

impl HeadWindow {
    /// Query heads a key/value head serves.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// The global query heads of a tensor of `q_heads` heads.
    pub fn global(&self, q_heads: usize) -> Range<usize> {
        self.first..self.first + q_heads
    }

    /// Check the window against the tensors' `q_heads` and `kv_tensor_heads` and the
    /// config: the problem's heads fit `cfg`, its key/value heads divide them, the query
    /// heads lie inside the problem's, and the key/value heads hold every one they read.
    pub fn check(&self, cfg: &DilatedConfig, q_heads: usize, kv_tensor_heads: usize) -> Result<()> {
        let HeadWindow { heads, kv_heads, first, kv_first } = *self;
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(AttnError::KvHeadsNotDividing { heads, kv_heads });
        }
        cfg.validate_heads(heads)?;
        if q_heads == 0 || first.checked_add(q_heads).is_none_or(|end| end > heads) {
            return Err(AttnError::InvalidArgument(format!(
                "a head window of query heads {first}..{} lies outside the problem's {heads} heads",
                first.saturating_add(q_heads)
            )));
        }
        let group = self.group();
        let read = first / group..(first + q_heads - 1) / group + 1;
        let held = kv_first..kv_first.saturating_add(kv_tensor_heads);
        if read.start < held.start || read.end > held.end || held.end > kv_heads {
            return Err(AttnError::InvalidArgument(format!(
                "a head window's key/value heads {held:?} (of {kv_heads}) do not hold the key/value heads {read:?} \
                 that its query heads {first}..{} read",
                first + q_heads
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_outside_the_heads_or_short_of_key_value_heads_is_a_typed_error() {
        let cfg = DilatedConfig::new(&[8, 16], &[1, 2]).unwrap();
        let w = |heads, kv_heads, first, kv_first| HeadWindow { heads, kv_heads, first, kv_first };
        // 6 heads on 2 key/value heads (group 3): heads 2..4 read key/value heads 0 and 1.
        assert!(w(6, 2, 2, 0).check(&cfg, 2, 2).is_ok());
        assert_eq!(w(6, 2, 2, 0).global(2), 2..4);
        let too_few = w(6, 2, 2, 0).check(&cfg, 2, 1).unwrap_err();
        assert!(too_few.to_string().contains("do not hold"), "{too_few}");
        let late = w(6, 2, 2, 1).check(&cfg, 2, 1).unwrap_err();
        assert!(late.to_string().contains("do not hold"), "{late}");
        let beyond = w(6, 2, 5, 1).check(&cfg, 2, 1).unwrap_err();
        assert!(beyond.to_string().contains("outside"), "{beyond}");
        assert!(matches!(w(6, 4, 0, 0).check(&cfg, 2, 4), Err(AttnError::KvHeadsNotDividing { .. })));
        assert!(matches!(w(1, 1, 0, 0).check(&cfg, 1, 1), Err(AttnError::TooFewHeads { .. })));
        assert!(w(6, 2, 0, 0).check(&cfg, 0, 1).is_err());
    }
}
