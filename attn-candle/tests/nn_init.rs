//! Fresh candle-nn parameters are drawn as the definition's MAGNETO initialisation says
//! (xavier-normal with gain 1 for q/k and `linear1`, `gamma_init` for v/out/`linear2`,
//! the encoder-only gain for a stack; zero biases, unit norms), and `with_backend`
//! routes the attention through the given backend.

use std::sync::Arc;

use attn_candle::AnyAttention;
use attn_candle::nn::{LongNetEncoder, MultiheadDilatedAttention};
use attn_core::{
    Attention, AttnError, AttnInputs, AttnShape, DilatedConfig, Element, Grads, Pass, ReferenceBackend, Result, Saved,
    TensorView, TensorViewMut,
};
use attn_multihead::{EncoderConfig, MultiheadConfig};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

/// `(mean, standard deviation)` of a parameter.
fn moments(t: &Tensor) -> (f64, f64) {
    let v: Vec<f64> = t.flatten_all().and_then(|t| t.to_dtype(DType::F64)).and_then(|t| t.to_vec1()).expect("values");
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
    (mean, var.sqrt())
}

#[test]
fn fresh_parameters_follow_the_magneto_initialisation() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let gamma = 3.0;
    MultiheadDilatedAttention::new(
        MultiheadConfig::new(256, 4, DilatedConfig::new(&[8], &[1]).unwrap()).with_gamma_init(gamma),
        vb.pp("attn"),
    )
    .expect("layer");
    let layers = 6;
    LongNetEncoder::new(&EncoderConfig::new(64, 4, DilatedConfig::new(&[8], &[1]).unwrap(), 128), layers, vb.pp("enc"))
        .expect("encoder");
    let stack_gain = (2.0 * layers as f64).ln().sqrt();
    let xavier = |fan_in: usize, fan_out: usize, gain: f64| gain * (2.0 / (fan_in + fan_out) as f64).sqrt();
    let expected = [
        ("attn.q_proj.weight", xavier(256, 256, 1.0)),
        ("attn.k_proj.weight", xavier(256, 256, 1.0)),
        ("attn.v_proj.weight", xavier(256, 256, gamma)),
        ("attn.out_proj.weight", xavier(256, 256, gamma)),
        ("enc.layers.0.self_attn.q_proj.weight", xavier(64, 64, 1.0)),
        ("enc.layers.0.self_attn.v_proj.weight", xavier(64, 64, stack_gain)),
        ("enc.layers.5.self_attn.out_proj.weight", xavier(64, 64, stack_gain)),
        ("enc.layers.0.linear1.weight", xavier(64, 128, 1.0)),
        ("enc.layers.3.linear2.weight", xavier(128, 64, stack_gain)),
    ];
    let data = varmap.data().lock().expect("varmap");
    for (name, std) in expected {
        let (mean, got) = moments(data[name].as_tensor());
        // At least 4096 draws: the sample deviation is within 2% of its value (5 sigma).
        assert!((got / std - 1.0).abs() < 0.05, "{name}: std {got:.4}, want {std:.4}");
        assert!(mean.abs() < 0.1 * std, "{name}: mean {mean:.4}");
    }
    let mut biases = 0;
    for (name, var) in data.iter() {
        let (mean, std) = moments(var.as_tensor());
        let want = if name.contains("norm") && name.ends_with("weight") { 1.0 } else { 0.0 };
        if name.ends_with("bias") || name.contains("norm") {
            assert!(mean == want && std == 0.0, "{name}: mean {mean}, std {std}");
            biases += 1;
        }
    }
    // q, k, v, out and norm of the layer; and per encoder layer those, norm1-3 and both linears.
    assert_eq!(biases, 5 + 1 + layers * (5 + 1 + 3 * 2 + 2), "every bias and norm parameter checked");
}

/// A backend that refuses every call, naming itself.
#[derive(Debug)]
struct Refusing;

impl<T: Element> Attention<T> for Refusing {
    fn name(&self) -> &str {
        "refusing"
    }
    fn forward(&self, _: &AttnInputs<'_, T>, _: TensorViewMut<'_, T>, _: &mut [f32]) -> Result<()> {
        Err(AttnError::InvalidArgument("the refusing backend was called".into()))
    }
    fn backward_with_lse_grad(
        &self,
        _: &AttnInputs<'_, T>,
        _: Saved<'_, T>,
        _: TensorView<'_, T>,
        _: Option<&[f32]>,
        _: Grads<'_, T>,
    ) -> Result<()> {
        Err(AttnError::InvalidArgument("the refusing backend was called".into()))
    }
    fn workspace_bytes(&self, _: &DilatedConfig, _: AttnShape, _: Pass) -> usize {
        0
    }
}

#[test]
fn with_backend_computes_through_that_backend() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer =
        MultiheadDilatedAttention::new(MultiheadConfig::new(32, 4, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap()), vb)
            .expect("layer");
    let x = Tensor::randn(0f32, 1.0, (2, 16, 32), &Device::Cpu).expect("x");
    let default = layer.forward(&x).expect("default backend");
    let reference: Arc<dyn AnyAttention> = Arc::new(ReferenceBackend);
    let through = layer.clone().with_backend(reference).forward(&x).expect("reference backend");
    let diff = (default - through).and_then(|d| d.abs()).and_then(|d| d.flatten_all()).and_then(|d| d.max(0));
    assert!(diff.and_then(|d| d.to_scalar::<f32>()).expect("diff") < 1e-5);
    let refused = layer.with_backend(Arc::new(Refusing)).forward(&x).expect_err("the refusing backend");
    assert!(refused.to_string().contains("refusing backend was called"), "{refused}");
}
