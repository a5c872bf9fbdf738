//! `cargo xtask bench`: build and run the `attn-bench` binary (release) with the given arguments.

use std::process::Command;

use crate::{cargo, repo_root};

/// Run `attn-bench ARGS` through `cargo run --release`.
pub fn run(args: &[String]) -> Result<(), String> {
    let status = Command::new(cargo())
        .current_dir(repo_root())
        .args(["run", "--quiet", "--release", "--package", "attn-bench", "--bin", "attn-bench", "--"])
        .args(args)
        .status()
        .map_err(|e| format!("could not start cargo: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("attn-bench exited with {status}")) }
}
