//! Judging a result row by row against the float64 reference run on the same (rounded)
//! inputs: every output and gradient row by the mixed bound of its own tensor, every
//! LSE at f32 accuracy. One bad row fails the check however large the tensor.
//!
//! A row is one `[head_dim]` vector of `out`, `dq`, `dk` or `dv` (one (batch, position,
//! head)), or one LSE value. An output or gradient row passes when
//! `||got - want|| <= rel * ||want|| + mag * ||magnitude|| + ||flushable|| +
//! quantum * ||quantum_terms|| + floor * sqrt(head_dim)`, `magnitude` being the row of
//! the reference's sums of absolute terms ([`Magnitudes`]), so a row whose terms cancel is
//! judged by its conditioning, and `quantum_terms` the sums of the factors of softmax
//! weights and score gradients, which a tensor-core kernel rounds to the dtype, where
//! they can fall to its subnormals ([`RowBound`] gives the constants per dtype). An LSE
//! passes when `|got - want| <= lse * (magnitude + 1)` with the row's LSE magnitude
//! (largest `|score|` term sum plus `ln` of the key count): scores and sums are f32 in
//! every backend, whatever the input dtype. Both `-inf` (a row with no key) is exact
//! agreement; anything else non-finite fails.

use std::fmt;

use attn_core::reference::{Forward, Gradients, Magnitudes, dilated_backward_lse, dilated_backward_masked};
use attn_core::{AttnShape, DType, DilatedConfig, Element, Result};

use crate::problem::Problem;

use crate::tolerance::Tolerance;

/// The bound's constants for results stored in one dtype: `rel` and `mag` multiply a
/// row's norm and its magnitude's norm, `floor` (per element) covers results that
/// underflow the dtype, `lse` multiplies an LSE row's magnitude plus one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowBound {
    pub rel: f64,
    pub mag: f64,
    pub floor: f64,
    pub lse: f64,
    /// Half the dtype's smallest subnormal: the largest rounding error of a weight or
    /// score gradient rounded to it below its normal range (0 for f32).
    pub quantum: f64,
}

/// f32 computation noise, in f32 unit roundoffs: every backend scores, exponentiates
/// and accumulates in f32; the largest row error measured over random problems (head_dim
/// 16-128, 100-8192 positions, both mixings, every ISA) is about 70 of them.
const F32_NOISE_ULPS: f64 = 256.0;

/// LSE accuracy, in f32 unit roundoffs of (magnitude + 1); measured at most about 13.
const LSE_ULPS: f64 = 64.0;

impl RowBound {
    /// The constants for results stored in `dtype`. f32 (and f64, judged as f32): the f32
    /// computation noise. f16/bf16: on top of it, one rounding of the stored result
    /// (`u * ||want||`) and one of each product term (`u * ||magnitude||`, the softmax
    /// weights in the bf16 dot-product engines), which is the worst case of those
    /// roundings, and the dtype's smallest subnormal per element for results that
    /// underflow. Errors that change an answer (a row scaled by 1.01 where rounding
    /// determines it to better than 1%, 0.01 on one LSE, dq scaled by 1.05) exceed them
    /// (`tests/planted_errors.rs`).
    pub fn for_dtype(dtype: DType) -> Self {
        let noise = F32_NOISE_ULPS * Tolerance::unit_roundoff(DType::F32);
        let lse = LSE_ULPS * Tolerance::unit_roundoff(DType::F32);
        match dtype {
            DType::F64 | DType::F32 => RowBound { rel: noise, mag: noise, floor: 0.0, lse, quantum: 0.0 },
            DType::F16 | DType::BF16 => {
                let u = Tolerance::unit_roundoff(dtype);
                // Smallest positive subnormals: 2^-24 (f16), 2^-133 (bf16).
                let floor = if dtype == DType::F16 { 2f64.powi(-24) } else { 2f64.powi(-133) };
                RowBound { rel: u + noise, mag: u + noise, floor, lse, quantum: floor / 2.0 }
            }
        }
    }
}

