//! The candle-nn layer in the qk-LN layout (`NormLayout::QkLn`) equals `attn-multihead`'s
//! (float64, reference backend, its backward checked by finite differences there) on
//! the same weights: the reference's named parameters (`q_ln.*`, `k_ln.*`, no `norm.*`)
//! go through a safetensors checkpoint into a candle `VarMap`, and the output, the input
//! gradient and every parameter gradient agree within float32 rounding. A planted error
//! in `k_ln.weight` fails the same bounds.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use attn_candle::AttnOptions;
use attn_candle::nn::{LayerCall, MultiheadDilatedAttention};
use attn_core::{DilatedConfig, Mixing};
use attn_multihead::{Call, MultiheadConfig, NamedParams, NormLayout, ReferenceBackend, save_bytes};
use attn_testkit::rng::SeededRng;
use attn_testkit::tolerance::rel_l2_error;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

/// float32 candle against float64: output, input gradient, parameter gradients (each
/// relative to its own norm, or to 1e-3 of all parameter gradients' norm where it
/// vanishes in exact arithmetic, as `k_proj.bias`'s and `k_ln.bias`'s do).
const BOUND: f64 = 5e-5;

const BATCH: usize = 2;
const SEQ: usize = 16;

fn config() -> MultiheadConfig {
    let attention = DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).mixing(Mixing::LongNet).causal();
    MultiheadConfig::new(16, 4, attention.build().unwrap()).with_num_kv_heads(2).with_norm_layout(NormLayout::QkLn)
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    t.flatten_all().and_then(|t| t.to_dtype(DType::F64)).and_then(|t| t.to_vec1()).expect("values")
}

/// The largest relative error over output, input gradient and parameter gradients, with
/// `plant` added to the first element of `k_ln.weight` in the candle copy.
fn worst_error(plant: f64) -> f64 {
    let cfg = config();
    let mut layer = attn_multihead::MultiheadDilatedAttention::<f64>::new(cfg.clone(), 3, Arc::new(ReferenceBackend))
        .expect("reference layer");
    let mut rng = SeededRng::new(17);
    for p in layer.weights.params_mut() {
        if p.name.ends_with("bias") || p.name.contains("_ln.") {
            p.data.iter_mut().for_each(|x| *x += 0.2 * rng.normal());
        }
    }
    let e = cfg.embed_dim;
    let x: Vec<f64> = (0..BATCH * SEQ * e).map(|_| rng.normal()).collect();
    let g: Vec<f64> = (0..BATCH * SEQ * e).map(|_| rng.normal()).collect();
    let (want_y, cache) = layer.forward_train(&x, &Call::new(BATCH, SEQ)).expect("reference forward");
    let mut grads = layer.zero_grads();
    let want_dx = layer.backward(&cache, &g, &mut grads).expect("reference backward").query;
    let want: HashMap<String, Vec<f64>> = grads.params().into_iter().map(|p| (p.name, p.data.to_vec())).collect();

    let bytes = save_bytes(&layer.weights, None).expect("checkpoint");
    let file = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).expect("load checkpoint");
    let mut varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let module = MultiheadDilatedAttention::new(cfg.clone(), vb).expect("candle layer");
    let created: BTreeSet<String> = varmap.data().lock().expect("varmap").keys().cloned().collect();
    assert_eq!(created, file.keys().cloned().collect(), "the candle layer uses exactly the checkpoint's names");
    assert!(created.contains("k_ln.weight") && created.contains("q_ln.bias") && !created.contains("norm.weight"));
    for (name, t) in &file {
        let mut v = to_f64(t);
        if name == "k_ln.weight" {
            v[0] += plant;
        }
        let t = Tensor::from_vec(v, t.shape(), &Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).expect("f32");
        varmap.set_one(name, &t).expect("set parameter");
    }

    let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let xv = Var::from_vec(f32s(&x), (BATCH, SEQ, e), &Device::Cpu).expect("x");
    let gt = Tensor::from_vec(f32s(&g), (BATCH, SEQ, e), &Device::Cpu).expect("g");
    let y = module
        .forward_with(xv.as_tensor(), &LayerCall::new().masks(&AttnOptions::new(cfg.attention.clone())))
        .expect("candle forward");
    let back = y.mul(&gt).and_then(|t| t.sum_all()).and_then(|l| l.backward()).expect("candle backward");
    let dx = back.get(xv.as_tensor()).expect("x has a gradient");
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let floor = 1e-3 * norm(&want.values().flatten().copied().collect::<Vec<_>>());
    let vars = varmap.data().lock().expect("varmap");
    let mut worst = rel_l2_error(&to_f64(&y), &want_y).max(rel_l2_error(&to_f64(dx), &want_dx));
    for (name, w) in &want {
        let got = to_f64(back.get(vars[name].as_tensor()).expect("parameter has a gradient"));
        let diff: Vec<f64> = got.iter().zip(w).map(|(a, b)| a - b).collect();
        worst = worst.max(norm(&diff) / norm(w).max(floor));
    }
    eprintln!("qk-LN candle vs reference, k_ln.weight[0] + {plant}: worst {worst:.2e} over {} gradients", want.len());
    worst
}

#[test]
fn qkln_layer_equals_the_reference_forward_and_backward() {
    let worst = worst_error(0.0);
    assert!(worst <= BOUND, "candle qk-LN layer off by {worst:.2e}");
}

#[test]
fn a_planted_k_ln_weight_fails_the_bound() {
    let worst = worst_error(0.05);
    assert!(worst > BOUND, "k_ln.weight[0] off by 0.05 passed ({worst:.2e})");
}
