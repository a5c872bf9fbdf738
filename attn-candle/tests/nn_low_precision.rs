//! candle's multihead layer in bf16 and f16 over the `kind=multihead` files, judged
//! stage by stage by the test kit's [`attn_testkit::layer_judge`]: the layer's stages
//! (the projections, the attention op, LayerNorm, `out_proj`, and each one's gradients)
//! run one at a time on the file's inputs, weights and `grad_out` rounded to the dtype;
//! the layer's own output and parameter gradients are those stages' (bit for bit).

use std::collections::BTreeMap;

use attn_candle::AttnOptions;
use attn_candle::nn::{LayerCall, LayerNorm, MultiheadDilatedAttention};
use attn_core::DType as AttnDType;
use attn_multihead::Bias;
use attn_multihead::metadata::config_from_metadata;
use attn_testkit::golden::GoldenCase;
use attn_testkit::judge::round_to;
use attn_testkit::layer_judge::{
    CrossKind, LayerDims, LayerRun, LayerSpec, PROJECTIONS, assert_layer_files_pass, assert_planted_rows_fail,
    cross_kind, input_of, layer_cases, param_names, wide,
};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Linear, VarBuilder};

fn values(t: &Tensor) -> Vec<f64> {
    wide(&t.to_dtype(DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1()).expect("values"))
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

/// The layer's attention and heads as its config reads from the file.
fn spec(case: &GoldenCase) -> LayerSpec {
    let config = config_from_metadata(&case.meta, Bias::Zeros).expect("config");
    LayerSpec {
        attention: config.attention,
        heads: config.num_heads,
        kv_heads: config.num_kv_heads,
        eps: config.layer_norm_eps,
    }
}

/// candle's layer on one file in one dtype: the layer's output and gradients (by the
/// file's names), and its stages' inputs and results (float64 of the dtype's values).
fn run(case: &GoldenCase, dtype: AttnDType) -> LayerRun {
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
        .filter(|n| cross_kind(case) == CrossKind::Cross || *n == "query")
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
    let dims = LayerDims { b, n, m, e, h: config.num_heads, kvh: config.num_kv_heads, eps: config.layer_norm_eps };
    let layer = MultiheadDilatedAttention::new(config.clone(), vb.clone()).expect("layer loads");
    let t = |name: &str| inputs[name].as_tensor();
    let out = match cross_kind(case) {
        CrossKind::Cross => layer.forward_with(t("query"), &LayerCall::new().masks(&opts).cross(t("key"), t("value"))),
        CrossKind::SelfAttention => layer.forward_with(t("query"), &LayerCall::new().masks(&opts)),
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
    LayerRun { dims, dtype, out: values(&out), grads, stage }
}

#[test]
fn multihead_files_in_bf16_and_f16_every_stage_row_within_its_bound() {
    assert_layer_files_pass(spec, run);
}

/// One row 5% off (the layer's output or `d_query`, the attention op's output or dq
/// inside it) fails, in both dtypes.
#[test]
fn a_row_five_percent_off_fails() {
    let case = layer_cases().into_iter().find(|c| c.name == "mhg_self_ln_hg").expect("mhg_self_ln_hg");
    for dtype in [AttnDType::BF16, AttnDType::F16] {
        assert_planted_rows_fail(&case, &spec(&case), &run(&case, dtype));
    }
}
