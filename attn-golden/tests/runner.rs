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

/// `src` with tensor `name`'s f32 values changed by `edit` (everything else kept).
fn rewrite_tensor(src: &[u8], name: &str, edit: impl Fn(&mut [f32])) -> Vec<u8> {
    use safetensors::SafeTensors;
    use safetensors::tensor::TensorView;
    let st = SafeTensors::deserialize(src).unwrap();
    let (_, header) = SafeTensors::read_metadata(src).unwrap();
    let t = st.tensor(name).unwrap();
    let mut vals: Vec<f32> = t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    edit(&mut vals);
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let edited = TensorView::new(t.dtype(), t.shape().to_vec(), &bytes).unwrap();
    let views = st.tensors().into_iter().map(|(n, v)| if n == name { (n, edited.clone()) } else { (n, v) });
    safetensors::serialize(views, header.metadata().clone()).unwrap()
}

/// The cross-attention and layer-gradient directories at their fixed counts: every case
/// passes on the reference and the CPU; the ring passes the self-attention cases and
/// refuses the cross-attention ones (keys of their own length) as unsupported, a count
/// the run must be told (`--expect-refused`), or it fails.
#[test]
fn wide_and_multihead_grad_pass_at_their_counts_and_the_ring_refuses_the_cross_files() {
    for (dir, count, refused) in [("wide", "5", "2"), ("multihead_grad", "3", "1")] {
        let dir = golden().join(dir);
        let d = dir.to_str().unwrap();
        for backend in ["reference", "cpu"] {
            let (code, out) = run_status(&[d, "--backend", backend, "--expect", count]);
            assert_eq!(code, Some(0), "{backend} {d}:\n{out}");
            assert!(out.ends_with(&format!("{count} passed, 0 failed\n")), "{out}");
        }
        let ring = [d, "--backend", "ring", "--world-size", "3", "--layout", "zigzag", "--expect", count];
        let (code, out) = run_status(&[&ring[..], &["--expect-refused", refused]].concat());
        assert_eq!(code, Some(0), "ring {d}:\n{out}");
        let passed = count.parse::<usize>().unwrap() - refused.parse::<usize>().unwrap();
        assert!(out.ends_with(&format!("{passed} passed, 0 failed, {refused} refused\n")), "{out}");
        assert!(
            out.lines().filter(|l| l.starts_with("REFUSED cross") || l.starts_with("REFUSED mhg_cross")).count() > 0
        );
        assert!(out.contains("ring does not support cross-attention with kv_seq != q_seq"), "{out}");
        // A refusal nobody expected fails the run.
        let (code, out) = run_status(&ring);
        assert_eq!(code, Some(1), "unexpected refusals pass:\n{out}");
    }
}

/// One file of `dir` rewritten by `edit` alone in a scratch directory: the runner's exit
/// status and output on `backend`.
fn run_planted(dir: &str, file: &str, edit: impl Fn(&[u8]) -> Vec<u8>, backend: &str) -> (Option<i32>, String) {
    run_planted_with(dir, file, edit, &["--backend", backend])
}

/// [`run_planted`] with the runner's options `args`.
fn run_planted_with(dir: &str, file: &str, edit: impl Fn(&[u8]) -> Vec<u8>, args: &[&str]) -> (Option<i32>, String) {
    let src = std::fs::read(golden().join(dir).join(format!("{file}.safetensors"))).unwrap();
    let tmp = scratch(file);
    std::fs::write(tmp.path().join(format!("{file}.safetensors")), edit(&src)).unwrap();
    run_status(&[&[tmp.path().to_str().unwrap()], args, &["--expect", "1"]].concat())
}

/// The layer in bf16 and f16 (`--backend cpu --dtype`): the multihead files pass at their
/// counts, reported in the dtype, and a layer gradient 10% off in the file (over bf16's
/// whole-tensor bound of 4e-2) fails naming it.
#[test]
fn multihead_files_pass_in_bf16_and_f16_and_a_planted_gradient_fails() {
    let scale = |b: &[u8]| rewrite_tensor(b, "d.v_proj.weight", |x| x.iter_mut().for_each(|v| *v *= 1.1));
    for dt in ["bf16", "f16"] {
        for (dir, count) in [("multihead", "2"), ("multihead_features", "1"), ("multihead_grad", "3")] {
            let d = golden().join(dir);
            let (code, out) = run_status(&[d.to_str().unwrap(), "--backend", "cpu", "--dtype", dt, "--expect", count]);
            assert_eq!(code, Some(0), "{dt} {dir}:\n{out}");
            assert!(out.contains(&format!("[multihead cpu {dt}]")), "{out}");
            assert!(out.ends_with(&format!("{count} passed, 0 failed\n")), "{out}");
        }
        let (code, out) =
            run_planted_with("multihead_grad", "mhg_self_ln_hg", scale, &["--backend", "cpu", "--dtype", dt]);
        assert!(code == Some(1) && out.contains(" d.v_proj.weight!="), "{dt}: {out}");
    }
}

