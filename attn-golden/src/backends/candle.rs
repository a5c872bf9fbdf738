//! The candle op of `attn-candle` (feature `candle`) behind the f32 golden interface:
//! inputs rounded to the chosen dtype as candle tensors, the forward through the op and
//! the gradients through candle's `backward()`; multihead cases through its candle-nn layer.

use attn_candle::nn::{LayerCall, MultiheadDilatedAttention};
use attn_candle::{AttnOptions, InputLayout, dilated_attention_with_lse, run_buffers};
use attn_core::{AttnError, DType, Result};
use attn_multihead::Bias;
use attn_multihead::metadata::config_from_metadata;
use attn_testkit::golden::Problem;
use attn_testkit::{DilatedBackend, Forward32, Gradients32};
use candle_core::Tensor;

pub struct CandleDilated {
    pub dtype: DType,
}

fn candle_dtype(dtype: DType) -> candle_core::DType {
    match dtype {
        DType::BF16 => candle_core::DType::BF16,
        DType::F16 => candle_core::DType::F16,
        _ => candle_core::DType::F32,
    }
}

impl CandleDilated {
    /// Forward and `backward()` of `sum(out * grad_out)` on the problem.
    fn run(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<attn_candle::BufferRun> {
        let opts = AttnOptions::new(p.cfg.clone()).with_masks(p.masks.into());
        let attend = |q: &Tensor, k: &Tensor, v: &Tensor| {
            let r = dilated_attention_with_lse(q, k, v, &opts)?;
            Ok((r.out, r.lse.flatten_all()?.to_vec1()?))
        };
        let dims = [p.shape.q.dims(), p.shape.kv.dims()];
        run_buffers(attend, qkv, dims, grad_out, (candle_dtype(self.dtype), InputLayout::Bshd))
            .map_err(|e| AttnError::backend("candle", e.to_string()))
    }
}

impl DilatedBackend for CandleDilated {
    fn name(&self) -> String {
        format!("candle {}", self.dtype.as_str())
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn forward(&self, p: &Problem<'_>, qkv: [&[f32]; 3]) -> Result<Forward32> {
        let r = self.run(p, qkv, &vec![0.0; p.shape.q.numel()])?;
        Ok(Forward32 { out: r.out, lse: r.lse })
    }
    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<Gradients32> {
        let [dq, dk, dv] = self.run(p, qkv, grad_out)?.grads;
        Ok(Gradients32 { dq, dk, dv })
    }
}

/// `kind=multihead` cases through the candle-nn layer of `attn-candle`: the case's
/// PyTorch-named weights through a `VarBuilder`, the forward in f32 on the CPU kernels.
pub struct CandleMultihead;

fn candle_err(e: candle_core::Error) -> AttnError {
    AttnError::backend("candle", e.to_string())
}

/// A case's inputs and weights as candle variables (so `backward()` reaches them all) and
/// its layer's output: `(name, variable)` pairs, the file's names (`query`, `key`,
/// `value`, `q_proj.weight`, ...), and the output.
fn run_layer(case: &attn_testkit::GoldenCase) -> Result<(Vec<(String, candle_core::Var)>, Tensor)> {
    let device = candle_core::Device::Cpu;
    let var = |name: &str| -> Result<(String, candle_core::Var)> {
        let t = case.tensor(name)?;
        let v = candle_core::Var::from_slice(&t.data, t.shape.as_slice(), &device).map_err(candle_err)?;
        Ok((name.to_string(), v))
    };
    let cross = case.bool_meta("cross_attention").unwrap_or(false);
    let inputs: &[&str] = if cross { &["query", "key", "value"] } else { &["query"] };
    let mut vars = inputs.iter().map(|n| var(n)).collect::<Result<Vec<_>>>()?;
    let params =
        case.tensors.keys().filter(|k| !k.starts_with("d.") && (k.ends_with(".weight") || k.ends_with(".bias")));
    let params = params.map(|n| var(n)).collect::<Result<Vec<_>>>()?;
    let weights = params.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    let bias = if case.tensors.contains_key("q_proj.bias") { Bias::Zeros } else { Bias::Absent };
    let config = config_from_metadata(&case.meta, bias)?;
    let vb = candle_nn::VarBuilder::from_tensors(weights, candle_core::DType::F32, &device);
    let layer = MultiheadDilatedAttention::new(config.clone(), vb).map_err(candle_err)?;
    let mut opts = AttnOptions::new(config.attention.clone());
    if let Some(mask) = case.masks.key_padding() {
        opts = opts.with_key_padding(mask.clone());
    }
    let t = |i: usize| vars[i].1.as_tensor();
    let call = LayerCall::new().masks(&opts);
    let out = layer.forward_with(t(0), &if cross { call.cross(t(1), t(2)) } else { call });
    let out = out.map_err(candle_err)?;
    vars.extend(params);
    Ok((vars, out))
}

impl attn_testkit::MultiheadBackend for CandleMultihead {
    fn name(&self) -> String {
        "multihead candle f32".into()
    }
    fn forward(&self, case: &attn_testkit::GoldenCase) -> Result<Vec<f32>> {
        let (_, out) = run_layer(case)?;
        out.flatten_all().and_then(|t| t.to_vec1()).map_err(candle_err)
    }
    /// candle's `backward()` of `sum(out * grad_out)` through the layer: the gradient of
    /// every input (`d_query`, ...) and parameter (`d.<name>`).
    fn backward(&self, case: &attn_testkit::GoldenCase) -> Result<attn_testkit::MultiheadGrads32> {
        let (vars, out) = run_layer(case)?;
        let go = case.tensor("grad_out")?;
        let go = Tensor::from_slice(&go.data, go.shape.as_slice(), out.device()).map_err(candle_err)?;
        let grads = (&out * &go).and_then(|l| l.sum_all()).and_then(|l| l.backward()).map_err(candle_err)?;
        let mut named = Vec::new();
        for (name, var) in &vars {
            let g = grads
                .get(var.as_tensor())
                .ok_or_else(|| AttnError::backend("candle", format!("backward() gave no gradient for `{name}`")))?;
            let name = if name.contains('.') { format!("d.{name}") } else { format!("d_{name}") };
            named.push((name, g.flatten_all().and_then(|t| t.to_vec1()).map_err(candle_err)?));
        }
        let out = out.flatten_all().and_then(|t| t.to_vec1()).map_err(candle_err)?;
        Ok(attn_testkit::MultiheadGrads32 { out, grads: named })
    }
}
