//! `cargo xtask test`: the whole suite, in order, with a summary of what passed,
//! failed, or was skipped and why (fmt, clippy, tests, tidy, golden runner per
//! backend and strategy as `.ci/run` runs it, MPI ranks under `mpirun`, GPU tests, the
//! CUDA emulation and PTX check, fuzzing, valgrind, a bench smoke run).
//!
//! When `nvidia-smi -L` lists a GPU, the golden runner is built with `--features cuda`
//! and the GPU steps run with `ATTN_REQUIRE_GPU=1`: a CUDA backend that is not compiled
//! in or cannot open the GPU (the runner's exit statuses 4 and 3) is a failure, never a
//! skip. `--plan` prints the commands without running them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::workspace::{cargo, repo_root};
use crate::{ptx, tidy};

enum Outcome {
    Passed,
    Failed(String),
    Skipped(String),
}

struct Step {
    name: String,
    outcome: Outcome,
    secs: f64,
}

/// Whether commands run, or are only printed (`--plan`).
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Run,
    Plan,
}

/// The variable that turns GPU skips into failures (read by the GPU tests).
const REQUIRE_GPU: &str = "ATTN_REQUIRE_GPU";

/// The runner's exit statuses for a backend that cannot run (see `attn-golden --help`).
const GOLDEN_UNAVAILABLE: i32 = 3;
const GOLDEN_NOT_COMPILED: i32 = 4;

/// A command as a line: its environment changes, program and arguments.
fn describe(cmd: &Command) -> String {
    let env = cmd.get_envs().filter_map(|(k, v)| Some(format!("{}={} ", k.to_string_lossy(), v?.to_string_lossy())));
    let args = std::iter::once(cmd.get_program()).chain(cmd.get_args()).map(|a| a.to_string_lossy().into_owned());
    env.collect::<String>() + &args.collect::<Vec<_>>().join(" ")
}

