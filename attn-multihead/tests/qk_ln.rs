//! The qk-LN layout (`NormLayout::QkLn`, the development line's layer): the
//! `conformance/multihead_qkln/` files through the layer in f64 and f32 on the reference
//! and the CPU kernels (whole, in segment windows, cross-attention entry), its
//! parameter names, and a sub-LN layer refusing such a file by name.

use std::collections::BTreeMap;
use std::sync::Arc;

use attn_core::{Attention, AttnError, DilatedConfig};
use attn_kernels::CpuBackend;
use attn_multihead::LayerNorms;
use attn_multihead::metadata::config_from_metadata;
use attn_multihead::{
    Call, Cross, ExtraTensors, F32Tensors, LayerFloat, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights,
    NamedParams, NormLayout, ReferenceBackend, TensorSource, load_params,
};
use attn_testkit::golden::{GoldenCase, golden_dir, load_dir};
use attn_testkit::tolerance::{max_abs_error, rel_l2_error};

/// The two files of `multihead_qkln/`.
fn cases() -> Vec<GoldenCase> {
    let dir = golden_dir().join("multihead_qkln");
    let cases: Vec<GoldenCase> = load_dir(&dir).unwrap().into_iter().map(|(_, c)| c.unwrap()).collect();
    assert_eq!(cases.len(), 2, "the 2 files in {}", dir.display());
    cases
}

fn source(case: &GoldenCase) -> F32Tensors<'_> {
    let tensors: BTreeMap<String, (&[usize], &[f32])> =
        case.tensors.iter().map(|(k, t)| (k.clone(), (t.shape.as_slice(), t.data.as_slice()))).collect();
    F32Tensors { tensors }
}

/// The file's layer on `backend` (its parameters loaded by their names).
fn layer<F: LayerFloat>(case: &GoldenCase, backend: Arc<dyn Attention<F>>) -> MultiheadDilatedAttention<F> {
    let cfg = config_from_metadata(&case.meta, case.tensors.contains_key("q_proj.bias").into()).unwrap();
    assert_eq!(cfg.norm_layout, NormLayout::QkLn, "{}: the file's norm_layout", case.name);
    let mut weights = MultiheadWeights::<F>::magneto(&cfg, 0);
    load_params(&mut weights, &source(case), ExtraTensors::Ignore).unwrap();
    MultiheadDilatedAttention::from_weights(cfg, weights, backend).unwrap()
}

fn query<F: LayerFloat>(case: &GoldenCase) -> (Vec<F>, [usize; 2]) {
    let (shape, x) = source(case).read_tensor::<F>("query").unwrap();
    (x, [shape[0], shape[1]])
}

/// `got` against the file's `out` within its `rel_tol`; returns the error.
fn judge<F: LayerFloat>(case: &GoldenCase, got: &[F], what: &str) -> f64 {
    let want = &case.tensor("out").unwrap().data;
    let err = rel_l2_error(got, want);
    let bound = case.rel_tol().unwrap();
    assert!(err <= bound, "{} {what}: rel_l2 {err:.2e} > {bound:.0e}", case.name);
    err
}

fn run_files<F: LayerFloat>(backend: Arc<dyn Attention<F>>, what: &str) {
    for case in cases() {
        let layer = layer::<F>(&case, backend.clone());
        let (x, [b, n]) = query::<F>(&case);
        let err = judge(&case, &layer.forward(&x, &Call::new(b, n)).unwrap(), what);
        // The training forward (every row kept) computes the same function.
        judge(&case, &layer.forward_train(&x, &Call::new(b, n)).unwrap().0, what);
        eprintln!("{} [{what}] rel_l2 {err:.2e}", case.name);
    }
}

#[test]
fn qkln_files_pass_on_the_reference_in_f64_and_f32() {
    run_files::<f64>(Arc::new(ReferenceBackend), "reference f64");
    run_files::<f32>(Arc::new(ReferenceBackend), "reference f32");
}

#[test]
fn qkln_files_pass_on_the_cpu_kernels() {
    run_files::<f32>(Arc::new(CpuBackend::new(2).unwrap()), "cpu f32");
    run_files::<f64>(Arc::new(CpuBackend::new(2).unwrap()), "cpu f64");
}

/// The cross-attention entry with key = value = query computes the non-causal file's
/// function (q_ln and k_ln on the split q and k/v buffers).
#[test]
fn the_cross_attention_entry_passes_the_self_attention_file() {
    for case in cases().iter().filter(|c| !c.bool_meta("causal").unwrap()) {
        let layer = layer::<f32>(case, Arc::new(CpuBackend::new(2).unwrap()));
        let (x, [b, n]) = query::<f32>(case);
        let cross = Call::new(b, n).cross(Cross::new(&x, &x, n));
        judge(case, &layer.forward(&x, &cross).unwrap(), "cross entry");
        judge(case, &layer.forward_train(&x, &cross).unwrap().0, "cross entry, training forward");
    }
}

