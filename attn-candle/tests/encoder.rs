//! The candle-nn `LongNetEncoderLayer` and `LongNetEncoder` equal `attn-multihead`'s
//! (float64, reference backend) on the same weights, in evaluation and in training with
//! dropout (the same seed draws the same masks): the reference's named parameters go
//! through a safetensors checkpoint into a candle `VarMap`, and the outputs, the input
//! gradients and every parameter gradient agree within float32 rounding. A planted error
//! in one weight, or another dropout seed, fails the same bounds.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use attn_candle::nn::{LongNetEncoder, LongNetEncoderLayer};
use attn_core::{DilatedConfig, Mixing};
use attn_multihead::{Call, EncoderConfig, Mode, NamedParams, ReferenceBackend, layer_mode, save_bytes};
use attn_testkit::rng::SeededRng;
use attn_testkit::tolerance::rel_l2_error;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

type Reference = attn_multihead::LongNetEncoder<f64>;

/// Output, input gradient and parameter gradients: float32 from candle against
/// float64, relative L2. Measured: output and input gradient below 4e-7, parameter
/// gradients below 9e-6 (the key bias's, measured against its floor, is the largest).
const OUT_BOUND: f64 = 1e-5;
const DX_BOUND: f64 = 1e-5;
const PARAM_BOUND: f64 = 5e-5;

const BATCH: usize = 2;
const SEQ: usize = 16;

/// Which candle module the reference's weights are loaded into.
#[derive(Debug, Clone, Copy)]
enum Stack {
    /// One `LongNetEncoderLayer` (names without the `layers.0.` prefix).
    Layer,
    /// A `LongNetEncoder` of this many layers.
    Encoder(usize),
}

/// A weight changed in the candle copy only.
#[derive(Debug, Clone, Copy)]
enum Plant {
    None,
    /// `delta` added to the first element of the named parameter.
    Add(&'static str, f64),
}

/// Relative errors of the candle module against the reference.
#[derive(Debug)]
struct Errors {
    out: f64,
    dx: f64,
    /// The largest over the parameters.
    dparams: f64,
    params_checked: usize,
}

/// Dropout of the training runs: every site drops about a quarter of its values.
const DROPOUT: f64 = 0.25;

fn config(mixing: Mixing, causal: bool) -> EncoderConfig {
    let attention =
        DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).mixing(mixing).causality(causal.into());
    let mut c = EncoderConfig::new(16, 4, attention.build().unwrap(), 32);
    c.dropout = DROPOUT;
    c
}

/// How the two sides run: the reference's mode and the candle module's.
#[derive(Debug, Clone, Copy)]
struct Modes {
    reference: Mode,
    candle: Mode,
}

const EVAL: Modes = Modes { reference: Mode::Eval, candle: Mode::Eval };
const TRAIN: Modes = Modes { reference: Mode::Train { seed: 77 }, candle: Mode::Train { seed: 77 } };

/// The candle module under test.
enum Module {
    Layer(Box<LongNetEncoderLayer>),
    Encoder(LongNetEncoder),
}

impl Module {
    fn forward(&self, x: &Tensor, mode: Mode) -> candle_core::Result<Tensor> {
        match self {
            Module::Layer(l) => l.forward_with_mode(x, mode),
            Module::Encoder(e) => e.forward_with_mode(x, mode),
        }
    }
}

/// The reference stack, its biases and norm parameters moved off their zero/one init
/// so that every parameter's role shows in the output.
fn reference(cfg: &EncoderConfig, layers: usize, seed: u64) -> Reference {
    let mut enc = Reference::new(cfg.clone(), layers, seed, Arc::new(ReferenceBackend)).expect("reference encoder");
    let mut rng = SeededRng::new(seed ^ 0xB1A5);
    for p in enc.params_mut() {
        if p.name.ends_with("bias") || p.name.contains("norm") {
            p.data.iter_mut().for_each(|x| *x += 0.2 * rng.normal());
        }
    }
    enc
}

