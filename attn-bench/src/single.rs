//! `--json` single-case mode: measure one case and print one JSON object.

use crate::gemm_rate::GEMM_N;
use std::path::Path;

use indicatif::ProgressBar;
use serde_json::{Value, json};

use crate::case::{CaseKind, CaseSpec, Implementation};
use crate::gemm_rate;
use crate::machine::Machine;
use crate::measure::{self, Repetitions};

/// Measure `spec` (plus, for ring cases, the same case on one rank; with `torch`, the
/// PyTorch script of dilated and multihead cases under that interpreter) and return
/// the JSON object printed by `--json`.
pub fn run(spec: &CaseSpec, runs: Option<usize>, torch: Option<&Path>) -> Value {
    let machine = Machine::probe();
    let gemm = gemm_rate::measure(GEMM_N, spec.threads, 5);
    let reps = match runs {
        Some(n) => Repetitions::exactly(n.max(1)),
        None => Repetitions::QUICK,
    };
    let bar = ProgressBar::hidden();
    let m = measure::measure(spec, reps, gemm.median_gflop_per_s, &machine.git_commit, &bar);
    let mut obj = json!({
        "case": spec.kind.as_str(),
        "implementation": spec.implementation.as_str(),
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
        one.implementation = Implementation::Cpu;
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
    if let Some(python) = torch {
        let torch_runs = runs.unwrap_or(m.runs.max(1));
        let (t, ratio) = torch_peer_json(python, spec, torch_runs, &machine.git_commit, m.median_ms, m.ok());
        obj["torch"] = t;
        obj["torch_median_over_ours"] = ratio;
    }
    obj
}

/// The PyTorch measurement of `spec` as JSON, and `torch median / our median` (how
/// many times faster this implementation is; `null` unless both ran). Segments longer
/// than the sequence are passed as `seq_len`: SPEC.md makes `w > n` one segment of
/// length `n`, and the script needs `w | n`.
fn torch_peer_json(
    python: &Path,
    spec: &CaseSpec,
    runs: usize,
    git: &str,
    ours_ms: f64,
    ours_ok: bool,
) -> (Value, Value) {
    let mut peer = spec.clone();
    peer.segments = spec.segments.iter().map(|&w| w.min(spec.seq_len)).collect();
    match crate::torch_peer::run(python, &peer, runs, git) {
        Ok(t) => {
            let ratio = (ours_ok && ours_ms > 0.0 && t.median_ms > 0.0).then(|| t.median_ms / ours_ms);
            let obj = json!({
                "status": t.status,
                "median_ms": t.median_ms,
                "runs": t.runs,
                "gflop_per_s": t.gflop_per_s,
                "tokens_per_s": t.tokens_per_s,
                "segments": peer.segments,
            });
            (obj, json!(ratio))
        }
        Err(e) => (json!({ "status": format!("error: {e}") }), Value::Null),
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    /// A fake interpreter logging its arguments and printing the scripts' JSON line
    /// (median 50 ms), or failing.
    fn fake_python(dir: &Path, fail: bool) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let body = if fail {
            "echo 'ModuleNotFoundError: No module named torch' >&2\nexit 1\n"
        } else {
            "echo '{\"impl\": \"torch\", \"torch\": \"9.9.9+fake\", \"median_ms\": 50.0, \
             \"gflop_per_s\": 12.5, \"tokens_per_s\": 1280.0}'\n"
        };
        let path = dir.join(if fail { "broken-python" } else { "fake-python" });
        let log = dir.join("argv.log");
        std::fs::write(&path, format!("#!/bin/sh\necho \"$@\" >> '{}'\n{body}", log.display())).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[test]
    fn torch_json_runs_the_multihead_script_with_the_case_flags_and_gives_the_ratio() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let mut spec = CaseSpec::dilated(Implementation::Cpu, 64, &[32, 128], &[1, 2]);
        (spec.kind, spec.backward, spec.heads) = (CaseKind::Multihead, true, 2);
        let (t, ratio) = torch_peer_json(&fake_python(dir, false), &spec, 3, "git", 20.0, true);
        assert!(t["status"].as_str().unwrap().starts_with("ok (9.9.9+fake"), "{t}");
        assert_eq!((t["median_ms"].as_f64(), t["runs"].as_u64(), ratio.as_f64()), (Some(50.0), Some(3), Some(2.5)));
        let log = std::fs::read_to_string(dir.join("argv.log")).unwrap();
        // The multihead script, forward+backward, segments longer than n passed as n (SPEC: one segment).
        assert!(log.contains("torch_multihead.py") && log.contains("--backward"), "{log}");
        assert!(log.contains("--seq-len 64") && log.contains("--segments 32,64") && log.contains("--runs 3"), "{log}");
        // Our failure gives no ratio; the interpreter's failure is an error status.
        assert!(torch_peer_json(&fake_python(dir, false), &spec, 1, "git", 20.0, false).1.is_null());
        let (bad, ratio) = torch_peer_json(&fake_python(dir, true), &spec, 1, "git", 20.0, true);
        assert!(bad["status"].as_str().unwrap().starts_with("error:") && ratio.is_null(), "{bad}");
    }
}
