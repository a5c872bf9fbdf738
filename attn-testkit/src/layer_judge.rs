//! A half-precision multihead layer judged stage by stage on the `kind=multihead` files
//! (`multihead/`, `multihead_features/`, `multihead_grad/`): every row of each stage's
//! result (the projections, the attention op, LayerNorm, `out_proj`, and each one's
//! gradients) within the row bound of [`crate::judge`] against the float64 stage
//! ([`crate::layer_stages`]) on the stage's inputs exactly as the layer handed them over,
//! the file's inputs, weights and `grad_out` rounded to the dtype. Shared by the layers
//! under test (candle's, attn-multihead's), which record their stages in a [`LayerRun`].
//! The qk-LN files (`multihead_qkln/`, forward only) add the stages `q_ln` and `k_ln`
//! between the projections and the attention, and `q_ln` again in place of `norm`.
//!
//! Judged end to end instead, with a first-order bound carried through the stages, the
//! worst case of the roundings (the attention's average of values, `out_proj`'s sums)
//! exceeds a row's own size in bf16 and lets a 5% error pass.

use std::collections::BTreeMap;

use attn_core::{AttnShape, DType, DilatedConfig};

use crate::golden::{GoldenCase, Problem, golden_dir, load_dir};
use crate::judge::{Expected, RowCheck, check_rows, judge_backward, round_to, verdict};
use crate::layer_stages::{Want, accumulated, layer_norm, layer_norm_backward, linear, linear_backward};
use crate::tolerance::rel_l2_error;

/// The multihead directories and their file counts.
pub const LAYER_DIRS: [(&str, usize); 3] = [("multihead", 2), ("multihead_features", 1), ("multihead_grad", 3)];

/// The qk-LN directory and its file count (forward-only files; [`assert_qkln_files_pass`]).
pub const QKLN_DIR: (&str, usize) = ("multihead_qkln", 2);

/// The projections by their parameter names' prefixes.
pub const PROJECTIONS: [&str; 3] = ["q_proj", "k_proj", "v_proj"];

/// Every file of [`LAYER_DIRS`], each directory holding exactly its count.
pub fn layer_cases() -> Vec<GoldenCase> {
    cases_of(&LAYER_DIRS)
}

/// The files of `dirs`, each directory holding exactly its count.
fn cases_of(dirs: &[(&str, usize)]) -> Vec<GoldenCase> {
    let mut all = Vec::new();
    for &(dir, count) in dirs {
        let path = golden_dir().join(dir);
        let loaded = load_dir(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(loaded.len(), count, "the {count} files in {}", path.display());
        all.extend(loaded.into_iter().map(|(p, c)| c.unwrap_or_else(|e| panic!("{}: {e}", p.display()))));
    }
    all
}

/// Whether a file attends over keys and values of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrossKind {
    Cross,
    SelfAttention,
}

/// The file's attention kind (its `cross_attention` metadata).
pub fn cross_kind(case: &GoldenCase) -> CrossKind {
    match case.bool_meta("cross_attention").unwrap_or(false) {
        true => CrossKind::Cross,
        false => CrossKind::SelfAttention,
    }
}

/// The file's input that projection `i` reads.
pub fn input_of(case: &GoldenCase, i: usize) -> &'static str {
    match cross_kind(case) {
        CrossKind::Cross => ["query", "key", "value"][i],
        CrossKind::SelfAttention => "query",
    }
}

/// The names of the file's layer parameters (`q_proj.weight`, ...).
pub fn param_names(case: &GoldenCase) -> Vec<String> {
    let is_param = |k: &&String| !k.starts_with("d.") && (k.ends_with(".weight") || k.ends_with(".bias"));
    case.tensors.keys().filter(is_param).cloned().collect()
}

/// qk-LN's `q_ln` and `k_ln` as (weight, bias) pairs read by `param`, when the file has them.
fn qk_norms(param: impl Fn(&str) -> Option<Vec<f64>>) -> Option<[(Vec<f64>, Vec<f64>); 2]> {
    param("q_ln.weight")?;
    Some(["q_ln", "k_ln"].map(|n| {
        let get = |p: &str| param(&format!("{n}.{p}")).unwrap_or_else(|| panic!("{n}.{p} of a qk-LN file"));
        (get("weight"), get("bias"))
    }))
}

/// The LayerNorm over the merged heads: `norm`, or qk-LN's `q_ln`.
fn merged_norm(param: impl Fn(&str) -> Option<Vec<f64>>) -> Option<(Vec<f64>, Vec<f64>)> {
    let name = if param("q_ln.weight").is_some() { "q_ln" } else { "norm" };
    param(&format!("{name}.weight")).map(|g| (g, param(&format!("{name}.bias")).expect("the norm's bias")))
}

