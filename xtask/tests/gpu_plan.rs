//! `cargo xtask test --plan` with a stand-in `nvidia-smi` first on the path: where it lists
//! a GPU, the golden runner is built with the CUDA backend, CUDA golden runs are planned
//! and every GPU step runs with `ATTN_REQUIRE_GPU=1`; where it lists none, none of that.

use std::path::Path;
use std::process::Command;

/// A directory holding an executable `nvidia-smi` with `body` as its shell script, removed
/// when the guard drops.
fn stand_in(body: &str) -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("nvidia-smi");
    std::fs::write(&exe, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// The plan printed by `xtask test --plan --only GROUP` with `dir` first on the path.
fn plan(dir: &Path, group: &str) -> String {
    let path = std::env::join_paths(
        std::iter::once(dir.to_path_buf()).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["test", "--plan", "--only", group])
        .env("PATH", path)
        .output()
        .expect("xtask starts");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_listed_gpu_builds_cuda_and_forbids_skips() {
    let gpu_dir = stand_in("echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-stand-in)'");
    let gpu = gpu_dir.path();
    let golden = plan(gpu, "golden");
    assert!(
        golden.contains("build --release --bin attn-golden --features attn-golden/candle,attn-golden/cuda"),
        "{golden}"
    );
    for dt in ["f32", "bf16", "f16"] {
        let run = golden.lines().find(|l| l.contains(&format!("--backend cuda --dtype {dt} --expect 9")));
        assert!(run.is_some_and(|l| l.starts_with("plan: ATTN_REQUIRE_GPU=1 ")), "cuda {dt}:\n{golden}");
    }
    let kernels = plan(gpu, "gpu");
    assert!(
        kernels.contains("ATTN_REQUIRE_GPU=1 ") && kernels.contains("test -p attn-kernels --features cuda"),
        "{kernels}"
    );
    let nccl = plan(gpu, "nccl");
    assert!(nccl.contains("ATTN_REQUIRE_GPU=1 ") && nccl.contains("test -p attn-ring --features nccl"), "{nccl}");
}

#[test]
fn no_listed_gpu_plans_no_cuda_run() {
    let none_dir = stand_in("echo 'NVIDIA-SMI has failed' >&2; exit 9");
    let none = none_dir.path();
    let golden = plan(none, "golden");
    assert!(golden.contains("build --release --bin attn-golden --features attn-golden/candle\n"), "{golden}");
    assert!(!golden.contains("cuda") && !golden.contains("ATTN_REQUIRE_GPU"), "{golden}");
    assert!(plan(none, "gpu").contains("SKIP"), "the GPU step is skipped, and says so");
    assert!(!plan(none, "nccl").contains("ATTN_REQUIRE_GPU"));
}
