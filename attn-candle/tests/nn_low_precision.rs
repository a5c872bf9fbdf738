//! candle's multihead layer in bf16 and f16 over the `kind=multihead` files
//! (`multihead/`, `multihead_features/`, and `multihead_grad/` with every gradient),
//! stage by stage: every row of each stage's result (the projections, the attention op,
//! LayerNorm, `out_proj`, and each one's gradients) within the test kit's row bound
//! against the float64 stage on the stage's inputs exactly as the layer handed them over,
//! the file's inputs, weights and `grad_out` rounded to the dtype at the start. The layer's
//! own output and parameter gradients are those stages' (bit for bit), and the float64 composition
//! of the stages is checked against each file first. A 5% error in one row fails.
//!
//! Judged end to end instead, with a first-order bound carried through the stages, the
//! worst case of the roundings (the attention's average of values, `out_proj`'s sums)
//! exceeds a row's own size in bf16 and lets a 5% error pass.

use std::collections::BTreeMap;

use attn_candle::AttnOptions;
use attn_candle::nn::{LayerNorm, MultiheadDilatedAttention};
use attn_core::{AttnShape, DType as AttnDType};
use attn_multihead::Bias;
use attn_multihead::metadata::config_from_metadata;
use attn_testkit::golden::{GoldenCase, Problem, golden_dir, load_dir};
use attn_testkit::judge::{Expected, RowCheck, check_rows, judge_backward, round_to, verdict};
use attn_testkit::tolerance::rel_l2_error;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Linear, VarBuilder};

use crate::common::layer_stages::{Want, accumulated, layer_norm, layer_norm_backward, linear, linear_backward};

/// The multihead directories and their file counts.
const DIRS: [(&str, usize); 3] = [("multihead", 2), ("multihead_features", 1), ("multihead_grad", 3)];

fn cases() -> Vec<GoldenCase> {
    let mut all = Vec::new();
    for (dir, count) in DIRS {
        let path = golden_dir().join(dir);
        let loaded = load_dir(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(loaded.len(), count, "the {count} files in {}", path.display());
        all.extend(loaded.into_iter().map(|(p, c)| c.unwrap_or_else(|e| panic!("{}: {e}", p.display()))));
    }
    all
}

/// Whether the file attends over keys and values of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cross {
    Yes,
    No,
}

fn cross(case: &GoldenCase) -> Cross {
    match case.bool_meta("cross_attention").unwrap_or(false) {
        true => Cross::Yes,
        false => Cross::No,
    }
}

const PROJECTIONS: [&str; 3] = ["q_proj", "k_proj", "v_proj"];

/// The file's input each projection reads.
fn input_of(case: &GoldenCase, i: usize) -> &'static str {
    match cross(case) {
        Cross::Yes => ["query", "key", "value"][i],
        Cross::No => "query",
    }
}

fn param_names(case: &GoldenCase) -> Vec<String> {
    let is_param = |k: &&String| !k.starts_with("d.") && (k.ends_with(".weight") || k.ends_with(".bias"));
    case.tensors.keys().filter(is_param).cloned().collect()
}

fn wide(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

fn values(t: &Tensor) -> Vec<f64> {
    wide(&t.to_dtype(DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1()).expect("values"))
}

/// The layer's sizes: batch, query positions, key positions, embed, heads, kv heads, eps.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    n: usize,
    m: usize,
    e: usize,
    h: usize,
    kvh: usize,
    eps: f64,
}

impl Dims {
    fn d(&self) -> usize {
        self.e / self.h
    }
    fn kv(&self) -> usize {
        self.kvh * self.d()
    }
}

/// candle's layer on one file in one dtype: the layer's output and gradients (by the
/// file's names), and its stages' inputs and results (float64 of the dtype's values).
#[derive(Debug, Clone)]
struct Run {
    dims: Dims,
    dtype: AttnDType,
    out: Vec<f64>,
    grads: BTreeMap<String, Vec<f64>>,
    stage: BTreeMap<String, Vec<f64>>,
}

fn options(case: &GoldenCase, config: &attn_multihead::MultiheadConfig) -> AttnOptions {
    let mut opts = AttnOptions::new(config.attention.clone());
    if let Some(mask) = case.masks.key_padding() {
        opts = opts.with_key_padding(mask.clone());
    }
    opts
}

