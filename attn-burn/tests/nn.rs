//! The burn modules against the conformance files and against `attn-multihead`: the
//! multihead layer on `conformance/multihead`, `multihead_features` (forward) and
//! `multihead_grad` (output and every gradient) in every dtype flex stores; the encoder
//! stack's output and gradients against `attn-multihead`'s forward and backward with the
//! same MAGNETO weights; parameter paths are PyTorch's names.

use std::sync::Arc;

use crate::common::encoder::encoder_against_attn_multihead;
use crate::common::golden_op::DTYPES;
use crate::common::{grad_device, values};
use attn_burn::AttnOptions;
use attn_burn::nn::{Mode, MultiheadDilatedAttention};
use attn_burn::nn::{param_grads, param_values};
use attn_core::{DType as AttnDType, DilatedConfig, Result};
use attn_multihead::metadata::config_from_metadata;
use attn_multihead::{
    Call, EncoderConfig, ExtraTensors, F32Tensors, MultiheadConfig, MultiheadWeights, NamedParams, TensorSource,
    load_params,
};
use attn_testkit::golden::{
    CaseReport, GoldenCase, MultiheadBackend, MultiheadGrads32, check_case, golden_dir, load_dir,
};
use attn_testkit::{Tolerance, random_vec, rel_l2_error};
use burn_tensor::{DType, Device, Tensor, TensorData};

/// What a run computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// The output, on the plain flex device.
    Forward,
    /// The output and the gradients of `sum(out * grad_out)`, under autodiff.
    Backward,
}

/// The layer in one dtype behind the golden interface.
struct BurnLayer {
    dtype: (DType, AttnDType),
}

/// A case's layer config and weights (PyTorch names in the file).
fn prepared(case: &GoldenCase) -> Result<(MultiheadConfig, MultiheadWeights<f32>)> {
    let tensors = F32Tensors {
        tensors: case.tensors.iter().map(|(k, t)| (k.clone(), (t.shape.as_slice(), t.data.as_slice()))).collect(),
    };
    let config = config_from_metadata(&case.meta, tensors.tensor_shape("q_proj.bias").is_some().into())?;
    let mut weights = MultiheadWeights::magneto(&config, 0);
    load_params(&mut weights, &tensors, ExtraTensors::Ignore)?;
    Ok((config, weights))
}

impl BurnLayer {
    fn tensor3(&self, case: &GoldenCase, name: &str, device: &Device) -> Result<Tensor<3>> {
        let t = case.tensor(name)?;
        let dims: [usize; 3] =
            t.shape.as_slice().try_into().map_err(|_| {
                attn_core::AttnError::Format(format!("{}: `{name}` is not [batch, seq, embed]", case.name))
            })?;
        Ok(Tensor::from_data(TensorData::new(t.data.clone(), dims), (device, self.dtype.0)))
    }

    /// The layer's output on the case, and its gradients for [`Pass::Backward`].
    fn run(&self, case: &GoldenCase, pass: Pass) -> Result<MultiheadGrads32> {
        let device = &match pass {
            Pass::Forward => Device::flex(),
            Pass::Backward => grad_device(),
        };
        let (config, weights) = prepared(case)?;
        let layer = MultiheadDilatedAttention::from_weights(config.clone(), &weights, device, self.dtype.0)?;
        let masks = AttnOptions::new(config.attention.clone()).with_masks(case.masks.clone());
        let cross = case.meta.contains_key("cross_attention") && case.bool_meta("cross_attention")?;
        let input = |name: &str| {
            let t = self.tensor3(case, name, device)?;
            Ok::<_, attn_core::AttnError>(if pass == Pass::Backward { t.require_grad() } else { t })
        };
        let query = input("query")?;
        let (key, value) = match cross {
            true => (input("key")?, input("value")?),
            false => (query.clone(), query.clone()),
        };
        let out = layer.forward_cross(query.clone(), key.clone(), value.clone(), &masks)?;
        if pass == Pass::Forward {
            return Ok(MultiheadGrads32 { out: values(out), grads: vec![] });
        }
        let go = self.tensor3(case, "grad_out", device)?;
        let grads = (out.clone() * go).sum().cast(DType::F32).backward();
        let grad = |t: &Tensor<3>| t.grad(&grads).map(values).unwrap_or_default();
        let mut named = vec![("d_query".to_string(), grad(&query))];
        if cross {
            named.extend([("d_key".to_string(), grad(&key)), ("d_value".to_string(), grad(&value))]);
        }
        named.extend(param_grads(&layer, &grads)?.into_iter().map(|(n, g)| (format!("d.{n}"), g)));
        Ok(MultiheadGrads32 { out: values(out), grads: named })
    }
}

