//! Opt-in input guards: finite-value checks and memory budgets, checked before any work.

use crate::element::Element;
use crate::error::{AttnError, Result, TensorName};
use crate::view::TensorView;

/// Whether a call first checks q, k, v (and grad_out in a backward) for NaN and infinity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FiniteCheck {
    /// No check (the default): non-finite inputs flow through as IEEE arithmetic says.
    #[default]
    Off,
    /// Refuse a call holding a non-finite input with [`AttnError::NonFinite`].
    Inputs,
}

/// The first non-finite element of a view, as `AttnError::NonFinite` naming the
/// tensor and the flat row-major index `((b * seq + s) * heads + h) * head_dim + e`.
pub fn check_finite<T: Element>(tensor: TensorName, view: &TensorView<'_, T>) -> Result<()> {
    let sh = view.shape();
    for b in 0..sh.batch {
        for s in 0..sh.seq {
            for h in 0..sh.heads {
                if let Some(e) = view.row(b, s, h).iter().position(|x| !x.to_f64().is_finite()) {
                    let index = ((b * sh.seq + s) * sh.heads + h) * sh.head_dim + e;
                    return Err(AttnError::NonFinite { tensor, index });
                }
            }
        }
    }
    Ok(())
}

/// A cap on the scratch memory one call may allocate. `None` means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryBudget {
    pub bytes: Option<usize>,
}

impl MemoryBudget {
    pub fn unlimited() -> Self {
        MemoryBudget { bytes: None }
    }
    pub fn bytes(bytes: usize) -> Self {
        MemoryBudget { bytes: Some(bytes) }
    }
    /// `Err(OverBudget)` if `needed` exceeds the budget.
    pub fn check(&self, needed: usize) -> Result<()> {
        match self.bytes {
            Some(budget) if needed > budget => Err(AttnError::OverBudget { needed, budget }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::Shape4;

    #[test]
    fn finds_the_first_non_finite_value() {
        let shape = Shape4::new(1, 2, 2, 3).unwrap();
        let mut data = vec![0.5f32; 12];
        let v = TensorView::contiguous(TensorName::Key, &data, shape).unwrap();
        assert!(check_finite(TensorName::Key, &v).is_ok());
        data[7] = f32::INFINITY;
        data[9] = f32::NAN;
        let v = TensorView::contiguous(TensorName::Key, &data, shape).unwrap();
        assert!(matches!(
            check_finite(TensorName::Key, &v),
            Err(AttnError::NonFinite { tensor: TensorName::Key, index: 7 })
        ));
    }

    #[test]
    fn budget_refuses_only_above_the_cap() {
        assert!(MemoryBudget::bytes(100).check(100).is_ok());
        assert!(matches!(MemoryBudget::bytes(100).check(101), Err(AttnError::OverBudget { needed: 101, budget: 100 })));
        assert!(MemoryBudget::unlimited().check(usize::MAX).is_ok());
    }
}