/// `sum(y * dy)`'s gradients with respect to `vars`.
fn grads_of(y: &Tensor, dy: &Tensor, vars: &[&Tensor]) -> Vec<Tensor> {
    let store = (y * dy).and_then(|l| l.sum_all()).and_then(|l| l.backward()).expect("backward");
    vars.iter().map(|v| store.get(v).expect("a gradient").clone()).collect()
}

fn leaf(x: &Tensor) -> Var {
    Var::from_tensor(&x.detach()).expect("var")
}

fn run(case: &GoldenCase, dtype: AttnDType) -> Run {
    let dev = Device::Cpu;
    let dt = match dtype {
        AttnDType::BF16 => DType::BF16,
        _ => DType::F16,
    };
    let var = |name: &str| {
        let t = case.tensor(name).expect("a tensor the file lists");
        let x = Tensor::from_vec(round_to(dtype, &t.data), t.shape.as_slice(), &dev).expect("tensor");
        Var::from_tensor(&x.to_dtype(dt).expect("to dtype")).expect("var")
    };
    let inputs: BTreeMap<&str, Var> = ["query", "key", "value"]
        .into_iter()
        .filter(|n| cross(case) == Cross::Yes || *n == "query")
        .map(|n| (n, var(n)))
        .collect();
    let params: BTreeMap<String, Var> = param_names(case).into_iter().map(|n| (n.clone(), var(&n))).collect();
    let weights = params.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    let vb = VarBuilder::from_tensors(weights, dt, &dev);
    let bias = if params.contains_key("q_proj.bias") { Bias::Zeros } else { Bias::Absent };
    let config = config_from_metadata(&case.meta, bias).expect("config");
    let opts = options(case, &config);
    let query = case.tensor("query").expect("query");
    let (b, n, e) = (query.shape[0], query.shape[1], query.shape[2]);
    let m = inputs.get("key").map_or(n, |k| k.dims()[1]);
    let dims = Dims { b, n, m, e, h: config.num_heads, kvh: config.num_kv_heads, eps: config.layer_norm_eps };
    let layer = MultiheadDilatedAttention::new(config.clone(), vb.clone()).expect("layer loads");
    let t = |name: &str| inputs[name].as_tensor();
    let out = match cross(case) {
        Cross::Yes => layer.forward_cross(t("query"), t("key"), t("value"), &opts),
        Cross::No => layer.forward_masked(t("query"), &opts),
    }
    .expect("forward");

    // The same stages one at a time, each on a copy of its input (its own backward).
    let p = |name: &str| params.get(name).map(|v| v.as_tensor().clone());
    let lin = |name: &str| Linear::new(p(&format!("{name}.weight")).expect("weight"), p(&format!("{name}.bias")));
    let mut stage = BTreeMap::new();
    let xs: Vec<Var> = (0..3).map(|i| leaf(t(input_of(case, i)))).collect();
    let proj: Vec<Tensor> =
        (0..3).map(|i| lin(PROJECTIONS[i]).forward(xs[i].as_tensor()).expect("projection")).collect();
    let (d, kvh) = (dims.d(), dims.kvh);
    let heads = [(n, dims.h), (m, kvh), (m, kvh)];
    let qkv: Vec<Var> =
        (0..3).map(|i| leaf(&proj[i].reshape((b, heads[i].0, heads[i].1, d)).expect("heads"))).collect();
    let a = attn_candle::dilated_attention(qkv[0].as_tensor(), qkv[1].as_tensor(), qkv[2].as_tensor(), &opts)
        .expect("attention");
    let av = leaf(&a.reshape((b, n, e)).expect("merge heads"));
    let norm = config.layer_norm.then(|| LayerNorm::new(e, dims.eps, vb.pp("norm")).expect("norm"));
    let y = match &norm {
        Some(norm) => norm.forward(av.as_tensor()).expect("norm"),
        None => av.as_tensor().clone(),
    };
    let yv = leaf(&y);
    let out_s = lin("out_proj").forward(yv.as_tensor()).expect("out_proj");
    assert_eq!(values(&out_s), values(&out), "{}: the layer's output is its stages'", case.name);
    for (i, name) in ["q", "k", "v"].into_iter().enumerate() {
        stage.insert(name.to_string(), values(&proj[i]));
    }
    stage.insert("a".into(), values(&a));
    stage.insert("y".into(), values(&y));

    let mut grads = BTreeMap::new();
    if let Some(go) = case.tensors.get("grad_out") {
        let go = Tensor::from_vec(round_to(dtype, &go.data), go.shape.as_slice(), &dev).expect("grad_out");
        let go = go.to_dtype(dt).expect("to dtype");
        let named: Vec<(String, &Var)> = inputs
            .iter()
            .map(|(k, v)| (format!("d_{k}"), v))
            .chain(params.iter().map(|(k, v)| (format!("d.{k}"), v)))
            .collect();
        let all: Vec<&Tensor> = named.iter().map(|(_, v)| v.as_tensor()).collect();
        for ((name, _), g) in named.iter().zip(grads_of(&out, &go, &all)) {
            grads.insert(name.clone(), values(&g));
        }
        // The stages' backward, each given the gradient the next stage handed back.
        let mut stage_grads = BTreeMap::new();
        let param_grads = |stage_grads: &mut BTreeMap<String, Vec<f64>>, name: &str, gs: &[Tensor]| {
            stage_grads.insert(format!("d.{name}.weight"), values(&gs[1]));
            if let Some(g) = gs.get(2) {
                stage_grads.insert(format!("d.{name}.bias"), values(g));
            }
        };
        let with_bias = |name: &str, x: &Var| {
            let mut v = vec![x.as_tensor().clone(), p(&format!("{name}.weight")).expect("weight")];
            v.extend(p(&format!("{name}.bias")));
            v
        };
        let vs = with_bias("out_proj", &yv);
        let gs = grads_of(&out_s, &go, &vs.iter().collect::<Vec<_>>());
        param_grads(&mut stage_grads, "out_proj", &gs);
        stage.insert("dy".into(), values(&gs[0]));
        let da = match &norm {
            Some(_) => {
                let vs = [av.as_tensor().clone(), p("norm.weight").expect("norm"), p("norm.bias").expect("norm")];
                let gn = grads_of(&y, &gs[0], &vs.iter().collect::<Vec<_>>());
                stage_grads.insert("d.norm.weight".into(), values(&gn[1]));
                stage_grads.insert("d.norm.bias".into(), values(&gn[2]));
                gn[0].clone()
            }
            None => gs[0].clone(),
        };
        stage.insert("da".into(), values(&da));
        let da = da.reshape((b, n, dims.h, d)).expect("heads");
        let dqkv = grads_of(&a, &da, &qkv.iter().map(|v| v.as_tensor()).collect::<Vec<_>>());
        for (i, name) in PROJECTIONS.into_iter().enumerate() {
            stage.insert(format!("d{}", &name[..1]), values(&dqkv[i]));
            let dy = dqkv[i].reshape(proj[i].shape()).expect("rows");
            let vs = with_bias(name, &xs[i]);
            let gp = grads_of(&proj[i], &dy, &vs.iter().collect::<Vec<_>>());
            param_grads(&mut stage_grads, name, &gp);
            stage.insert(format!("dx.{name}"), values(&gp[0]));
        }
        for (name, g) in &stage_grads {
            assert_eq!(&grads[name], g, "{}: the layer's {name} is its stage's", case.name);
        }
    }
    Run { dims, dtype, out: values(&out), grads, stage }
}