/// The reference's answer for one problem: forward, gradients and magnitudes.
#[derive(Debug, Clone)]
pub struct Expected {
    pub fwd: Forward,
    pub grads: Gradients,
    pub mag: Magnitudes,
    pub shape: AttnShape,
}

impl Expected {
    /// The float64 reference on `q, k, v` and `grad_out` (zeros where `None`: forward only),
    /// which should be the inputs exactly as the backend saw them (rounded to its dtype).
    pub fn compute(cfg: &DilatedConfig, shape: AttnShape, qkv: [&[f64]; 3], grad_out: Option<&[f64]>) -> Result<Self> {
        Self::for_problem(&Problem::new(cfg, shape), qkv, grad_out)
    }

    /// [`Expected::for_problem`] with a gradient into the LSE (`[batch, seq, heads]`).
    pub fn for_problem_lse(
        problem: &Problem<'_>,
        qkv: [&[f64]; 3],
        grad_out: &[f64],
        grad_lse: &[f64],
    ) -> Result<Self> {
        let shape = problem.shape;
        let (fwd, grads, mag) = dilated_backward_lse(problem.cfg, shape, problem.masks, qkv, grad_out, Some(grad_lse))?;
        Ok(Expected { fwd, grads, mag, shape })
    }

    /// [`Expected::compute`] for a problem with masks.
    pub fn for_problem(problem: &Problem<'_>, qkv: [&[f64]; 3], grad_out: Option<&[f64]>) -> Result<Self> {
        let shape = problem.shape;
        let zeros;
        let go = match grad_out {
            Some(g) => g,
            None => {
                zeros = vec![0.0; shape.q.numel()];
                &zeros
            }
        };
        let (fwd, grads, mag) = dilated_backward_masked(problem.cfg, shape, problem.masks, qkv, go)?;
        Ok(Expected { fwd, grads, mag, shape })
    }

    /// [`Expected::compute`] on inputs in any dtype.
    pub fn of<T: Element>(
        cfg: &DilatedConfig,
        shape: AttnShape,
        qkv: [&[T]; 3],
        grad_out: Option<&[T]>,
    ) -> Result<Self> {
        let wide = |x: &[T]| x.iter().map(|v| v.to_f64()).collect::<Vec<f64>>();
        let [q, k, v] = qkv.map(wide);
        let go = grad_out.map(wide);
        Self::compute(cfg, shape, [&q, &k, &v], go.as_deref())
    }
}

/// One tensor judged row by row: the worst row's error as a fraction of its bound (pass:
/// `<= 1`) and where it is, with the whole tensor's relative L2 error for the record.
#[derive(Debug, Clone, PartialEq)]
pub struct RowCheck {
    pub tensor: String,
    pub worst: f64,
    pub worst_row: usize,
    pub rel_l2: f64,
}

impl RowCheck {
    pub fn passed(&self) -> bool {
        self.worst <= 1.0
    }
}

impl fmt::Display for RowCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mark = if self.passed() { "" } else { "!" };
        write!(
            f,
            "{}{mark}={:.2e} (row {} at {:.2} of its bound)",
            self.tensor, self.rel_l2, self.worst_row, self.worst
        )
    }
}

fn ratio(err: f64, bound: f64) -> f64 {
    if err == 0.0 {
        0.0
    } else if bound > 0.0 && err.is_finite() {
        err / bound
    } else {
        f64::INFINITY
    }
}

