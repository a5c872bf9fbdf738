//! `--json` single-case mode: measure one case and print one JSON object.

use crate::gemm_rate::GEMM_N;
use indicatif::ProgressBar;
use serde_json::{Value, json};

use crate::case::{CaseKind, CaseSpec};
use crate::gemm_rate;
use crate::machine::Machine;
use crate::measure::{self, Repetitions};

/// Measure `spec` (plus, for ring cases, the same case on one rank) and return the
/// JSON object printed by `--json`.
pub fn run(spec: &CaseSpec, runs: Option<usize>) -> Value {
    let machine = Machine::probe();
    let gemm = gemm_rate::measure(GEMM_N, spec.threads, 5);
    let reps = match runs {
        Some(n) => Repetitions { min_runs: n.max(1), max_runs: n.max(1), budget: std::time::Duration::ZERO },
        None => Repetitions::QUICK,
    };
    let bar = ProgressBar::hidden();
    let m = measure::measure(spec, reps, gemm.median_gflop_per_s, &machine.git_commit, &bar);
    let mut obj = json!({
        "case": spec.kind.as_str(),
        "implementation": spec.implementation,
        "status": m.status,
        "median_ms": m.median_ms,
        "min_ms": m.min_ms,
        "runs": m.runs,
        "gflop_per_s": m.gflop_per_s,
        "tokens_per_s": m.tokens_per_s,
        "peak_bytes": m.peak_bytes,
        "peak_rss_bytes": m.peak_rss_bytes,
        "gemm_gflop_per_s": gemm.median_gflop_per_s,
        "gemm_fraction": m.gemm_fraction(),
        "spec": serde_json::to_value(spec).unwrap_or(Value::Null),
        "machine": serde_json::to_value(&machine).unwrap_or(Value::Null),
    });
    if spec.kind == CaseKind::Hilbert
        && let Some(h) = crate::hilbert_orders::HilbertOrders::measure(5)
    {
        obj["hilbert_orders"] = h.json();
    }
    if spec.kind == CaseKind::Ring {
        let mut one = spec.clone();
        one.kind = CaseKind::Dilated;
        one.world_size = 1;
        one.implementation = "cpu".into();
        let single = measure::measure(&one, reps, gemm.median_gflop_per_s, &machine.git_commit, &bar);
        obj["per_rank_peak_bytes"] = json!(m.rank_peak_bytes);
        obj["peak_bytes_per_rank"] = json!(m.peak_bytes_per_rank);
        obj["bytes_sent"] = json!(m.bytes_sent);
        obj["single_rank"] = json!({
            "status": single.status,
            "median_ms": single.median_ms,
            "gflop_per_s": single.gflop_per_s,
            "tokens_per_s": single.tokens_per_s,
            "peak_bytes": single.peak_bytes,
        });
    }
    obj
}