fn check(name: &str, got: &[f64], want: &Want, row_len: usize, dtype: AttnDType) -> RowCheck {
    let zeros = vec![0.0; want.v.len()];
    check_rows(name, got, &want.v, [&want.mag, &zeros, &zeros], row_len, dtype)
}

/// Every stage of `run` against its float64 reference on the stage's own inputs.
fn judge(case: &GoldenCase, run: &Run) -> Vec<RowCheck> {
    let (dims, dtype, s) = (run.dims, run.dtype, &run.stage);
    let Dims { b, n, m, e, .. } = dims;
    let rounded = |name: &str| wide(&round_to(dtype, &case.tensor(name).expect("a tensor the file lists").data));
    let param = |name: &str| case.tensors.contains_key(name).then(|| rounded(name));
    let w = |name: &str| param(&format!("{name}.weight")).expect("weight");
    let rows = [b * n, b * m, b * m];
    let outs = [e, dims.kv(), dims.kv()];
    let mut checks = Vec::new();
    for (i, name) in PROJECTIONS.into_iter().enumerate() {
        let want = linear(
            &rounded(input_of(case, i)),
            &w(name),
            param(&format!("{name}.bias")).as_deref(),
            [rows[i], e, outs[i]],
        );
        checks.push(check(name, &s[&name[..1]], &want, outs[i], dtype));
    }
    let cfg = case_config(case);
    let shape =
        AttnShape::check_cross(&[b, n, dims.h, dims.d()], &[b, m, dims.kvh, dims.d()], &[b, m, dims.kvh, dims.d()])
            .expect("shape");
    let problem = Problem::new(&cfg, shape).with_masks(case.masks());
    let da = s.get("da").cloned().unwrap_or_else(|| vec![0.0; b * n * e]);
    let attn = Expected::for_problem(&problem, [&s["q"], &s["k"], &s["v"]], Some(&da)).expect("reference");
    let mag = &attn.mag;
    checks.push(check_rows(
        "attention",
        &s["a"],
        &attn.fwd.out,
        [&mag.out, &mag.flushable.out, &mag.quantum.out],
        dims.d(),
        dtype,
    ));
    let norm = param("norm.weight").map(|g| (g, param("norm.bias").expect("norm.bias")));
    if let Some((g, beta)) = &norm {
        checks.push(check("norm", &s["y"], &layer_norm(&s["a"], [g, beta], e, dims.eps), e, dtype));
    }
    checks.push(check(
        "out",
        &run.out,
        &linear(&s["y"], &w("out_proj"), param("out_proj.bias").as_deref(), [b * n, e, e]),
        e,
        dtype,
    ));
    let Some(go) = case.tensors.get("grad_out") else { return checks };
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
    match cross(case) {
        Cross::Yes => {
            for (i, input) in ["d_query", "d_key", "d_value"].into_iter().enumerate() {
                grad(&mut checks, input, &run.grads[input], &dxs[i], e);
            }
        }
        Cross::No => {
            for (i, name) in PROJECTIONS.into_iter().enumerate() {
                grad(&mut checks, &format!("{name} dx"), &s[&format!("dx.{name}")], &dxs[i], e);
            }
            let parts: Vec<&[f64]> = PROJECTIONS.iter().map(|p| s[&format!("dx.{p}")].as_slice()).collect();
            grad(&mut checks, "d_query", &run.grads["d_query"], &accumulated(&parts), e);
        }
    }
    checks
}

