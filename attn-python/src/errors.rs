//! `AttnError` to Python exceptions: bad dtypes are `TypeError`, bad values, shapes and
//! configs `ValueError`, an over-budget call `MemoryError`, a refused feature
//! `NotImplementedError`, and backend failures `RuntimeError`; the message is the
//! error's own text.

use attn_core::AttnError;
use pyo3::PyErr;
use pyo3::exceptions::{PyMemoryError, PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError};

/// The Python exception for `e`.
pub fn to_py(e: AttnError) -> PyErr {
    let msg = e.to_string();
    match e {
        AttnError::DTypeMismatch { .. } => PyTypeError::new_err(msg),
        AttnError::OverBudget { .. } => PyMemoryError::new_err(msg),
        AttnError::Unsupported { .. } | AttnError::NotCompiled { .. } => PyNotImplementedError::new_err(msg),
        AttnError::BackendUnavailable { .. }
        | AttnError::Backend { .. }
        | AttnError::Comm { .. }
        | AttnError::Timeout { .. }
        | AttnError::RankDisagreement(_) => PyRuntimeError::new_err(msg),
        _ => PyValueError::new_err(msg),
    }
}
