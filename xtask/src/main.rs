//! `cargo xtask`: the project's task runner, a thin dispatcher.
//!
//! - `cargo xtask bench [--cuda|--no-cuda] [ARGS]`: the benchmark report (runs the
//!   `attn-bench` binary in release mode, with the `cuda` feature when asked or when a
//!   GPU is listed; see `cargo xtask bench --help`).
//! - `cargo xtask test [--skip-golden] [--only GROUP]`: fmt, clippy, every test, the golden runner for
//!   each available backend and strategy, MPI, NCCL (stand-in libraries) and GPU tests, `ptx --emulate`, fuzzing and
//!   valgrind where their tools exist (SKIP with the reason otherwise).
//! - `cargo xtask tidy [--upstream-golden DIR]`: module docs, file length, no
//!   todo!/unimplemented!/dbg!, `// SAFETY:` above every `unsafe` block, no work-history
//!   wording, one integration test binary a crate, and with DIR, `conformance/` holding
//!   every file of that upstream golden folder.
//! - `cargo xtask ptx [ARGS]`: NVRTC + ptxas check of the CUDA kernels.
#![forbid(unsafe_code)]

mod bench;
mod file_circles;
mod ptx;
mod test_suite;
mod test_targets;
mod tidy;
mod vectors;
mod workspace;

use std::process::ExitCode;

const USAGE: &str = "usage: cargo xtask <bench|test|tidy|ptx> [ARGS]
  bench [--quick|--full] [--cuda|--no-cuda] [--torch PYTHON] [--baseline results.json] [--budget 8GiB] [--out DIR] [--json ...]
  test  [--skip-golden] [--plan] [--only fmt|clippy|tests|tidy|golden|mpi|nccl|gpu|ptx|fuzz|valgrind|bench]
  tidy  [--upstream-golden DIR]
  ptx   [--emulate] [--arch 80,90] [--out DIR]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let result = match cmd.as_str() {
        "bench" => bench::run(rest),
        "test" => test_suite::run(rest),
        "tidy" => tidy::run(rest),
        "ptx" => ptx::run(rest),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown command `{other}`\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask {cmd}: {e}");
            ExitCode::FAILURE
        }
    }
}