/// f32 values widened.
pub fn wide(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// The layer's attention and head layout as its config reads from the file.
#[derive(Debug, Clone)]
pub struct LayerSpec {
    pub attention: DilatedConfig,
    pub heads: usize,
    pub kv_heads: usize,
    pub eps: f64,
}

/// The layer's sizes on one file: batch, query positions, key positions, embed, heads,
/// kv heads, LayerNorm eps.
#[derive(Debug, Clone, Copy)]
pub struct LayerDims {
    pub b: usize,
    pub n: usize,
    pub m: usize,
    pub e: usize,
    pub h: usize,
    pub kvh: usize,
    pub eps: f64,
}

impl LayerDims {
    /// The sizes of `case` (its `query`, and `key` for cross-attention) under `spec`.
    pub fn of(case: &GoldenCase, spec: &LayerSpec) -> Self {
        let query = case.tensor("query").expect("query");
        let (b, n, e) = (query.shape[0], query.shape[1], query.shape[2]);
        let m = case.tensors.get("key").map_or(n, |k| k.shape[1]);
        LayerDims { b, n, m, e, h: spec.heads, kvh: spec.kv_heads, eps: spec.eps }
    }
    pub fn d(&self) -> usize {
        self.e / self.h
    }
    pub fn kv(&self) -> usize {
        self.kvh * self.d()
    }
    /// Rows each projection reads: `b * n` queries, `b * m` keys and values.
    fn rows(&self) -> [usize; 3] {
        [self.b * self.n, self.b * self.m, self.b * self.m]
    }
    /// Columns each projection writes.
    fn outs(&self) -> [usize; 3] {
        [self.e, self.kv(), self.kv()]
    }
}

/// A layer run on one file in one dtype (values as float64): its output, its gradients
/// by the file's names (`d_query`, `d.q_proj.weight`, ...), and its stages' results by
/// name: `q`, `k`, `v` (projections), `a` (attention), `y` (LayerNorm, or `a`), and with
/// gradients `dy` (`out_proj`'s input gradient), `da` (LayerNorm's), `dq`, `dk`, `dv`
/// (attention's) and, for self-attention, `dx.q_proj`, `dx.k_proj`, `dx.v_proj`.
#[derive(Debug, Clone)]
pub struct LayerRun {
    pub dims: LayerDims,
    pub dtype: DType,
    pub out: Vec<f64>,
    pub grads: BTreeMap<String, Vec<f64>>,
    pub stage: BTreeMap<String, Vec<f64>>,
}

fn check(name: &str, got: &[f64], want: &Want, row_len: usize, dtype: DType) -> RowCheck {
    let zeros = vec![0.0; want.v.len()];
    check_rows(name, got, &want.v, [&want.mag, &zeros, &zeros], row_len, dtype)
}

/// Every stage of `run` against its float64 reference on the stage's own inputs.
pub fn judge_layer(case: &GoldenCase, spec: &LayerSpec, run: &LayerRun) -> Vec<RowCheck> {
    let (dims, dtype, s) = (run.dims, run.dtype, &run.stage);
    let LayerDims { b, n, m, e, .. } = dims;
    let rounded = |name: &str| wide(&round_to(dtype, &case.tensor(name).expect("a tensor the file lists").data));
    let param = |name: &str| case.tensors.contains_key(name).then(|| rounded(name));
    let w = |name: &str| param(&format!("{name}.weight")).expect("weight");
    let (rows, outs) = (dims.rows(), dims.outs());
    let mut checks = Vec::new();
    for (i, name) in PROJECTIONS.into_iter().enumerate() {
        let x = rounded(input_of(case, i));
        let want = linear(&x, &w(name), param(&format!("{name}.bias")).as_deref(), [rows[i], e, outs[i]]);
        checks.push(check(name, &s[&name[..1]], &want, outs[i], dtype));
    }
    let shape =
        AttnShape::check_cross(&[b, n, dims.h, dims.d()], &[b, m, dims.kvh, dims.d()], &[b, m, dims.kvh, dims.d()])
            .expect("shape");
    let problem = Problem::new(&spec.attention, shape).with_masks(case.masks());
    let da = s.get("da").cloned().unwrap_or_else(|| vec![0.0; b * n * e]);
    let qk = qk_norms(param);
    let (q_in, k_in) = match &qk {
        Some([(gq, bq), (gk, bk)]) => {
            checks.push(check("q_ln", &s["qn"], &layer_norm(&s["q"], [gq, bq], e, dims.eps), e, dtype));
            checks.push(check("k_ln", &s["kn"], &layer_norm(&s["k"], [gk, bk], dims.kv(), dims.eps), dims.kv(), dtype));
            (&s["qn"], &s["kn"])
        }
        None => (&s["q"], &s["k"]),
    };
    let attn = Expected::for_problem(&problem, [q_in, k_in, &s["v"]], Some(&da)).expect("reference");
    let mag = &attn.mag;
    let terms = [&mag.out[..], &mag.flushable.out, &mag.quantum.out];
    checks.push(check_rows("attention", &s["a"], &attn.fwd.out, terms, dims.d(), dtype));
    let norm = merged_norm(param);
    if let Some((g, beta)) = &norm {
        checks.push(check("norm", &s["y"], &layer_norm(&s["a"], [g, beta], e, dims.eps), e, dtype));
    }
    let out_bias = param("out_proj.bias");
    let want_out = linear(&s["y"], &w("out_proj"), out_bias.as_deref(), [b * n, e, e]);
    checks.push(check("out", &run.out, &want_out, e, dtype));
    let Some(go) = case.tensors.get("grad_out") else { return checks };
    assert!(qk.is_none(), "{}: gradient stages of a qk-LN file are not judged here", case.name);
    let go = wide(&round_to(dtype, &go.data));
    let grad = |checks: &mut Vec<RowCheck>, name: &str, got: &[f64], want: &Want, row: usize| {
        checks.push(check(name, got, want, row, dtype));
    };
    let (dy, dw, db) = linear_backward(&s["y"], &w("out_proj"), &go, [b * n, e, e]);
    grad(&mut checks, "out_proj dx", &s["dy"], &dy, e);
    grad(&mut checks, "d.out_proj.weight", &run.grads["d.out_proj.weight"], &dw, e);
    if let Some(got) = run.grads.get("d.out_proj.bias") {
        grad(&mut checks, "d.out_proj.bias", got, &db, e);
    }
    if let Some((g, _)) = &norm {
        let (da, dg, dbeta) = layer_norm_backward(&s["a"], &s["dy"], g, e, dims.eps);
        grad(&mut checks, "norm dx", &s["da"], &da, e);
        grad(&mut checks, "d.norm.weight", &run.grads["d.norm.weight"], &dg, e);
        grad(&mut checks, "d.norm.bias", &run.grads["d.norm.bias"], &dbeta, e);
    }
    let mut att = judge_backward(&attn, [&s["dq"], &s["dk"], &s["dv"]], dtype);
    att.iter_mut().for_each(|c| c.tensor = format!("attention {}", c.tensor));
    checks.extend(att);
    let mut dxs = Vec::new();
    for (i, name) in PROJECTIONS.into_iter().enumerate() {
        let dyp = &s[&format!("d{}", &name[..1])];
        let (dx, dw, db) = linear_backward(&rounded(input_of(case, i)), &w(name), dyp, [rows[i], e, outs[i]]);
        grad(&mut checks, &format!("d.{name}.weight"), &run.grads[&format!("d.{name}.weight")], &dw, e);
        if let Some(got) = run.grads.get(&format!("d.{name}.bias")) {
            grad(&mut checks, &format!("d.{name}.bias"), got, &db, outs[i]);
        }
        dxs.push(dx);
    }
    match cross_kind(case) {
        CrossKind::Cross => {
            for (i, input) in ["d_query", "d_key", "d_value"].into_iter().enumerate() {
                grad(&mut checks, input, &run.grads[input], &dxs[i], e);
            }
        }
        CrossKind::SelfAttention => {
            for (i, name) in PROJECTIONS.into_iter().enumerate() {
                grad(&mut checks, &format!("{name} dx"), &s[&format!("dx.{name}")], &dxs[i], e);
            }
            let parts: Vec<&[f64]> = PROJECTIONS.iter().map(|p| s[&format!("dx.{p}")].as_slice()).collect();
            grad(&mut checks, "d_query", &run.grads["d_query"], &accumulated(&parts), e);
        }
    }
    checks
}

/// The float64 composition of the stages on the file's own (unrounded) tensors against the
/// file's output and, where it has them, gradients: within its `rel_tol`; the key bias's
/// gradient (zero by the definition, roundoff in the file) by its error relative to the
/// key weight's gradient, as the golden checker judges it.
pub fn check_composition(case: &GoldenCase, spec: &LayerSpec) {
    let t = |name: &str| wide(&case.tensor(name).expect("a tensor the file lists").data);
    let param = |name: &str| case.tensors.contains_key(name).then(|| t(name));
    let dims = LayerDims::of(case, spec);
    let LayerDims { b, n, m, e, h, kvh, eps } = dims;
    let (rows, outs) = (dims.rows(), dims.outs());
    let proj: Vec<Vec<f64>> = (0..3)
        .map(|i| {
            let name = PROJECTIONS[i];
            let w = t(&format!("{name}.weight"));
            linear(&t(input_of(case, i)), &w, param(&format!("{name}.bias")).as_deref(), [rows[i], e, outs[i]]).v
        })
        .collect();
    let d = dims.d();
    let shape = AttnShape::check_cross(&[b, n, h, d], &[b, m, kvh, d], &[b, m, kvh, d]).expect("shape");
    let problem = Problem::new(&spec.attention, shape).with_masks(case.masks());
    let qk = qk_norms(param);
    let (q_in, k_in) = match &qk {
        Some([(gq, bq), (gk, bk)]) => {
            (layer_norm(&proj[0], [gq, bq], e, eps).v, layer_norm(&proj[1], [gk, bk], dims.kv(), eps).v)
        }
        None => (proj[0].clone(), proj[1].clone()),
    };
    let fwd = Expected::for_problem(&problem, [&q_in, &k_in, &proj[2]], None).expect("attention");
    let a = fwd.fwd.out;
    let norm = merged_norm(param);
    let y = match &norm {
        Some((g, beta)) => layer_norm(&a, [g, beta], e, eps).v,
        None => a.clone(),
    };
    let out = linear(&y, &t("out_proj.weight"), param("out_proj.bias").as_deref(), [b * n, e, e]).v;
    let tol = case.rel_tol().expect("rel_tol");
    let err = rel_l2_error(&out, &case.tensor("out").expect("out").data);
    assert!(err <= tol, "{}: the float64 stages' out is {err:.2e} off the file", case.name);
    let Some(go) = case.tensors.get("grad_out") else { return };
    assert!(qk.is_none(), "{}: gradients of a qk-LN file are not composed here", case.name);
    let mut got: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let (dy, dw, db) = linear_backward(&y, &t("out_proj.weight"), &wide(&go.data), [b * n, e, e]);
    got.insert("d.out_proj.weight".into(), dw.v);
    got.insert("d.out_proj.bias".into(), db.v);
    let mut da = dy.v;
    if let Some((g, _)) = &norm {
        let (dx, dg, dbeta) = layer_norm_backward(&a, &da, g, e, eps);
        got.insert("d.norm.weight".into(), dg.v);
        got.insert("d.norm.bias".into(), dbeta.v);
        da = dx.v;
    }
    let back = Expected::for_problem(&problem, [&proj[0], &proj[1], &proj[2]], Some(&da)).expect("attention");
    let dqkv = [&back.grads.dq, &back.grads.dk, &back.grads.dv];
    let mut dxs = Vec::new();
    for (i, name) in PROJECTIONS.into_iter().enumerate() {
        let (dx, dw, db) =
            linear_backward(&t(input_of(case, i)), &t(&format!("{name}.weight")), dqkv[i], [rows[i], e, outs[i]]);
        got.insert(format!("d.{name}.weight"), dw.v);
        got.insert(format!("d.{name}.bias"), db.v);
        dxs.push(dx.v);
    }
    match cross_kind(case) {
        CrossKind::Cross => {
            ["d_query", "d_key", "d_value"].into_iter().zip(dxs).for_each(|(k, v)| drop(got.insert(k.into(), v)))
        }
        CrossKind::SelfAttention => drop(got.insert("d_query".into(), accumulated(&[&dxs[0], &dxs[1], &dxs[2]]).v)),
    }
    let names = case.multihead_gradient_names().expect("names").expect("a gradient file");
    let norm2 = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
    for name in names {
        let want = t(&name);
        let g = got.get(&name).unwrap_or_else(|| panic!("{}: no {name} from the stages", case.name));
        let weight = name.strip_suffix(".bias").map(|w| norm2(&t(&format!("{w}.weight"))));
        let err = match weight {
            Some(s) if norm2(&want) < f64::from(f32::EPSILON) * s => {
                norm2(&g.iter().zip(&want).map(|(a, b)| a - b).collect::<Vec<_>>()) / s
            }
            _ => rel_l2_error(g, &want),
        };
        assert!(err <= tol, "{}: the float64 stages' {name} is {err:.2e} off the file", case.name);
    }
}

/// One row of the layer's output, or of its `d_query`, 5% off fails the judge that passes
/// the unchanged `run` (and nothing else fails); so does one row of the attention op's
/// output or dq inside the layer. `run` must be of a self-attention gradient file with
/// embed 32 and at least 150 rows of `head_dim`.
pub fn assert_planted_rows_fail(case: &GoldenCase, spec: &LayerSpec, run: &LayerRun) {
    let dtype = run.dtype;
    verdict(&judge_layer(case, spec, run)).unwrap_or_else(|e| panic!("{dtype:?}: {e}"));
    for tensor in ["out", "d_query"] {
        let mut wrong = run.clone();
        let data = if tensor == "out" { &mut wrong.out } else { wrong.grads.get_mut(tensor).expect("d_query") };
        let row = 37;
        data[row * 32..][..32].iter_mut().for_each(|x| *x *= 1.05);
        let checks = judge_layer(case, spec, &wrong);
        let failed: Vec<&RowCheck> = checks.iter().filter(|c| !c.passed()).collect();
        assert!(
            failed.len() == 1 && failed[0].tensor == tensor && failed[0].worst_row == row,
            "{dtype:?}: a 5% error in {tensor} row {row}: {failed:?}"
        );
        println!("{dtype:?}: planted {tensor} row {row} at {:.2} of its bound", failed[0].worst);
    }
    // Inside the layer: one head_dim row of the attention op's output, or of its dq.
    for (stage, tensor) in [("a", "attention"), ("dq", "attention dq")] {
        let mut wrong = run.clone();
        let (row, d) = (149, run.dims.d());
        wrong.stage.get_mut(stage).expect("a stage")[row * d..][..d].iter_mut().for_each(|x| *x *= 1.05);
        let checks = judge_layer(case, spec, &wrong);
        let c = checks.iter().find(|c| c.tensor == tensor).expect("the stage's check");
        assert!(!c.passed() && c.worst_row == row, "{dtype:?}: a 5% error in {tensor} row {row} passed: {c}");
        println!("{dtype:?}: planted {tensor} row {row} at {:.2} of its bound", c.worst);
    }
}

/// Every file of [`layer_cases`] through `run` in bf16 and f16, each run's stages within
/// their bounds ([`judge_layer`]) after the float64 composition matched the file
/// ([`check_composition`]): 12 runs, 6 of them with gradients.
pub fn assert_layer_files_pass(
    spec_of: impl Fn(&GoldenCase) -> LayerSpec,
    run: impl Fn(&GoldenCase, DType) -> LayerRun,
) {
    assert_files_pass(layer_cases(), spec_of, run, (12, 6));
}

/// The qk-LN files ([`QKLN_DIR`]) through `run` in bf16 and f16 as
/// [`assert_layer_files_pass`] judges the others: 4 runs, forward only.
pub fn assert_qkln_files_pass(
    spec_of: impl Fn(&GoldenCase) -> LayerSpec,
    run: impl Fn(&GoldenCase, DType) -> LayerRun,
) {
    assert_files_pass(qkln_cases(), spec_of, run, (4, 0));
}

/// Every file of [`QKLN_DIR`].
pub fn qkln_cases() -> Vec<GoldenCase> {
    cases_of(&[QKLN_DIR])
}

/// `cases` through `run` in bf16 and f16, `expected` = (runs, runs with gradients).
fn assert_files_pass(
    cases: Vec<GoldenCase>,
    spec_of: impl Fn(&GoldenCase) -> LayerSpec,
    run: impl Fn(&GoldenCase, DType) -> LayerRun,
    expected: (usize, usize),
) {
    let mut failed = Vec::new();
    let (mut runs, mut gradient_runs, mut judged) = (0, 0, 0);
    for case in cases {
        let spec = spec_of(&case);
        check_composition(&case, &spec);
        for dtype in [DType::BF16, DType::F16] {
            let r = run(&case, dtype);
            let checks = judge_layer(&case, &spec, &r);
            let worst = checks.iter().map(|c| c.worst).fold(0.0, f64::max);
            println!("{} {dtype:?}: {} tensors, worst row at {worst:.2} of its bound", case.name, checks.len());
            if let Err(e) = verdict(&checks) {
                failed.push(format!("{} {dtype:?}: {e}", case.name));
            }
            runs += 1;
            judged += checks.len();
            gradient_runs += usize::from(!r.grads.is_empty());
        }
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
    assert_eq!((runs, gradient_runs), expected, "(runs, runs with gradients) over 2 dtypes");
    println!("{judged} tensors judged row by row");
}