/// The names a `Stack::Layer` module uses: layer 0's, prefix removed.
fn local_name(stack: Stack, name: &str) -> String {
    match stack {
        Stack::Layer => name.strip_prefix("layers.0.").expect("layer 0 parameter").to_string(),
        Stack::Encoder(_) => name.to_string(),
    }
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    t.flatten_all().and_then(|t| t.to_dtype(DType::F64)).and_then(|t| t.to_vec1()).expect("values")
}

fn measure(mixing: Mixing, causal: bool, stack: Stack, plant: Plant, modes: Modes) -> Errors {
    let cfg = config(mixing, causal);
    let layers = match stack {
        Stack::Layer => 1,
        Stack::Encoder(n) => n,
    };
    let enc = reference(&cfg, layers, 11);
    let e = cfg.d_model;
    let mut rng = SeededRng::new(5);
    let x: Vec<f64> = (0..BATCH * SEQ * e).map(|_| rng.normal()).collect();
    let g: Vec<f64> = (0..BATCH * SEQ * e).map(|_| rng.normal()).collect();

    // Reference forward and backward.
    let (want_y, cache) =
        enc.forward_train(&x, &Call::new(BATCH, SEQ).mode(modes.reference)).expect("reference forward");
    let mut grads = enc.zero_grads();
    let want_dx = enc.backward(&cache, &g, &mut grads).expect("reference backward");
    let want_dparams: HashMap<String, Vec<f64>> = grads
        .iter()
        .enumerate()
        .flat_map(|(i, lg)| lg.params().into_iter().map(move |p| (format!("layers.{i}.{}", p.name), p.data.to_vec())))
        .collect();

    // The checkpoint, as a candle user would read it.
    let bytes = save_bytes(&enc, None).expect("save checkpoint");
    let file = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).expect("load checkpoint");
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let module = match stack {
        Stack::Layer => Module::Layer(Box::new(LongNetEncoderLayer::new(&cfg, vb).expect("candle layer"))),
        Stack::Encoder(n) => Module::Encoder(LongNetEncoder::new(&cfg, n, vb).expect("candle encoder")),
    };
    let mut varmap = varmap;
    let file: HashMap<String, Tensor> = file.into_iter().map(|(k, v)| (local_name(stack, &k), v)).collect();
    let names = |m: &HashMap<String, Tensor>| m.keys().cloned().collect::<BTreeSet<_>>();
    let created: BTreeSet<String> = varmap.data().lock().expect("varmap").keys().cloned().collect();
    assert_eq!(created, names(&file), "the candle module uses exactly the checkpoint's names");
    for (name, t) in &file {
        let mut t = t.to_dtype(DType::F32).expect("f32");
        if let Plant::Add(target, delta) = plant
            && name == target
        {
            let mut v = to_f64(&t);
            v[0] += delta;
            t = Tensor::from_vec(v, t.shape(), &Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).expect("planted");
        }
        varmap.set_one(name, &t).expect("set parameter");
    }

    let xs: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let gs: Vec<f32> = g.iter().map(|&v| v as f32).collect();
    let xv = Var::from_vec(xs, (BATCH, SEQ, e), &Device::Cpu).expect("x");
    let gt = Tensor::from_vec(gs, (BATCH, SEQ, e), &Device::Cpu).expect("g");
    // A lone layer runs in the mode the reference stack gives its layer 0.
    let mode = match stack {
        Stack::Layer => layer_mode(modes.candle, 0),
        Stack::Encoder(_) => modes.candle,
    };
    let y = module.forward(xv.as_tensor(), mode).expect("candle forward");
    let backward = y.mul(&gt).and_then(|t| t.sum_all()).and_then(|l| l.backward()).expect("candle backward");
    let dx = backward.get(xv.as_tensor()).expect("x has a gradient");

    // Per parameter, relative to its own norm or, for a gradient that vanishes in exact
    // arithmetic (the key bias: softmax ignores a per-row shift), to 1e-3 of the norm of
    // all parameter gradients.
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let floor = 1e-3 * norm(&want_dparams.values().flatten().copied().collect::<Vec<_>>());
    let vars = varmap.data().lock().expect("varmap");
    let mut dparams: f64 = 0.0;
    for (name, want) in &want_dparams {
        let var = &vars[&local_name(stack, name)];
        let got = to_f64(backward.get(var.as_tensor()).expect("parameter has a gradient"));
        let diff: Vec<f64> = got.iter().zip(want).map(|(g, w)| g - w).collect();
        dparams = dparams.max(norm(&diff) / norm(want).max(floor));
    }
    let e = Errors {
        out: rel_l2_error(&to_f64(&y), &want_y),
        dx: rel_l2_error(&to_f64(dx), &want_dx),
        dparams,
        params_checked: want_dparams.len(),
    };
    eprintln!("{mixing:?} causal={causal} {stack:?} {plant:?} {modes:?}: {e:?}");
    e
}