/// Run a command with inherited output; Ok if it exits with success.
fn run_cmd(mode: Mode, cmd: &mut Command) -> Result<(), String> {
    if mode == Mode::Plan {
        println!("plan: {}", describe(cmd));
        return Ok(());
    }
    let status = cmd.current_dir(repo_root()).status().map_err(|e| format!("could not start: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("exited with {status}")) }
}

/// Run a command capturing output (printed afterwards); returns (exit code, output).
fn run_captured(mode: Mode, cmd: &mut Command) -> (Option<i32>, String) {
    if mode == Mode::Plan {
        return (Some(0), format!("plan: {}\n", describe(cmd)));
    }
    match cmd.current_dir(repo_root()).stdin(Stdio::null()).output() {
        Ok(o) => {
            let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
            (o.status.code(), text)
        }
        Err(e) => (None, format!("could not start: {e}")),
    }
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// A GPU is present when `nvidia-smi -L` lists one.
pub(crate) fn gpu_present() -> Option<String> {
    let o = Command::new("nvidia-smi").arg("-L").output().ok()?;
    let s = String::from_utf8_lossy(&o.stdout).to_string();
    (o.status.success() && s.contains("GPU")).then(|| s.lines().next().unwrap_or_default().to_string())
}

fn golden_root() -> PathBuf {
    std::env::var_os("ATTN_GOLDEN_DIR").map_or_else(|| repo_root().join("conformance"), PathBuf::from)
}

/// The outcome of one golden run from the runner's exit status. Only CUDA runs can meet
/// an unavailable or missing backend, and they are scheduled only where a GPU is listed,
/// so both are failures that say which.
fn golden_outcome(code: Option<i32>, out: &str) -> Outcome {
    let last = out.lines().last().unwrap_or_default().trim().to_string();
    match code {
        Some(0) => Outcome::Passed,
        Some(GOLDEN_UNAVAILABLE) => Outcome::Failed(format!("backend unavailable on a GPU machine: {last}")),
        Some(GOLDEN_NOT_COMPILED) => Outcome::Failed(format!("backend not compiled in: {last}")),
        _ => Outcome::Failed(last),
    }
}

/// `cargo build` arguments of the golden runner: with the candle op, and with the CUDA
/// backend where a GPU is.
fn golden_build_args(gpu: bool) -> Vec<&'static str> {
    let features = if gpu { "attn-golden/candle,attn-golden/cuda" } else { "attn-golden/candle" };
    vec!["build", "--release", "--bin", "attn-golden", "--features", features]
}

/// The number of conformance files in each directory the runs read.
const EXPECTED_CASES: [(&str, &str); 4] =
    [("dilated", "9"), ("features", "9"), ("multihead", "2"), ("multihead_features", "1")];

/// The golden runner configurations: (label, dir, args).
fn golden_runs(gpu: bool) -> Vec<(String, &'static str, Vec<String>)> {
    let mut runs = Vec::new();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    // The multihead layer runs f32 (and f64) only; the attention kernels also bf16 and f16.
    let kernels = &["f32", "bf16", "f16"][..];
    let layer = &["f32"][..];
    for (dir, dtypes) in
        [("dilated", kernels), ("features", kernels), ("multihead", layer), ("multihead_features", layer)]
    {
        runs.push((format!("{dir} reference"), dir, s(&["--backend", "reference"])));
        for dt in dtypes {
            runs.push((format!("{dir} cpu {dt}"), dir, s(&["--backend", "cpu", "--dtype", dt])));
        }
        // The candle op (every dtype) and its candle-nn layer (f32).
        for dt in dtypes {
            runs.push((format!("{dir} candle {dt}"), dir, s(&["--backend", "candle", "--dtype", dt])));
        }
    }
    // The multihead files on P = 1..8 ring ranks, as `.ci/run` runs them (the dilated
    // files through every ring setup run in attn-ring's golden_ring test).
    for p in 1..=8 {
        let ring =
            s(&["--backend", "ring", "--world-size", &p.to_string(), "--strategy", "auto", "--layout", "zigzag"]);
        runs.push((format!("multihead ring P={p} auto zigzag"), "multihead", ring.clone()));
        runs.push((format!("multihead_features ring P={p} auto zigzag"), "multihead_features", ring));
    }
    if gpu {
        for dir in ["dilated", "features"] {
            for dt in ["f32", "bf16", "f16"] {
                runs.push((format!("{dir} cuda {dt}"), dir, s(&["--backend", "cuda", "--dtype", dt])));
            }
        }
    }
    // Each directory's case count is fixed: a file removed or unreadable fails the run.
    for (_, dir, args) in &mut runs {
        let count = EXPECTED_CASES.iter().find(|(d, _)| d == dir).map_or("0", |(_, n)| n);
        args.extend(s(&["--expect", count]));
    }
    runs
}

fn golden_steps(mode: Mode, steps: &mut Vec<Step>, gpu: bool) {
    let root = golden_root();
    if !root.is_dir() {
        steps.push(Step {
            name: "golden".into(),
            outcome: Outcome::Failed(format!("no conformance directory at {}", root.display())),
            secs: 0.0,
        });
        return;
    }
    let t = Instant::now();
    println!("\n=== golden: build: cargo {} ===", golden_build_args(gpu).join(" "));
    if let Err(e) = run_cmd(mode, Command::new(cargo()).args(golden_build_args(gpu))) {
        steps.push(Step { name: "golden: build".into(), outcome: Outcome::Failed(e), secs: t.elapsed().as_secs_f64() });
        return;
    }
    let exe = repo_root().join("target/release/attn-golden");
    for (label, dir, args) in golden_runs(gpu) {
        let t = Instant::now();
        println!("\n=== golden: {label} ===");
        let mut cmd = Command::new(&exe);
        cmd.arg(root.join(dir)).args(&args);
        if gpu {
            cmd.env(REQUIRE_GPU, "1");
        }
        let (code, out) = run_captured(mode, &mut cmd);
        print!("{out}");
        steps.push(Step {
            name: format!("golden: {label}"),
            outcome: golden_outcome(code, &out),
            secs: t.elapsed().as_secs_f64(),
        });
    }
}

/// Path of a test executable from `cargo test --no-run --message-format=json` output.
fn test_executable(json_lines: &str, test_name: &str) -> Option<PathBuf> {
    json_lines.lines().filter(|l| l.contains(&format!("\"name\":\"{test_name}\""))).find_map(|l| {
        let rest = &l[l.find("\"executable\":\"")? + 14..];
        Some(PathBuf::from(&rest[..rest.find('"')?]))
    })
}

/// The executable named `name` that `cargo ARGS --message-format=json` builds (a
/// placeholder in a plan), or why there is none.
fn built_executable(mode: Mode, args: &[&str], name: &str) -> Result<PathBuf, String> {
    let (code, out) = run_captured(mode, Command::new(cargo()).args(args).arg("--message-format=json"));
    match mode {
        Mode::Plan => {
            print!("{out}");
            Ok(PathBuf::from(name.to_uppercase()))
        }
        Mode::Run => test_executable(&out, name)
            .filter(|_| code == Some(0))
            .ok_or_else(|| out.lines().rev().find(|l| !l.starts_with('{')).unwrap_or("no executable").to_string()),
    }
}

/// `mpirun -np NP` of `exe` with `args` as step `name`.
fn mpirun_step(mode: Mode, steps: &mut Vec<Step>, name: String, np: &str, exe: &Path, args: &[&str]) {
    let t = Instant::now();
    println!("\n=== {name} ===");
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", np]).arg(exe).args(args);
    let outcome = run_cmd(mode, &mut cmd).map_or_else(Outcome::Failed, |()| Outcome::Passed);
    steps.push(Step { name, outcome, secs: t.elapsed().as_secs_f64() });
}

/// The MPI test over 2, 3 and 4 processes, then the `ring_mpi` example on the CPU compute
/// over 3, every rank's rows judged on rank 0 against the float64 reference (`--check`).
fn mpi_steps(mode: Mode, steps: &mut Vec<Step>) {
    if !on_path("mpirun") {
        steps.push(skip("mpi", "mpirun not found (apt-get install libopenmpi-dev openmpi-bin libclang-dev)".into()));
        return;
    }
    let t = Instant::now();
    let test = ["test", "-p", "attn-ring", "--features", "mpi", "--test", "mpi_ring", "--no-run"];
    let example = ["build", "--release", "-p", "attn-ring", "--features", "mpi", "--example", "ring_mpi"];
    let built = built_executable(mode, &test, "mpi_ring")
        .and_then(|test| Ok((test, built_executable(mode, &example, "ring_mpi")?)));
    let (test, example) = match built {
        Ok(exes) => exes,
        Err(why) => {
            steps.push(Step {
                name: "mpi: build".into(),
                outcome: Outcome::Failed(why),
                secs: t.elapsed().as_secs_f64(),
            });
            return;
        }
    };
    for np in ["2", "3", "4"] {
        mpirun_step(mode, steps, format!("mpi: mpirun -np {np} mpi_ring"), np, &test, &[]);
    }
    let args = ["--compute", "cpu", "--seq", "4096", "--heads", "4", "--head-dim", "32", "--check"];
    mpirun_step(mode, steps, "mpi: mpirun -np 3 ring_mpi --compute cpu --check".into(), "3", &example, &args);
}

fn skip(name: &str, why: String) -> Step {
    Step { name: name.to_string(), outcome: Outcome::Skipped(why), secs: 0.0 }
}

/// Run `body` as step `name`, or record a SKIP with the reason when a tool is `missing`.
fn tool_step(steps: &mut Vec<Step>, name: &str, missing: Option<String>, body: impl FnOnce() -> Result<(), String>) {
    if let Some(why) = missing {
        steps.push(skip(name, why));
        return;
    }
    println!("\n=== {name} ===");
    let t = Instant::now();
    let outcome = body().map_or_else(Outcome::Failed, |()| Outcome::Passed);
    steps.push(Step { name: name.to_string(), outcome, secs: t.elapsed().as_secs_f64() });
}

/// The reliability scripts: 60 s per fuzz target (cargo-fuzz) and valgrind memcheck.
fn reliability_steps(mode: Mode, steps: &mut Vec<Step>, wants: impl Fn(&str) -> bool) {
    if wants("fuzz") {
        let has_fuzz = run_captured(Mode::Run, Command::new(cargo()).args(["fuzz", "--version"])).0 == Some(0);
        let missing = (!has_fuzz).then(|| "cargo-fuzz not installed (cargo install cargo-fuzz --locked)".to_string());
        tool_step(steps, "fuzz: fuzz/run.sh 60", missing, || {
            run_cmd(mode, Command::new(repo_root().join("fuzz/run.sh")).arg("60"))
        });
    }
    if wants("valgrind") {
        let missing = (!on_path("valgrind")).then(|| "valgrind not installed (apt-get install valgrind)".to_string());
        tool_step(steps, "valgrind: attn-reliability/valgrind.sh", missing, || {
            run_cmd(mode, &mut Command::new(repo_root().join("attn-reliability/valgrind.sh")))
        });
    }
}

/// A cargo command as a step; `require_gpu` sets `ATTN_REQUIRE_GPU=1` for it.
fn cargo_step(mode: Mode, steps: &mut Vec<Step>, name: &str, args: &[&str], require_gpu: GpuSkips) {
    println!("\n=== {name}: cargo {} ===", args.join(" "));
    let t = Instant::now();
    let mut cmd = Command::new(cargo());
    cmd.args(args);
    if require_gpu == GpuSkips::Fail {
        cmd.env(REQUIRE_GPU, "1");
    }
    let outcome = run_cmd(mode, &mut cmd).map_or_else(Outcome::Failed, |()| Outcome::Passed);
    steps.push(Step { name: name.to_string(), outcome, secs: t.elapsed().as_secs_f64() });
}

/// Whether a missing GPU may skip the GPU tests of a step.
#[derive(Clone, Copy, PartialEq)]
enum GpuSkips {
    Allowed,
    Fail,
}

/// The step groups, in order; `--only GROUP` runs one of them.
const GROUPS: [&str; 11] =
    ["fmt", "clippy", "tests", "tidy", "golden", "mpi", "nccl", "gpu", "ptx", "fuzz", "valgrind"];

/// Run everything (or `--only GROUP`); fail if any step failed.
pub fn run(args: &[String]) -> Result<(), String> {
    let (mut skip_golden, mut only, mut mode) = (false, None, Mode::Run);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--skip-golden" => skip_golden = true,
            "--plan" => mode = Mode::Plan,
            "--only" => {
                let g = it.next().ok_or("--only needs a group")?;
                if !GROUPS.contains(&g.as_str()) && g != "bench" {
                    return Err(format!("unknown group `{g}` (one of {}, bench)", GROUPS.join(", ")));
                }
                only = Some(g.clone());
            }
            other => return Err(format!("unknown option `{other}` (test [--skip-golden] [--plan] [--only GROUP])")),
        }
    }
    let wants = |g: &str| only.as_deref().is_none_or(|o| o == g);
    let mut steps = Vec::new();
    let cpu_only = GpuSkips::Allowed;
    if wants("fmt") {
        cargo_step(mode, &mut steps, "fmt", &["fmt", "--all", "--check"], cpu_only);
    }
    if wants("clippy") {
        let args = ["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"];
        cargo_step(mode, &mut steps, "clippy", &args, cpu_only);
    }
    if wants("tests") {
        cargo_step(mode, &mut steps, "tests", &["test", "--workspace"], cpu_only);
    }
    if wants("tidy") {
        tool_step(&mut steps, "tidy", None, || match mode {
            Mode::Plan => {
                println!("plan: cargo xtask tidy");
                Ok(())
            }
            Mode::Run => tidy::run(&[]),
        });
    }
    let gpu = gpu_present();
    let gpu_skips = if gpu.is_some() { GpuSkips::Fail } else { GpuSkips::Allowed };
    if let Some(name) = &gpu {
        println!("\n=== GPU listed: {name}; GPU tests run with {REQUIRE_GPU}=1 ===");
    }
    if wants("golden") {
        if skip_golden {
            steps.push(skip("golden", "--skip-golden".into()));
        } else {
            golden_steps(mode, &mut steps, gpu.is_some());
        }
    }
    if wants("mpi") {
        mpi_steps(mode, &mut steps);
    }
    if wants("nccl") {
        // No GPU needed: the emulated transport, and the real NcclComm against stand-in
        // libcuda/libnccl (a C compiler builds them); on a GPU also the real library.
        let args = ["test", "-p", "attn-ring", "--features", "nccl,cuda"];
        cargo_step(mode, &mut steps, "nccl: attn-ring --features nccl", &args, gpu_skips);
    }
    if wants("gpu") {
        match &gpu {
            Some(_) => {
                let kernels = ["test", "-p", "attn-kernels", "--features", "cuda"];
                cargo_step(mode, &mut steps, "gpu: attn-kernels --features cuda", &kernels, gpu_skips);
            }
            None => steps.push(skip("gpu", "no GPU (nvidia-smi lists none); CUDA/NCCL tests need one".into())),
        }
    }
    if wants("ptx") {
        let emulate = ["--emulate".to_string()];
        tool_step(&mut steps, "ptx --emulate", ptx::missing_default_tools(), || match mode {
            Mode::Plan => {
                println!("plan: cargo xtask ptx --emulate");
                Ok(())
            }
            Mode::Run => ptx::run(&emulate),
        });
    }
    reliability_steps(mode, &mut steps, wants);
    if wants("bench") {
        let smoke = ["run", "--quiet", "--release", "-p", "attn-bench", "--", "--json", "--impl", "reference"];
        let case =
            ["--seq-len", "256", "--heads", "2", "--head-dim", "16", "--segments", "64,128", "--dilations", "1,2"];
        let args: Vec<&str> = smoke.into_iter().chain(case).chain(["--runs", "1"]).collect();
        cargo_step(mode, &mut steps, "bench smoke (--json, reference)", &args, cpu_only);
    }
    summarize(&steps)
}