impl MultiheadBackend for BurnLayer {
    fn name(&self) -> String {
        format!("burn nn {}", self.dtype.1.as_str())
    }
    fn dtype(&self) -> AttnDType {
        self.dtype.1
    }
    fn forward(&self, case: &GoldenCase) -> Result<Vec<f32>> {
        Ok(self.run(case, Pass::Forward)?.out)
    }
    fn backward(&self, case: &GoldenCase) -> Result<MultiheadGrads32> {
        self.run(case, Pass::Backward)
    }
}

/// The files of `dir`, `count` of them.
fn cases(dir: &str, count: usize) -> Vec<GoldenCase> {
    let path = golden_dir().join(dir);
    let cases = load_dir(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(cases.len(), count, "the {count} files in {}", path.display());
    cases.into_iter().map(|(p, c)| c.unwrap_or_else(|e| panic!("{}: {e}", p.display()))).collect()
}

fn reports(backend: &dyn MultiheadBackend, cases: &[GoldenCase]) -> Vec<CaseReport> {
    cases.iter().map(|c| check_case(c, None, Some(backend))).collect()
}

#[test]
fn multihead_files_pass_through_the_burn_layer() {
    let all = [cases("multihead", 2), cases("multihead_features", 1), cases("multihead_grad", 3)].concat();
    let mut failed = Vec::new();
    for dtype in DTYPES {
        for report in reports(&BurnLayer { dtype }, &all) {
            println!("{report}");
            if !report.passed() {
                failed.push(report.to_string());
            }
        }
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

/// The qk-LN files' layout is refused by name (never a layer of the
/// sub-LN layout that happens to load).
#[test]
fn the_qkln_layout_is_refused_as_unsupported() {
    for case in cases("multihead_qkln", 2) {
        let err = prepared(&case)
            .and_then(|(config, weights)| {
                MultiheadDilatedAttention::from_weights(config, &weights, &grad_device(), DType::F32)
            })
            .expect_err("a qk-LN layer");
        assert!(
            matches!(
                err,
                attn_core::AttnError::Unsupported { feature: attn_core::Feature::Other("norm_layout qk_ln"), .. }
            ),
            "{}: {err}",
            case.name
        );
    }
}

/// A layer with a planted fault: `out_proj`'s weight scaled by `1 + 1e-3`.
struct PlantedOutProj(BurnLayer);

impl MultiheadBackend for PlantedOutProj {
    fn name(&self) -> String {
        "burn nn with out_proj off".into()
    }
    fn forward(&self, case: &GoldenCase) -> Result<Vec<f32>> {
        self.0.forward(&planted(case))
    }
    fn backward(&self, case: &GoldenCase) -> Result<MultiheadGrads32> {
        self.0.backward(&planted(case))
    }
}

fn planted(case: &GoldenCase) -> GoldenCase {
    let mut case = case.clone();
    if let Some(w) = case.tensors.get_mut("out_proj.weight") {
        w.data.iter_mut().for_each(|x| *x *= 1.001);
    }
    case
}

/// The same files fail with `out_proj`'s weight 0.1% off (the output and, in the
/// gradient files, the gradients move).
#[test]
fn a_planted_weight_error_fails_the_multihead_files() {
    let all = [cases("multihead", 2), cases("multihead_grad", 3)].concat();
    for report in reports(&PlantedOutProj(BurnLayer { dtype: DTYPES[0] }), &all) {
        assert!(!report.passed() && report.error.is_none(), "a wrong out_proj passed: {report}");
    }
}

pub fn encoder_config() -> EncoderConfig {
    let attention = DilatedConfig::builder().segments(&[8, 16]).dilations(&[1, 2]).build().expect("config");
    EncoderConfig::new(16, 2, attention, 32)
}

/// A two-layer stack's output and every gradient (input and parameters, by name) equal
/// `attn-multihead`'s forward and backward with the same MAGNETO weights, in f32.
#[test]
fn encoder_output_and_gradients_equal_attn_multihead() {
    encoder_against_attn_multihead(&encoder_config(), Mode::Eval);
}

/// MAGNETO initialisation: the burn layer's parameters are those `attn-multihead` draws for
/// the same seed, under the same names, and v and out are scaled by `gamma_init`.
#[test]
fn magneto_parameters_are_attn_multiheads_under_pytorch_names() {
    let attention = DilatedConfig::builder().segments(&[8]).dilations(&[1]).build().expect("config");
    let config = MultiheadConfig::new(64, 4, attention).with_gamma_init(2.0);
    let layer = MultiheadDilatedAttention::magneto(config.clone(), 5, &Device::flex(), DType::F32).expect("layer");
    let want = MultiheadWeights::<f32>::magneto(&config, 5);
    let mut want: Vec<(String, Vec<f32>)> = want.params().into_iter().map(|p| (p.name, p.data.to_vec())).collect();
    let mut got = param_values(&layer).expect("parameter values");
    got.sort_by(|a, b| a.0.cmp(&b.0));
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(got, want);
    let std = |name: &str| {
        let w = &got.iter().find(|p| p.0 == name).expect(name).1;
        (w.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / w.len() as f64).sqrt()
    };
    let ratio = std("v_proj.weight") / std("q_proj.weight");
    assert!((ratio - 2.0).abs() < 0.15, "v/q std ratio {ratio}");
}

/// A state_dict written by `attn-multihead` loads into the burn layer and reproduces
/// `attn-multihead`'s output; a file missing a parameter is a typed error naming it.
#[test]
fn safetensors_state_dicts_load() {
    let attention = DilatedConfig::builder().segments(&[8, 16]).dilations(&[1, 2]).build().expect("config");
    let config = MultiheadConfig::new(32, 4, attention);
    let weights = MultiheadWeights::<f32>::magneto(&config, 9);
    let dir = std::env::temp_dir().join(format!("attn-burn-nn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("layer.safetensors");
    attn_multihead::save_file(&weights, &path, None).expect("save");
    let layer = MultiheadDilatedAttention::load_file(config.clone(), &path, &Device::flex(), DType::F32).expect("load");
    let backend = Arc::new(attn_kernels::CpuBackend::new(1).expect("cpu backend"));
    let native = attn_multihead::MultiheadDilatedAttention::from_weights(config.clone(), weights.clone(), backend)
        .expect("layer");
    let x = random_vec(3, 2 * 16 * 32);
    let want = native.forward(&x, &Call::new(2, 16)).expect("forward");
    let xt = Tensor::<3>::from_data(TensorData::new(x, [2, 16, 32]), &Device::flex());
    let got = values(layer.forward(xt, &AttnOptions::new(config.attention.clone())).expect("burn forward"));
    assert!(rel_l2_error(&got, &want) <= Tolerance::for_dtype(AttnDType::F32).rel_l2);

    let mut partial = weights.clone();
    partial.norm = None;
    attn_multihead::save_file(&partial, &path, None).expect("save");
    let err = MultiheadDilatedAttention::load_file(config, &path, &Device::flex(), DType::F32).expect_err("no norm");
    std::fs::remove_dir_all(&dir).expect("remove");
    assert!(err.to_string().contains("norm.weight"), "{err}");
}