/// Inference and the backward in segment windows (3 windows of 8 rows) equal one pass
/// over the sequence: the norms are per row, so they commute with the windows.
#[test]
fn qkln_in_segment_windows_equals_one_pass() {
    let cfg = MultiheadConfig::new(16, 4, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap())
        .with_num_kv_heads(2)
        .with_norm_layout(NormLayout::QkLn);
    let mut one =
        MultiheadDilatedAttention::<f64>::new(cfg, 5, Arc::new(ReferenceBackend)).unwrap().with_window_rows(0);
    for p in one.weights.params_mut() {
        p.data.iter_mut().enumerate().for_each(|(i, x)| *x += 0.1 * ((i * 7 + p.name.len()) as f64).sin());
    }
    let windowed = one.clone().with_window_rows(8);
    let (b, n) = (2, 24);
    let x: Vec<f64> = (0..b * n * 16).map(|i| (i as f64 * 0.37).sin()).collect();
    let g: Vec<f64> = (0..b * n * 16).map(|i| (i as f64 * 0.11).cos()).collect();
    // Absolute, on the scale of the tensor or 1: `k_ln.bias`'s gradient is zero by the
    // definition (a bias added to every key shifts a query's scores by one constant), so
    // both passes hold roundoff there.
    let close = |a: &[f64], w: &[f64], what: &str| {
        let scale = w.iter().fold(1.0f64, |m, x| m.max(x.abs()));
        let err = max_abs_error(a, w);
        assert!(err <= 1e-12 * scale, "{what}: {err:.2e} at scale {scale:.2e}");
    };
    let call = Call::new(b, n);
    close(&windowed.forward(&x, &call).unwrap(), &one.forward(&x, &call).unwrap(), "forward");
    let (_, cache) = one.forward_train(&x, &call).unwrap();
    let (mut g_one, mut g_win) = (one.zero_grads(), one.zero_grads());
    let dx_one = one.backward(&cache, &g, &mut g_one).unwrap().query;
    let dx_win = windowed.backward(&cache, &g, &mut g_win).unwrap().query;
    close(&dx_win, &dx_one, "d query");
    for (w, o) in g_win.params().iter().zip(g_one.params()) {
        close(w.data, o.data, &w.name);
    }
}

/// Planted errors each fail the judge: `k_ln` with one weight off by 0.1, and `q_ln`'s
/// second use (over the merged heads) left out by a sub-LN-free layer of the same
/// weights (q and k still normalised: `k_ln` alone is not the layer).
#[test]
fn planted_errors_fail_the_qkln_files() {
    for case in cases() {
        let base = layer::<f64>(&case, Arc::new(ReferenceBackend));
        let (x, [b, n]) = query::<f64>(&case);
        let want = &case.tensor("out").unwrap().data;
        let bound = case.rel_tol().unwrap();
        let mut off = base.weights.clone();
        off.k_ln.as_mut().unwrap().weight[3] += 0.1;
        let planted = MultiheadDilatedAttention::from_weights(base.config().clone(), off, base.backend().clone());
        let err = rel_l2_error(&planted.unwrap().forward(&x, &Call::new(b, n)).unwrap(), want);
        assert!(err > bound, "{}: a k_ln weight off by 0.1 passed ({err:.2e})", case.name);
        // The published layout on the same q_ln weights: normalises only the merged heads.
        let mut sub = base.weights.clone();
        sub.k_ln = None;
        sub.norm_layout = NormLayout::SubLn;
        let cfg = base.config().clone().with_norm_layout(NormLayout::SubLn);
        let sub_ln = MultiheadDilatedAttention::from_weights(cfg, sub, base.backend().clone()).unwrap();
        let err = rel_l2_error(&sub_ln.forward(&x, &Call::new(b, n)).unwrap(), want);
        assert!(err > bound, "{}: the sub-LN layout passed a qk-LN file ({err:.2e})", case.name);
    }
}

#[test]
fn qkln_parameters_have_the_development_lines_names() {
    let cfg = MultiheadConfig::new(16, 4, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap())
        .with_num_kv_heads(2)
        .with_norm_layout(NormLayout::QkLn);
    let w = MultiheadWeights::<f32>::magneto(&cfg, 3);
    let got: Vec<(String, Vec<usize>)> = w.params().into_iter().map(|p| (p.name, p.shape)).collect();
    let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
    assert!(!names.iter().any(|n| n.starts_with("norm.")), "{names:?}");
    for (name, shape) in
        [("q_ln.weight", vec![16]), ("q_ln.bias", vec![16]), ("k_ln.weight", vec![8]), ("k_ln.bias", vec![8])]
    {
        assert!(got.contains(&(name.to_string(), shape.clone())), "{name} {shape:?} in {got:?}");
    }
    assert!(w.params().iter().filter(|p| p.name.ends_with("_ln.weight")).all(|p| p.data.iter().all(|&x| x == 1.0)));
    // Without layer_norm there are no norms in either layout.
    let plain = MultiheadWeights::<f32>::magneto(&cfg.clone().with_layer_norm(LayerNorms::Absent), 3);
    assert!(plain.params().iter().all(|p| !p.name.contains("ln.") && !p.name.starts_with("norm.")));
}

/// A file of one layout does not load into a layer of the other: the missing tensor is
/// named (never a silent mix of layouts).
#[test]
fn a_layout_mismatch_is_a_named_error() {
    let case = &cases()[0];
    let cfg = config_from_metadata(&case.meta, case.tensors.contains_key("q_proj.bias").into()).unwrap();
    let mut sub = MultiheadWeights::<f32>::magneto(&cfg.clone().with_norm_layout(NormLayout::SubLn), 0);
    let err = load_params(&mut sub, &source(case), ExtraTensors::Reject).unwrap_err();
    assert!(matches!(&err, AttnError::Format(m) if m.contains("norm.weight")), "{err}");
    // Weights of one layout under a config of the other: refused by the layer.
    let err = MultiheadDilatedAttention::from_weights(cfg, sub, Arc::new(ReferenceBackend)).unwrap_err();
    assert!(err.to_string().contains("norm_layout"), "{err}");
    let mut bad = BTreeMap::new();
    bad.extend(case.meta.clone());
    bad.insert("norm_layout".to_string(), "post_ln".to_string());
    let err = config_from_metadata(&bad, true.into()).unwrap_err();
    assert!(err.to_string().contains("post_ln"), "{err}");
}
