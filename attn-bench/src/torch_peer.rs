//! The PyTorch comparison: runs this crate's `torch/torch_dilated.py` or
//! `torch/torch_multihead.py` under the interpreter given by `--torch PYTHON`.

use std::path::{Path, PathBuf};
use std::process::Command;

use attn_core::{AttnError, Mixing, Result};
use serde::Deserialize;

use crate::case::{CaseKind, CaseSpec, Implementation, Measurement};

#[derive(Debug, Deserialize)]
struct TorchLine {
    median_ms: f64,
    gflop_per_s: f64,
    tokens_per_s: f64,
    torch: String,
}

/// The repository root (the workspace this crate belongs to).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// The script that implements `spec` in PyTorch, if there is one.
pub fn script_for(spec: &CaseSpec) -> Option<PathBuf> {
    match spec.kind {
        CaseKind::Dilated => Some(repo_root().join("attn-bench/torch/torch_dilated.py")),
        CaseKind::Multihead => Some(repo_root().join("attn-bench/torch/torch_multihead.py")),
        CaseKind::Ring | CaseKind::Hilbert => None,
    }
}

/// Run the PyTorch version of `spec` (head-group mixing only, `w` dividing `n`),
/// with `spec.threads` threads; returns a measurement with implementation `torch`.
pub fn run(python: &Path, spec: &CaseSpec, runs: usize, git: &str) -> Result<Measurement> {
    let script = script_for(spec)
        .ok_or_else(|| AttnError::InvalidArgument(format!("no PyTorch script for case {}", spec.kind.as_str())))?;
    if spec.mixing != Mixing::HeadGroups || spec.segments.iter().any(|&w| !spec.seq_len.is_multiple_of(w)) {
        return Err(AttnError::InvalidArgument("the PyTorch script needs head_groups and w | n".into()));
    }
    let join = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let mut cmd = Command::new(python);
    cmd.arg(&script)
        .args(["--batch", &spec.batch.to_string(), "--seq-len", &spec.seq_len.to_string()])
        .args(["--heads", &spec.heads.to_string(), "--head-dim", &spec.head_dim.to_string()])
        .args(["--segments", &join(&spec.segments), "--dilations", &join(&spec.dilations)])
        .args(["--dtype", spec.dtype.as_str(), "--runs", &runs.to_string()])
        .env("OMP_NUM_THREADS", spec.threads.to_string());
    if spec.causal {
        cmd.arg("--causal");
    }
    if spec.backward {
        cmd.arg("--backward");
    }
    let out = cmd.output().map_err(|e| AttnError::InvalidArgument(format!("{}: {e}", python.display())))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: String = err.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
        return Err(AttnError::InvalidArgument(format!("{} failed: {tail}", script.display())));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find(|l| l.trim_start().starts_with('{')).unwrap_or_default();
    let t: TorchLine = serde_json::from_str(line).map_err(|e| AttnError::Format(format!("torch output: {e}")))?;
    let mut spec = spec.clone();
    spec.implementation = Implementation::Torch;
    let mut m = Measurement::not_run(spec, "ok".into(), git);
    m.status = format!("ok ({}; memory not measured)", t.torch);
    m.runs = runs;
    m.median_ms = t.median_ms;
    m.gflop_per_s = t.gflop_per_s;
    m.tokens_per_s = t.tokens_per_s;
    Ok(m)
}
