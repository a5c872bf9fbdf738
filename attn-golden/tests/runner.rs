//! The runner's contract: a closing `N passed, M failed` line, non-zero exit on any
//! failure or an empty directory, and a per-case error (not a crash) for a malformed file.

use std::path::PathBuf;
use std::process::Command;

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/golden")
}

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_attn-golden")).args(args).output().expect("runner starts");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("attn-golden-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn every_golden_file_passes_on_reference_and_cpu() {
    for backend in ["reference", "cpu"] {
        for kind in ["dilated", "multihead"] {
            let dir = golden().join(kind);
            let (ok, out) = run(&[dir.to_str().unwrap(), "--backend", backend]);
            assert!(ok, "{backend} {kind}:\n{out}");
            assert!(out.lines().last().unwrap().ends_with(" passed, 0 failed"), "{out}");
        }
    }
}

#[test]
fn ring_strategies_pass_at_world_sizes_one_to_eight() {
    let dir = golden().join("dilated");
    for world in 1..=8 {
        for (strategy, layout) in [("ring", "zigzag"), ("allgather", "contiguous"), ("auto", "zigzag")] {
            let w = world.to_string();
            let (ok, out) = run(&[
                dir.to_str().unwrap(),
                "--backend",
                "ring",
                "--world-size",
                &w,
                "--strategy",
                strategy,
                "--layout",
                layout,
            ]);
            assert!(ok && out.contains("9 passed, 0 failed"), "p={world} {strategy} {layout}:\n{out}");
        }
    }
}

#[test]
fn malformed_file_fails_its_case_and_the_run() {
    let d = scratch("bad");
    let good = std::fs::read(golden().join("dilated/hg_basic.safetensors")).unwrap();
    std::fs::write(d.join("a_good.safetensors"), &good).unwrap();
    std::fs::write(d.join("b_truncated.safetensors"), &good[..good.len() / 2]).unwrap();
    let (ok, out) = run(&[d.to_str().unwrap()]);
    assert!(!ok);
    assert!(out.contains("FAIL b_truncated"), "{out}");
    assert!(out.lines().last().unwrap() == "1 passed, 1 failed", "{out}");
}

#[test]
fn empty_directory_is_a_failure() {
    let d = scratch("empty");
    let (ok, out) = run(&[d.to_str().unwrap()]);
    assert!(!ok);
    assert!(out.contains("0 passed, 0 failed"));
}

#[test]
fn bad_options_are_rejected() {
    let dir = golden().join("dilated");
    let d = dir.to_str().unwrap();
    for args in [vec![d, "--backend", "nope"], vec![d, "--world-size", "2"], vec![d, "--dtype", "f99"], vec![]] {
        let (ok, _) = run(&args);
        assert!(!ok, "{args:?} accepted");
    }
}
