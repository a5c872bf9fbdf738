//! Checking a golden case against a backend, one report line: in f32 every tensor within
//! the file's `rel_tol` of the file's values; in every dtype every row within its bound
//! against the float64 reference on the inputs rounded as the backend rounds them
//! ([`crate::judge`]), so a low-precision backend is compared like with like.

use std::fmt;

use attn_core::{AttnError, DType, Feature, Result};

use super::GoldenCase;
use crate::judge::{Expected, RowCheck, judge_backward, judge_forward, round_to};
use crate::problem::Problem;
use crate::tolerance::{Tolerance, max_abs_error, rel_l2_error};

/// Forward results in f32: out `[b, n, h, d]`, lse `[b, n, h]`.
#[derive(Debug, Clone)]
pub struct Forward32 {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
}

/// Gradients in f32.
#[derive(Debug, Clone)]
pub struct Gradients32 {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
}

/// A dilated-attention implementation under test. Inputs (`[q, k, v]`, row-major) and
/// outputs are f32; a backend computing in another dtype converts and reports it in
/// `dtype`.
pub trait DilatedBackend {
    fn name(&self) -> String;
    fn dtype(&self) -> DType {
        DType::F32
    }
    fn forward(&self, problem: &Problem<'_>, qkv: [&[f32]; 3]) -> Result<Forward32>;
    fn backward(&self, problem: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<Gradients32>;
    /// [`DilatedBackend::backward`] of `sum(out * grad_out) + sum(lse * grad_lse)`
    /// (`grad_lse` `[batch, seq, heads]`); a backend under test without it refuses.
    fn backward_lse(
        &self,
        problem: &Problem<'_>,
        qkv: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: &[f32],
    ) -> Result<Gradients32> {
        let _ = (problem, qkv, grad_out, grad_lse);
        Err(AttnError::Unsupported { backend: "backend under test", feature: Feature::Other("gradients into the LSE") })
    }
}

/// The layer's output and the gradients of `sum(out * grad_out)` in f32, named as the
/// file names them: `d_query` (`d_key`, `d_value` in cross-attention), `d.<parameter>`.
#[derive(Debug, Clone)]
pub struct MultiheadGrads32 {
    pub out: Vec<f32>,
    pub grads: Vec<(String, Vec<f32>)>,
}

/// A multihead layer implementation under test: given a `kind=multihead` case
/// (inputs, weights, metadata), return the layer output, and for a file with
/// `grad_out` the output and every gradient.
pub trait MultiheadBackend {
    fn name(&self) -> String;
    fn dtype(&self) -> DType {
        DType::F32
    }
    fn forward(&self, case: &GoldenCase) -> Result<Vec<f32>>;
    /// A training forward and the backward of the file's `grad_out`; a backend under
    /// test without it refuses.
    fn backward(&self, case: &GoldenCase) -> Result<MultiheadGrads32> {
        let _ = case;
        Err(AttnError::Unsupported {
            backend: "multihead backend under test",
            feature: Feature::Other("layer gradients"),
        })
    }
}

/// One tensor's measured error against its bound.
#[derive(Debug, Clone)]
pub struct TensorCheck {
    pub tensor: String,
    pub rel_l2: f64,
    pub max_abs: f64,
    pub bound: f64,
}

impl TensorCheck {
    pub fn passed(&self) -> bool {
        self.rel_l2 <= self.bound
    }
}

/// The outcome of one case: per-tensor errors against the file, per-row verdicts
/// against the reference, or the error that stopped it. Displayed as one line:
/// `PASS|FAIL case [backend] out=REL (abs MAX) ... (bound B) rows: out=... (row R at F
/// of its bound) ...`, `!` after a tensor name marking one over its bound; `REFUSED case
/// [backend] error: ...` for a case the backend refuses as [`AttnError::Unsupported`]
/// (not a pass: a runner counts refusals and fails on any it was not told to expect).
#[derive(Debug, Clone)]
pub struct CaseReport {
    pub case: String,
    pub backend: String,
    pub checks: Vec<TensorCheck>,
    pub rows: Vec<RowCheck>,
    pub error: Option<String>,
    /// The error was the backend's typed refusal, [`AttnError::Unsupported`].
    pub refused: bool,
}

impl CaseReport {
    /// Passed: no error, at least one tensor checked, all within bounds.
    pub fn passed(&self) -> bool {
        self.error.is_none()
            && !(self.checks.is_empty() && self.rows.is_empty())
            && self.checks.iter().all(TensorCheck::passed)
            && self.rows.iter().all(RowCheck::passed)
    }

    /// A report for a case that could not be run.
    pub fn failed(case: &str, backend: &str, err: impl fmt::Display) -> Self {
        CaseReport {
            case: case.into(),
            backend: backend.into(),
            checks: vec![],
            rows: vec![],
            error: Some(err.to_string()),
            refused: false,
        }
    }
}

impl fmt::Display for CaseReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = match (self.passed(), self.refused) {
            (true, _) => "PASS",
            (false, true) => "REFUSED",
            (false, false) => "FAIL",
        };
        write!(f, "{status} {:<24} [{}]", self.case, self.backend)?;
        if let Some(e) = &self.error {
            return write!(f, " error: {e}");
        }
        // Per tensor: relative L2 error (the checked one), then the largest absolute error.
        for c in &self.checks {
            let mark = if c.passed() { "" } else { "!" };
            write!(f, " {}{mark}={:.2e} (abs {:.2e})", c.tensor, c.rel_l2, c.max_abs)?;
        }
        if let Some(c) = self.checks.first() {
            write!(f, " (bound {:.0e})", c.bound)?;
        }
        if !self.rows.is_empty() {
            write!(f, " rows:")?;
            for r in &self.rows {
                let mark = if r.passed() { "" } else { "!" };
                write!(f, " {}{mark}={:.2}", r.tensor, r.worst)?;
            }
        }
        Ok(())
    }
}