fn summarize(steps: &[Step]) -> Result<(), String> {
    println!("\n=== summary ===");
    let (mut failed, mut skipped) = (0, 0);
    for s in steps {
        let (tag, why) = match &s.outcome {
            Outcome::Passed => ("PASS", String::new()),
            Outcome::Failed(w) => {
                failed += 1;
                ("FAIL", format!(": {w}"))
            }
            Outcome::Skipped(w) => {
                skipped += 1;
                ("SKIP", format!(": {w}"))
            }
        };
        println!("{tag} {:>6.1}s  {}{why}", s.secs, s.name);
    }
    println!("{} steps: {} passed, {failed} failed, {skipped} skipped", steps.len(), steps.len() - failed - skipped);
    if failed == 0 { Ok(()) } else { Err(format!("{failed} step(s) failed")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_test_executable_in_cargo_json() {
        let out = r#"{"reason":"compiler-artifact","target":{"name":"mpi_ring","kind":["test"]},"executable":"/x/target/debug/deps/mpi_ring-abc"}
{"reason":"compiler-artifact","target":{"name":"other"},"executable":"/x/other"}"#;
        assert_eq!(test_executable(out, "mpi_ring"), Some(PathBuf::from("/x/target/debug/deps/mpi_ring-abc")));
        assert_eq!(test_executable(out, "missing"), None);
    }

    #[test]
    fn golden_plan_covers_every_backend_and_dtype() {
        let runs = golden_runs(false);
        let has = |label: &str| runs.iter().any(|(n, _, _)| n == label);
        for dt in ["f32", "bf16", "f16"] {
            assert!(has(&format!("dilated cpu {dt}")) && has(&format!("features cpu {dt}")), "{dt}");
        }
        for p in 1..=8 {
            assert!(has(&format!("multihead ring P={p} auto zigzag")), "multihead P={p}");
        }
        assert!(has("dilated reference") && has("multihead reference") && has("multihead cpu f32"));
        assert_eq!(runs.iter().filter(|(n, _, _)| n.contains(" ring P=")).count(), 16);
        assert!(runs.iter().all(|(_, _, a)| a.windows(2).any(|w| w[0] == "--expect")), "every run fixes its count");
        assert!(!runs.iter().any(|(n, _, _)| n.contains("cuda")));
        assert!(golden_runs(true).iter().any(|(n, _, _)| n.contains("cuda")));
    }

    #[test]
    fn on_a_gpu_the_runner_is_built_with_cuda_and_an_absent_backend_fails() {
        assert!(golden_build_args(false).ends_with(&["--features", "attn-golden/candle"]));
        assert!(golden_build_args(true).ends_with(&["--features", "attn-golden/candle,attn-golden/cuda"]));
        assert!(matches!(golden_outcome(Some(0), "9 passed, 0 failed"), Outcome::Passed));
        for code in [GOLDEN_UNAVAILABLE, GOLDEN_NOT_COMPILED, 1] {
            assert!(matches!(golden_outcome(Some(code), "x"), Outcome::Failed(_)), "exit {code}");
        }
        assert!(matches!(golden_outcome(None, "killed"), Outcome::Failed(_)));
    }
}