fn case_config(case: &GoldenCase) -> attn_core::DilatedConfig {
    config_from_metadata(&case.meta, Bias::Zeros).expect("config").attention
}

/// The float64 composition of the stages on the file's own (unrounded) tensors against the
/// file's output and, where it has them, gradients: within its `rel_tol`; the key bias's
/// gradient (zero by the definition, roundoff in the file) by its error relative to the
/// key weight's gradient, as the golden checker judges it.
fn check_composition(case: &GoldenCase) {
    let t = |name: &str| wide(&case.tensor(name).expect("a tensor the file lists").data);
    let param = |name: &str| case.tensors.contains_key(name).then(|| t(name));
    let config = config_from_metadata(&case.meta, Bias::Zeros).expect("config");
    let query = case.tensor("query").expect("query");
    let (b, n, e) = (query.shape[0], query.shape[1], query.shape[2]);
    let m = case.tensors.get("key").map_or(n, |k| k.shape[1]);
    let (h, kvh) = (config.num_heads, config.num_kv_heads);
    let (d, kv) = (e / h, kvh * e / h);
    let rows = [b * n, b * m, b * m];
    let outs = [e, kv, kv];
    let proj: Vec<Vec<f64>> = (0..3)
        .map(|i| {
            let name = PROJECTIONS[i];
            let w = t(&format!("{name}.weight"));
            linear(&t(input_of(case, i)), &w, param(&format!("{name}.bias")).as_deref(), [rows[i], e, outs[i]]).v
        })
        .collect();
    let cfg = case_config(case);
    let shape = AttnShape::check_cross(&[b, n, h, d], &[b, m, kvh, d], &[b, m, kvh, d]).expect("shape");
    let problem = Problem::new(&cfg, shape).with_masks(case.masks());
    let fwd = Expected::for_problem(&problem, [&proj[0], &proj[1], &proj[2]], None).expect("attention");
    let a = fwd.fwd.out;
    let norm = param("norm.weight").map(|g| (g, param("norm.bias").expect("norm.bias")));
    let y = match &norm {
        Some((g, beta)) => layer_norm(&a, [g, beta], e, config.layer_norm_eps).v,
        None => a.clone(),
    };
    let out = linear(&y, &t("out_proj.weight"), param("out_proj.bias").as_deref(), [b * n, e, e]).v;
    let tol = case.rel_tol().expect("rel_tol");
    let err = rel_l2_error(&out, &case.tensor("out").expect("out").data);
    assert!(err <= tol, "{}: the float64 stages' out is {err:.2e} off the file", case.name);
    let Some(go) = case.tensors.get("grad_out") else { return };
    let mut got: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let (dy, dw, db) = linear_backward(&y, &t("out_proj.weight"), &wide(&go.data), [b * n, e, e]);
    got.insert("d.out_proj.weight".into(), dw.v);
    got.insert("d.out_proj.bias".into(), db.v);
    let mut da = dy.v;
    if let Some((g, _)) = &norm {
        let (dx, dg, dbeta) = layer_norm_backward(&a, &da, g, e, config.layer_norm_eps);
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
    match cross(case) {
        Cross::Yes => {
            ["d_query", "d_key", "d_value"].into_iter().zip(dxs).for_each(|(k, v)| drop(got.insert(k.into(), v)))
        }
        Cross::No => drop(got.insert("d_query".into(), accumulated(&[&dxs[0], &dxs[1], &dxs[2]]).v)),
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

#[test]
fn multihead_files_in_bf16_and_f16_every_stage_row_within_its_bound() {
    let mut failed = Vec::new();
    let (mut runs, mut gradient_runs, mut rows_checked) = (0, 0, 0);
    for case in cases() {
        check_composition(&case);
        for dtype in [AttnDType::BF16, AttnDType::F16] {
            let r = run(&case, dtype);
            let checks = judge(&case, &r);
            let worst = checks.iter().map(|c| c.worst).fold(0.0, f64::max);
            println!("{} {dtype:?}: {} tensors, worst row at {worst:.2} of its bound", case.name, checks.len());
            if let Err(e) = verdict(&checks) {
                failed.push(format!("{} {dtype:?}: {e}", case.name));
            }
            runs += 1;
            rows_checked += checks.len();
            gradient_runs += usize::from(!r.grads.is_empty());
        }
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
    assert_eq!((runs, gradient_runs), (12, 6), "6 files (3 with gradients) in 2 dtypes");
    println!("{rows_checked} tensors judged row by row");
}

/// One row of the layer's output, or of its `d_query`, 5% off fails the judge that passes
/// the unchanged result, in both dtypes (and nothing else fails); so does one row of the
/// attention op's output or dq inside the layer.
#[test]
fn a_row_five_percent_off_fails() {
    let case = cases().into_iter().find(|c| c.name == "mhg_self_ln_hg").expect("mhg_self_ln_hg");
    for dtype in [AttnDType::BF16, AttnDType::F16] {
        let r = run(&case, dtype);
        verdict(&judge(&case, &r)).unwrap_or_else(|e| panic!("{dtype:?}: {e}"));
        for tensor in ["out", "d_query"] {
            let mut wrong = r.clone();
            let data = if tensor == "out" { &mut wrong.out } else { wrong.grads.get_mut(tensor).expect("d_query") };
            let row = 37;
            data[row * 32..][..32].iter_mut().for_each(|x| *x *= 1.05);
            let checks = judge(&case, &wrong);
            let failed: Vec<&RowCheck> = checks.iter().filter(|c| !c.passed()).collect();
            assert!(
                failed.len() == 1 && failed[0].tensor == tensor && failed[0].worst_row == row,
                "{dtype:?}: a 5% error in {tensor} row {row}: {failed:?}"
            );
            println!("{dtype:?}: planted {tensor} row {row} at {:.2} of its bound", failed[0].worst);
        }
        // Inside the layer: one head_dim row of the attention op's output, or of its dq.
        for (stage, tensor) in [("a", "attention"), ("dq", "attention dq")] {
            let mut wrong = r.clone();
            let (row, d) = (149, r.dims.d());
            wrong.stage.get_mut(stage).expect("a stage")[row * d..][..d].iter_mut().for_each(|x| *x *= 1.05);
            let checks = judge(&case, &wrong);
            let c = checks.iter().find(|c| c.tensor == tensor).expect("the stage's check");
            assert!(!c.passed() && c.worst_row == row, "{dtype:?}: a 5% error in {tensor} row {row} passed: {c}");
            println!("{dtype:?}: planted {tensor} row {row} at {:.2} of its bound", c.worst);
        }
    }
}