/// Rows of `row_len` values of `got` against `want`, each within the [`RowBound`] of
/// `dtype` given the row's `[magnitude, flushable, quantum]` terms (see the module docs). A
/// length mismatch or a non-finite value fails.
pub fn check_rows<T: Element>(
    tensor: &str,
    got: &[T],
    want: &[f64],
    [magnitude, flushable, quantum]: [&[f64]; 3],
    row_len: usize,
    dtype: DType,
) -> RowCheck {
    let rel_l2 = crate::tolerance::rel_l2_error(got, want);
    let mut check = RowCheck { tensor: tensor.to_string(), worst: 0.0, worst_row: 0, rel_l2 };
    let n = want.len();
    let sized = [magnitude, flushable, quantum].iter().all(|x| x.len() == n);
    if got.len() != n || !sized || row_len == 0 || !n.is_multiple_of(row_len) {
        check.worst = f64::INFINITY;
        return check;
    }
    let b = RowBound::for_dtype(dtype);
    let floor = b.floor * (row_len as f64).sqrt();
    let norm = |x: &mut dyn Iterator<Item = f64>| x.map(|v| v * v).sum::<f64>().sqrt();
    let terms = magnitude.chunks(row_len).zip(flushable.chunks(row_len)).zip(quantum.chunks(row_len));
    let rows = got.chunks(row_len).zip(want.chunks(row_len)).zip(terms);
    for (r, ((g, w), ((m, fl), qu))) in rows.enumerate() {
        let err = if g.iter().all(|x| x.to_f64().is_finite()) {
            norm(&mut g.iter().zip(w).map(|(g, w)| g.to_f64() - w))
        } else {
            f64::INFINITY
        };
        let bound = b.rel * norm(&mut w.iter().copied())
            + b.mag * norm(&mut m.iter().copied())
            + norm(&mut fl.iter().copied())
            + b.quantum * norm(&mut qu.iter().copied())
            + floor;
        let q = ratio(err, bound);
        if q > check.worst || q.is_nan() {
            (check.worst, check.worst_row) = (if q.is_nan() { f64::INFINITY } else { q }, r);
        }
    }
    check
}

/// Each LSE within `lse * (magnitude + 1)` of the reference ([`RowBound::lse`]); `-inf`
/// only where the reference has it.
pub fn check_lse(got: &[f32], want: &[f64], magnitude: &[f64]) -> RowCheck {
    let rel_l2 = crate::tolerance::rel_l2_error(got, want);
    let mut check = RowCheck { tensor: "lse".into(), worst: 0.0, worst_row: 0, rel_l2 };
    if got.len() != want.len() || want.len() != magnitude.len() {
        check.worst = f64::INFINITY;
        return check;
    }
    let c = RowBound::for_dtype(DType::F32).lse;
    for (r, ((&g, &w), &m)) in got.iter().zip(want).zip(magnitude).enumerate() {
        let g = g as f64;
        let q = if g == w && w == f64::NEG_INFINITY {
            0.0
        } else if g.is_finite() && w.is_finite() {
            ratio((g - w).abs(), c * (m + 1.0))
        } else {
            f64::INFINITY
        };
        if q > check.worst {
            (check.worst, check.worst_row) = (q, r);
        }
    }
    check
}

/// The forward's `out` and f32 `lse` against `want`, `out` having been stored in `dtype`.
pub fn judge_forward<T: Element>(want: &Expected, out: &[T], lse: &[f32], dtype: DType) -> Vec<RowCheck> {
    let d = want.shape.q.head_dim;
    let mag = &want.mag;
    vec![
        check_rows("out", out, &want.fwd.out, [&mag.out, &mag.flushable.out, &mag.quantum.out], d, dtype),
        check_lse(lse, &want.fwd.lse, &mag.lse),
    ]
}

/// The gradients (stored in `dtype`) against `want`, each by its own tensor's rows.
pub fn judge_backward<T: Element>(want: &Expected, grads: [&[T]; 3], dtype: DType) -> Vec<RowCheck> {
    let d = want.shape.q.head_dim;
    let (g, m) = (&want.grads, &want.mag);
    let [dq, dk, dv] = grads;
    vec![
        check_rows("dq", dq, &g.dq, [&m.dq, &m.flushable.dq, &m.quantum.dq], d, dtype),
        check_rows("dk", dk, &g.dk, [&m.dk, &m.flushable.dk, &m.quantum.dk], d, dtype),
        check_rows("dv", dv, &g.dv, [&m.dv, &m.flushable.dv, &m.quantum.dv], d, dtype),
    ]
}