fn assert_within(what: &str, e: &Errors) {
    assert!(e.out <= OUT_BOUND, "{what}: output off by {:.2e} (bound {OUT_BOUND:.0e})", e.out);
    assert!(e.dx <= DX_BOUND, "{what}: input gradient off by {:.2e} (bound {DX_BOUND:.0e})", e.dx);
    assert!(
        e.dparams <= PARAM_BOUND,
        "{what}: a parameter gradient off by {:.2e} (bound {PARAM_BOUND:.0e})",
        e.dparams
    );
}

#[test]
fn encoder_layer_equals_attn_multihead() {
    for (mixing, causal, modes) in [(Mixing::HeadGroups, false, EVAL), (Mixing::LongNet, true, TRAIN)] {
        let e = measure(mixing, causal, Stack::Layer, Plant::None, modes);
        assert_eq!(e.params_checked, 20, "every parameter of the layer");
        assert_within(&format!("layer {mixing:?} causal={causal} {modes:?}"), &e);
    }
}

#[test]
fn encoder_stack_equals_attn_multihead() {
    for (mixing, causal, modes) in [(Mixing::HeadGroups, false, TRAIN), (Mixing::LongNet, true, EVAL)] {
        let e = measure(mixing, causal, Stack::Encoder(2), Plant::None, modes);
        assert_eq!(e.params_checked, 2 * 20, "every parameter of both layers");
        assert_within(&format!("encoder {mixing:?} causal={causal} {modes:?}"), &e);
    }
}

#[test]
fn another_dropout_seed_or_evaluation_fails_the_bounds() {
    let other = Modes { reference: Mode::Train { seed: 77 }, candle: Mode::Train { seed: 78 } };
    let eval = Modes { reference: Mode::Train { seed: 77 }, candle: Mode::Eval };
    for modes in [other, eval] {
        let e = measure(Mixing::HeadGroups, false, Stack::Encoder(2), Plant::None, modes);
        assert!(e.out > OUT_BOUND, "{modes:?}: output error {:.2e} within the bound", e.out);
        assert!(e.dx > DX_BOUND, "{modes:?}: input gradient error {:.2e} within the bound", e.dx);
    }
}

#[test]
fn a_planted_weight_error_fails_the_bounds() {
    // 1e-3 on one element of the last layer's norm, of the first layer's sub-LN and of
    // its first feed-forward weight: each moves output and gradients beyond the bounds.
    for (name, delta) in
        [("layers.1.norm3.weight", 1e-3), ("layers.0.self_attn.norm.bias", 1e-3), ("layers.0.linear1.weight", 1e-3)]
    {
        let e = measure(Mixing::LongNet, true, Stack::Encoder(2), Plant::Add(name, delta), TRAIN);
        assert!(e.out > OUT_BOUND, "{name} + {delta}: output error {:.2e} within the bound", e.out);
        assert!(e.dx > DX_BOUND, "{name} + {delta}: input gradient error {:.2e} within the bound", e.dx);
        assert!(e.dparams > PARAM_BOUND, "{name} + {delta}: gradient error {:.2e} within the bound", e.dparams);
    }
}
