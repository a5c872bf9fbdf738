//! `cargo xtask bench`: build and run the `attn-bench` binary (release) with the given arguments.
//!
//! `--cuda` builds it with the `cuda` feature (CUDA rows in the implementation
//! comparison; cudarc loads the driver at run time, so no CUDA toolkit is needed to
//! build), `--no-cuda` without; with neither, the feature is on when `nvidia-smi -L`
//! lists a GPU. Every other argument goes to `attn-bench`.

use std::process::Command;

use crate::test_suite::gpu_present;
use crate::workspace::{cargo, repo_root};

/// Split the xtask-only flags off: `(cuda feature wanted, attn-bench arguments)`.
fn split_args(args: &[String], gpu: impl FnOnce() -> bool) -> (bool, Vec<String>) {
    let mut cuda = None;
    let mut rest = Vec::new();
    for a in args {
        match a.as_str() {
            "--cuda" => cuda = Some(true),
            "--no-cuda" => cuda = Some(false),
            _ => rest.push(a.clone()),
        }
    }
    (cuda.unwrap_or_else(gpu), rest)
}

/// Run `attn-bench ARGS` through `cargo run --release` (with `--features cuda` when asked).
pub fn run(args: &[String]) -> Result<(), String> {
    let (cuda, rest) = split_args(args, || gpu_present().is_some());
    let mut cmd = Command::new(cargo());
    cmd.current_dir(repo_root()).args([
        "run",
        "--quiet",
        "--release",
        "--package",
        "attn-bench",
        "--bin",
        "attn-bench",
    ]);
    if cuda {
        eprintln!("xtask bench: building attn-bench with the `cuda` feature");
        cmd.args(["--features", "cuda"]);
    }
    let status = cmd.arg("--").args(rest).status().map_err(|e| format!("could not start cargo: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("attn-bench exited with {status}")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn cuda_flags_are_consumed_and_default_to_gpu_presence() {
        assert_eq!(split_args(&args("--quick --cuda"), || false), (true, args("--quick")));
        assert_eq!(split_args(&args("--no-cuda --full"), || true), (false, args("--full")));
        assert_eq!(split_args(&args("--quick"), || true), (true, args("--quick")));
        assert_eq!(split_args(&args("--quick"), || false), (false, args("--quick")));
    }
}