/// `x` rounded to `dtype` and back (the inputs a backend computing in `dtype` sees).
pub fn round_to(dtype: DType, x: &[f32]) -> Vec<f32> {
    match dtype {
        DType::BF16 => x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect(),
        DType::F16 => x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
        DType::F32 | DType::F64 => x.to_vec(),
    }
}

/// `Ok` when every check passed, else the failing ones in one message.
pub fn verdict(checks: &[RowCheck]) -> std::result::Result<(), String> {
    let failed: Vec<String> = checks.iter().filter(|c| !c.passed()).map(ToString::to_string).collect();
    if failed.is_empty() { Ok(()) } else { Err(failed.join("; ")) }
}

/// A backend's forward (`out`, `lse`) and backward (`dq, dk, dv`) in dtype `T` for the
/// inputs `[q, k, v, grad_out]` (already in `T`), judged row by row against the float64
/// reference on those same inputs.
pub fn judge<T: Element>(
    cfg: &DilatedConfig,
    shape: AttnShape,
    inputs: [&[T]; 4],
    out: &[T],
    lse: &[f32],
    grads: [&[T]; 3],
) -> std::result::Result<(), String> {
    let [q, k, v, go] = inputs;
    let want = Expected::of(cfg, shape, [q, k, v], Some(go)).map_err(|e| e.to_string())?;
    let mut checks = judge_forward(&want, out, lse, T::DTYPE);
    checks.extend(judge_backward(&want, grads, T::DTYPE));
    verdict(&checks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_bad_row_fails_however_many_good_rows_surround_it() {
        let want: Vec<f64> = (0..4000).map(|i| (i as f64 * 0.37).sin()).collect();
        let mag: Vec<f64> = want.iter().map(|w| w.abs()).collect();
        let mut got: Vec<f32> = want.iter().map(|&w| w as f32).collect();
        let none = vec![0.0; mag.len()];
        assert!(check_rows("out", &got, &want, [&mag, &none, &none], 4, DType::F32).passed());
        for x in &mut got[400..404] {
            *x *= 1.001;
        }
        let c = check_rows("out", &got, &want, [&mag, &none, &none], 4, DType::F32);
        assert!(!c.passed() && c.worst_row == 100, "{c}");
        // The whole tensor is within 1e-5: only the row check sees it.
        assert!(c.rel_l2 < 1e-4, "{c}");
    }

    /// A row made only of terms with flushed weights (a dk row of about 5e-39 from weights
    /// near 1e-36) may come out as 0, as the kernels compute it; twice its value may not.
    #[test]
    fn rows_of_flushed_weights_may_be_zero_and_nothing_else() {
        let want = [5.4e-39, -2.0e-39, 1.0e-39, 0.0];
        let mag = [1.2e-37, 0.4e-37, 0.3e-37, 0.1e-37];
        let got_zero = [0.0f32; 4];
        let got_double: Vec<f32> = want.iter().map(|w| (2.0 * w) as f32).collect();
        for dtype in [DType::F32, DType::BF16] {
            assert!(!check_rows("dk", &got_zero, &want, [&mag, &[0.0; 4], &[0.0; 4]], 4, dtype).passed());
            assert!(check_rows("dk", &got_zero, &want, [&mag, &mag, &[0.0; 4]], 4, dtype).passed());
            let wrong = check_rows("dk", &got_double, &want, [&[0.0; 4], &[0.0; 4], &[0.0; 4]], 4, dtype);
            assert!(!wrong.passed(), "{wrong}");
        }
    }

    #[test]
    fn lse_rows_need_matching_infinities() {
        let want = [f64::NEG_INFINITY, 1.5];
        let mag = [0.0, 2.0];
        assert!(check_lse(&[f32::NEG_INFINITY, 1.5], &want, &mag).passed());
        assert!(!check_lse(&[0.0, 1.5], &want, &mag).passed());
        assert!(!check_lse(&[f32::NEG_INFINITY, 1.51], &want, &mag).passed());
        assert!(!check_lse(&[f32::NEG_INFINITY, f32::NAN], &want, &mag).passed());
    }
}
