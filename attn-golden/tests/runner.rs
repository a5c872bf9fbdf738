//! The runner's contract: a closing `N passed, M failed` line, non-zero exit on any
//! failure or an empty directory, and a per-case error (not a crash) for a malformed file.

use std::path::PathBuf;
use std::process::Command;

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../conformance")
}

fn run(args: &[&str]) -> (bool, String) {
    let (code, out) = run_status(args);
    (code == Some(0), out)
}

/// The runner's exit status and stdout.
fn run_status(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_attn-golden")).args(args).output().expect("runner starts");
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `src` rewritten without tensor `drop` (metadata and every other tensor kept), or with
/// the metadata entry `key` set to `value`.
fn rewrite(src: &[u8], drop: Option<&str>, meta: Option<(&str, &str)>) -> Vec<u8> {
    use safetensors::SafeTensors;
    let st = SafeTensors::deserialize(src).unwrap();
    let (_, header) = SafeTensors::read_metadata(src).unwrap();
    let mut md = header.metadata().clone().unwrap_or_default();
    if let Some((k, v)) = meta {
        md.insert(k.to_string(), v.to_string());
    }
    let views: Vec<_> = st.tensors().into_iter().filter(|(n, _)| Some(n.as_str()) != drop).collect();
    safetensors::serialize(views, Some(md)).unwrap()
}

/// An empty directory, removed when the returned guard drops (also when an assertion fails).
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("attn-golden-{name}-")).tempdir().unwrap()
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

/// The runner's ring options reach the ring (the full matrix of world sizes, strategies
/// and layouts runs in attn-ring's `golden_ring` test).
#[test]
fn ring_options_reach_the_ring() {
    let dir = golden().join("dilated");
    for (world, strategy, layout) in
        [("1", "auto", "contiguous"), ("5", "ring", "zigzag"), ("8", "allgather", "zigzag")]
    {
        let args = [dir.to_str().unwrap(), "--backend", "ring", "--world-size", world, "--strategy", strategy];
        let (ok, out) = run(&[&args[..], &["--layout", layout, "--expect", "9"]].concat());
        assert!(ok && out.contains(&format!("[ring p={world} {strategy} {layout}]")), "p={world}:\n{out}");
        assert!(out.ends_with("9 passed, 0 failed\n"), "{out}");
    }
}

#[test]
fn malformed_file_fails_its_case_and_the_run() {
    let tmp = scratch("bad");
    let d = tmp.path();
    let good = std::fs::read(golden().join("dilated/hg_basic.safetensors")).unwrap();
    std::fs::write(d.join("a_good.safetensors"), &good).unwrap();
    std::fs::write(d.join("b_truncated.safetensors"), &good[..good.len() / 2]).unwrap();
    let (ok, out) = run(&[d.to_str().unwrap()]);
    assert!(!ok);
    assert!(out.contains("FAIL b_truncated"), "{out}");
    assert!(out.lines().last().unwrap() == "1 passed, 1 failed", "{out}");
}

#[test]
fn expect_fixes_the_case_count() {
    let dir = golden().join("dilated");
    let d = dir.to_str().unwrap();
    assert_eq!(run_status(&[d, "--expect", "9"]).0, Some(0));
    let (code, out) = run_status(&[d, "--expect", "10"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.ends_with("9 passed, 0 failed\n"), "every case still runs: {out}");
    // One file removed: 8 of 9 pass, and the count fails the run.
    let tmp = scratch("expect");
    let s = tmp.path();
    for f in
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| !p.ends_with("hg_dense.safetensors"))
    {
        std::fs::copy(&f, s.join(f.file_name().unwrap())).unwrap();
    }
    let (code, out) = run_status(&[s.to_str().unwrap(), "--expect", "9"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.ends_with("8 passed, 0 failed\n"), "{out}");
}

#[test]
fn a_missing_required_tensor_or_a_lax_rel_tol_fails_the_case() {
    let ln = std::fs::read(golden().join("dilated/ln_basic.safetensors")).unwrap();
    let hg = std::fs::read(golden().join("dilated/hg_basic.safetensors")).unwrap();
    for (label, bytes, want) in [
        ("no_lse", rewrite(&ln, Some("lse"), None), "missing tensor `lse`"),
        ("no_grad_out", rewrite(&hg, Some("grad_out"), None), "missing tensor `grad_out`"),
        ("no_dk", rewrite(&hg, Some("dk"), None), "missing tensor `dk`"),
        ("lax_tol", rewrite(&hg, None, Some(("rel_tol", "0.5"))), "looser than the cap"),
    ] {
        let tmp = scratch(label);
        let d = tmp.path();
        std::fs::write(d.join(format!("{label}.safetensors")), bytes).unwrap();
        let (code, out) = run_status(&[d.to_str().unwrap(), "--backend", "cpu"]);
        assert_eq!(code, Some(1), "{label}: {out}");
        assert!(out.contains(&format!("FAIL {label}")) && out.contains(want), "{label}: {out}");
    }
    // The untouched file passes, so the failures above are the edits'.
    let tmp = scratch("untouched");
    let d = tmp.path();
    std::fs::write(d.join("ln.safetensors"), rewrite(&ln, None, None)).unwrap();
    assert_eq!(run_status(&[d.to_str().unwrap()]).0, Some(0));
}

#[test]
fn a_backend_that_cannot_run_has_its_own_exit_status() {
    let dir = golden().join("dilated");
    let (code, _) = run_status(&[dir.to_str().unwrap(), "--backend", "cuda"]);
    // Without the feature: not compiled (4); with it but without a GPU: unavailable (3).
    let expected = if cfg!(feature = "cuda") { [3, 0] } else { [4, 4] };
    assert!(code.is_some_and(|c| expected.contains(&c)), "exit status {code:?}");
}

#[test]
fn empty_directory_is_a_failure() {
    let tmp = scratch("empty");
    let d = tmp.path();
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