/// Planted errors in the new files fail their case, naming the tensor: a wrong scale, a
/// gradient of the layer off by 1e-4 in one weight (ten times the files' rel_tol), a
/// nonzero key-bias gradient where the definition makes it zero, a missing gradient, a
/// `kv_seq_len` unlike the keys. The untouched files pass (above), so each failure is
/// its edit's.
#[test]
fn planted_errors_in_wide_and_multihead_grad_fail() {
    let meta = |k: &'static str, v: &'static str| move |b: &[u8]| rewrite(b, None, Some((k, v)));
    let (code, out) = run_planted("wide", "cross_longer_keys_hg", meta("scale", "0.3"), "cpu");
    assert!(code == Some(1) && out.contains("FAIL cross_longer_keys_hg") && out.contains(" out!="), "{out}");
    let (code, out) = run_planted("wide", "d64_hg", meta("kv_seq_len", "95"), "reference");
    assert!(code == Some(1) && out.contains("kv_seq_len = 95 but the keys have 96"), "{out}");
    // Off by a relative 1e-4 in the L2 norm of the whole tensor.
    let scale_all = |b: &[u8]| rewrite_tensor(b, "d.v_proj.weight", |x| x.iter_mut().for_each(|v| *v *= 1.0 + 1e-4));
    for backend in ["reference", "cpu", "ring"] {
        let (code, out) = run_planted("multihead_grad", "mhg_self_ln_hg", scale_all, backend);
        assert!(code == Some(1) && out.contains(" d.v_proj.weight!="), "{backend}: {out}");
    }
    let (code, out) =
        run_planted("multihead_grad", "mhg_cross_len", |b| rewrite_tensor(b, "d_key", |x| x[7] += 0.05), "cpu");
    assert!(code == Some(1) && out.contains(" d_key!="), "{out}");
    // The key bias's gradient is zero by the definition; one entry of 1e-2 must show.
    let bias = |b: &[u8]| rewrite_tensor(b, "d.k_proj.bias", |x| x[0] = 1e-2);
    let (code, out) = run_planted("multihead_grad", "mhg_self_longnet_causal", bias, "cpu");
    assert!(code == Some(1) && out.contains(" d.k_proj.bias!="), "{out}");
    let no_grad = |b: &[u8]| rewrite(b, Some("d.norm.weight"), None);
    let (code, out) = run_planted("multihead_grad", "mhg_self_ln_hg", no_grad, "reference");
    assert!(code == Some(1) && out.contains("missing tensor `d.norm.weight`"), "{out}");
}

/// The qk-LN files (`multihead_qkln/`) pass through the runner on the reference and the
/// CPU layer in f32, bf16 and f16; planted, `k_ln.weight` 10% off fails the output, and the
/// metadata `norm_layout = sub_ln` fails naming the tensor that layout lacks.
#[test]
fn qkln_files_pass_and_planted_errors_fail() {
    let d = golden().join("multihead_qkln");
    for args in [
        &["--backend", "reference"][..],
        &["--backend", "cpu", "--dtype", "f32"],
        &["--backend", "cpu", "--dtype", "bf16"],
        &["--backend", "cpu", "--dtype", "f16"],
    ] {
        let (code, out) = run_status(&[&[d.to_str().unwrap()], args, &["--expect", "2"]].concat());
        assert!(code == Some(0) && out.ends_with("2 passed, 0 failed\n"), "{args:?}:\n{out}");
    }
    let scale = |b: &[u8]| rewrite_tensor(b, "k_ln.weight", |x| x.iter_mut().for_each(|v| *v *= 1.1));
    let (code, out) = run_planted("multihead_qkln", "mhq_self", scale, "cpu");
    assert!(code == Some(1) && out.contains("FAIL mhq_self") && out.contains(" out!="), "{out}");
    let sub_ln = |b: &[u8]| rewrite(b, None, Some(("norm_layout", "sub_ln")));
    let (code, out) = run_planted("multihead_qkln", "mhq_causal", sub_ln, "reference");
    assert!(code == Some(1) && out.contains("missing tensor `norm.weight`"), "{out}");
}