fn check(name: &str, got: &[f32], want: &[f32], bound: f64) -> TensorCheck {
    TensorCheck { tensor: name.into(), rel_l2: rel_l2_error(got, want), max_abs: max_abs_error(got, want), bound }
}

/// Every tensor the file lists (the loader requires them all): in f32 (or f64) against the file
/// within its `rel_tol`, and in every dtype row by row against the reference on the
/// inputs rounded to the backend's dtype.
fn run_dilated(case: &GoldenCase, backend: &dyn DilatedBackend) -> Result<(Vec<TensorCheck>, Vec<RowCheck>)> {
    let cfg = case.config()?;
    let problem = Problem { cfg: &cfg, shape: case.attn_shape()?, masks: case.masks() };
    let dtype = backend.dtype();
    let [q, k, v, go] = ["q", "k", "v", "grad_out"].map(|t| case.tensor(t).map(|x| &x.data));
    let (q, k, v, go) = (q?, k?, v?, go?);
    let fwd = backend.forward(&problem, [q, k, v])?;
    let g = backend.backward(&problem, [q, k, v], go)?;
    let mut checks = Vec::new();
    if matches!(dtype, DType::F32 | DType::F64) {
        let bound = case.rel_tol()?;
        checks.push(check("out", &fwd.out, &case.tensor("out")?.data, bound));
        if case.tensors.contains_key("lse") {
            checks.push(check("lse", &fwd.lse, &case.tensor("lse")?.data, bound));
        }
        for (name, got) in [("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv)] {
            checks.push(check(name, got, &case.tensor(name)?.data, bound));
        }
    }
    let [q, k, v, go] = [q, k, v, go].map(|x| round_to(dtype, x).into_iter().map(f64::from).collect::<Vec<_>>());
    let want = Expected::for_problem(&problem, [&q, &k, &v], Some(&go))?;
    let mut rows = judge_forward(&want, &fwd.out, &fwd.lse, dtype);
    rows.extend(judge_backward(&want, [&g.dq, &g.dk, &g.dv], dtype));
    Ok((checks, rows))
}

/// The L2 norm of a tensor.
fn norm(x: &[f32]) -> f64 {
    x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt()
}

/// One layer gradient against the file. A bias's gradient sums its projection's output
/// gradient over the rows; where the definition makes that sum zero (the key bias:
/// attention is unchanged by one shift of every key) the file holds the float64
/// generator's roundoff and a relative error measures nothing. A bias gradient whose
/// norm is below the f32 resolution of its weight's gradient (`f32::EPSILON *
/// ||d.<module>.weight||`) is judged by its error relative to that weight gradient's norm.
fn layer_check(case: &GoldenCase, name: &str, got: &[f32], bound: f64) -> Result<TensorCheck> {
    let want = &case.tensor(name)?.data;
    let weight = name.strip_suffix(".bias").map(|m| format!("{m}.weight"));
    let scale = match weight.as_deref().map(|w| case.tensor(w)).transpose()? {
        Some(w) if norm(want) < f64::from(f32::EPSILON) * norm(&w.data) => norm(&w.data),
        _ => return Ok(check(name, got, want, bound)),
    };
    let diff: Vec<f32> = got.iter().zip(want).map(|(g, w)| g - w).collect();
    let rel = if got.len() == want.len() { norm(&diff) / scale } else { f64::INFINITY };
    Ok(TensorCheck { tensor: name.into(), rel_l2: rel, max_abs: max_abs_error(got, want), bound })
}

/// The output, and for a file with `grad_out` every gradient it lists (each one the
/// backend must return, and none the file lacks), within the file's bound.
fn run_multihead(case: &GoldenCase, backend: &dyn MultiheadBackend) -> Result<(Vec<TensorCheck>, Vec<RowCheck>)> {
    let bound = Tolerance::golden(backend.dtype(), case.rel_tol()?).rel_l2;
    let Some(names) = case.multihead_gradient_names()? else {
        let out = backend.forward(case)?;
        return Ok((vec![check("out", &out, &case.tensor("out")?.data, bound)], vec![]));
    };
    let got = backend.backward(case)?;
    let mut checks = vec![check("out", &got.out, &case.tensor("out")?.data, bound)];
    for name in &names {
        let g = got.grads.iter().find(|(n, _)| n == name).ok_or_else(|| {
            AttnError::InvalidArgument(format!("{}: the backend gave no gradient `{name}`", case.name))
        })?;
        checks.push(layer_check(case, name, &g.1, bound)?);
    }
    if let Some((extra, _)) = got.grads.iter().find(|(n, _)| !names.contains(n)) {
        return Err(AttnError::InvalidArgument(format!("{}: gradient `{extra}` is not in the file", case.name)));
    }
    Ok((checks, vec![]))
}

/// Check a case: `kind=dilated` with `dilated`, `kind=multihead` with `multihead`.
/// A kind without a backend is a failure naming what is missing.
pub fn check_case(
    case: &GoldenCase,
    dilated: Option<&dyn DilatedBackend>,
    multihead: Option<&dyn MultiheadBackend>,
) -> CaseReport {
    let kind = match case.kind() {
        Ok(k) => k,
        Err(e) => return CaseReport::failed(&case.name, "-", e),
    };
    let (backend, result) = match (kind, dilated, multihead) {
        ("dilated", Some(b), _) => (b.name(), run_dilated(case, b)),
        ("multihead", _, Some(b)) => (b.name(), run_multihead(case, b)),
        (k, _, _) => ("-".to_string(), Err(AttnError::InvalidArgument(format!("no backend for kind={k}")))),
    };
    match result {
        Ok((checks, rows)) => {
            CaseReport { case: case.name.clone(), backend, checks, rows, error: None, refused: false }
        }
        Err(e @ AttnError::Unsupported { .. }) => {
            CaseReport { refused: true, ..CaseReport::failed(&case.name, &backend, e) }
        }
        Err(e) => CaseReport::failed(&case.name, &backend, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_line_shows_relative_and_absolute_error_per_tensor() {
        let r = CaseReport {
            case: "hg_basic".into(),
            backend: "cpu".into(),
            checks: vec![check("out", &[1.0, 2.0], &[1.0, 2.5], 1e-4), check("lse", &[3.0], &[3.0], 1e-4)],
            rows: vec![],
            error: None,
            refused: false,
        };
        let line = r.to_string();
        assert!(line.starts_with("FAIL hg_basic"), "{line}");
        assert!(line.contains(" out!=1.86e-1 (abs 5.00e-1)"), "{line}");
        assert!(line.ends_with(" lse=0.00e0 (abs 0.00e0) (bound 1e-4)"), "{line}");
        let e = CaseReport::failed("bad", "cpu", "truncated");
        assert_eq!(e.to_string(), format!("FAIL {:<24} [cpu] error: truncated", "bad"));
    }
}
