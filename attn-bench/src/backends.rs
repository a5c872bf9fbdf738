//! The implementations a case can run, behind one `Runner` trait: reference, cpu,
//! ring strategies, multihead, hilbert. Each `prepare` allocates the case's inputs
//! (inside the caller's memory window) and returns a runner that makes one call.
//! `cuda` runs `attn_kernels::cuda` with the `cuda` feature and is `NotCompiled` without.

use attn_core::{AttnError, AttnShape, DType, Result, reference};

use crate::case::{CaseKind, CaseSpec, Implementation};
use crate::inputs::normal_vec;
pub use crate::runner::{RunStats, Runner};
use crate::{cpu_runner, feature_runner, multihead_runner, ring_runner};

/// The implementations this build knows, for `--list` and the report.
pub const IMPLEMENTATIONS: &[&str] =
    &["reference", "cpu", "cpu-workspace (dilated, multihead)", "cuda", "ring-<strategy>"];

/// Allocate inputs and build the runner for `spec`. `BackendUnavailable` and
/// `NotCompiled` mean "skip"; other errors are failures.
pub fn prepare(spec: &CaseSpec) -> Result<Box<dyn Runner>> {
    // Validate config and shape first so bad input is a typed error everywhere.
    spec.config()?;
    spec.attn_shape()?;
    if spec.uses_features() {
        return match (spec.kind, spec.implementation) {
            (CaseKind::Dilated, Implementation::Cpu) => feature_runner::features(spec),
            (CaseKind::Ring, Implementation::Ring(_)) => ring_runner::ring(spec),
            (kind, imp) => Err(AttnError::InvalidArgument(format!(
                "grouped heads, windows and variable-length sequences are benchmarked on `--case dilated --impl \
                 cpu` and `--case ring`, not `--case {} --impl {imp}`",
                kind.as_str()
            ))),
        };
    }
    match (spec.kind, spec.implementation) {
        (CaseKind::Dilated, Implementation::Reference) => Ok(Box::new(ReferenceRunner::new(spec)?)),
        (CaseKind::Dilated, Implementation::Cpu | Implementation::CpuWorkspace) => cpu_runner::dilated(spec),
        (CaseKind::Dilated, Implementation::Cuda) => cuda(spec),
        (CaseKind::Ring, Implementation::Ring(_)) => ring_runner::ring(spec),
        (CaseKind::Multihead, Implementation::Cpu | Implementation::CpuWorkspace) => multihead_runner::multihead(spec),
        (CaseKind::Hilbert, Implementation::Cpu) => cpu_runner::hilbert(spec),
        (kind, other) => Err(AttnError::InvalidArgument(format!(
            "no implementation `{other}` for case `{}` (known: {})",
            kind.as_str(),
            IMPLEMENTATIONS.join(", ")
        ))),
    }
}

#[cfg(feature = "cuda")]
fn cuda(spec: &CaseSpec) -> Result<Box<dyn Runner>> {
    crate::cuda_runner::dilated(spec)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_spec: &CaseSpec) -> Result<Box<dyn Runner>> {
    Err(AttnError::NotCompiled { backend: "cuda", feature: "cuda" })
}

/// One line for the report: whether CUDA cases ran, and if not, why.
pub fn cuda_status() -> String {
    #[cfg(feature = "cuda")]
    return crate::cuda_runner::status();
    #[cfg(not(feature = "cuda"))]
    return "not compiled in, CUDA cases are skipped (run `cargo xtask bench --cuda` on a machine with an NVIDIA GPU; \
            no CUDA toolkit is needed to build)"
        .into();
}

/// Whether an error means "not available here" rather than "failed".
pub fn is_unavailable(e: &AttnError) -> bool {
    matches!(e, AttnError::BackendUnavailable { .. } | AttnError::NotCompiled { .. })
}

/// The float64 reference of attn-core (correct by construction, slow: the baseline
/// every speedup in the report is relative to).
struct ReferenceRunner {
    cfg: attn_core::DilatedConfig,
    shape: AttnShape,
    backward: bool,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    grad_out: Vec<f64>,
}

impl ReferenceRunner {
    fn new(spec: &CaseSpec) -> Result<Self> {
        if !matches!(spec.dtype, DType::F32 | DType::F64) {
            return Err(AttnError::BackendUnavailable {
                backend: "reference",
                reason: format!(
                    "the reference computes in f64; dtype {} is not benchmarked on it",
                    spec.dtype.as_str()
                ),
            });
        }
        let shape = AttnShape::self_attn(spec.shape()?);
        let n = shape.q.numel();
        Ok(ReferenceRunner {
            cfg: spec.config()?,
            shape,
            backward: spec.backward,
            q: normal_vec(1, n),
            k: normal_vec(2, n),
            v: normal_vec(3, n),
            grad_out: if spec.backward { normal_vec(4, n) } else { Vec::new() },
        })
    }
}

impl Runner for ReferenceRunner {
    fn run(&mut self) -> Result<RunStats> {
        if self.backward {
            let (fwd, grads) =
                reference::dilated_backward(&self.cfg, self.shape, &self.q, &self.k, &self.v, &self.grad_out)?;
            std::hint::black_box((fwd, grads));
        } else {
            let fwd = reference::dilated_forward(&self.cfg, self.shape, &self.q, &self.k, &self.v)?;
            std::hint::black_box(fwd);
        }
        Ok(RunStats::default())
    }
}
