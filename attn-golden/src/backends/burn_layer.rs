//! `kind=multihead` cases through attn-burn's `MultiheadDilatedAttention` (feature `burn`):
//! the case's PyTorch-named weights loaded into the burn layer on burn-flex in the chosen
//! dtype, the output on the plain device and the gradients of `sum(out * grad_out)` by
//! burn's autodiff (`d_query`, ... for inputs, `d.<name>` for parameters).

use attn_burn::AttnOptions;
use attn_burn::nn::{MultiheadDilatedAttention, param_grads};
use attn_core::{AttnError, DType, Result};
use attn_golden::prepare_case;
use attn_multihead::F32Tensors;
use attn_testkit::{GoldenCase, MultiheadBackend, MultiheadGrads32};
use burn_tensor::{Device, Tensor, TensorData};

use super::burn::{burn_dtype, values};

/// The burn layer in one dtype behind the golden interface.
pub struct BurnMultihead {
    pub dtype: DType,
}

/// Whether a run keeps gradients.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
}

impl BurnMultihead {
    fn run(&self, case: &GoldenCase, pass: Pass) -> Result<MultiheadGrads32> {
        let tensors = F32Tensors {
            tensors: case.tensors.iter().map(|(k, t)| (k.clone(), (t.shape.as_slice(), t.data.as_slice()))).collect(),
        };
        let prepared = prepare_case::<f32>(&case.meta, &tensors)?;
        let device = match pass {
            Pass::Forward => Device::flex(),
            Pass::Backward => Device::flex().autodiff(),
        };
        let dtype = burn_dtype(self.dtype);
        let layer =
            MultiheadDilatedAttention::from_weights(prepared.config.clone(), &prepared.weights, &device, dtype)?;
        let e = prepared.config.embed_dim;
        let tensor = |x: &[f32], seq: usize| {
            let t = Tensor::<3>::from_data(TensorData::new(x.to_vec(), [prepared.batch, seq, e]), (&device, dtype));
            if pass == Pass::Backward { t.require_grad() } else { t }
        };
        let query = tensor(&prepared.query, prepared.q_seq);
        let (key, value) = match &prepared.key_value {
            Some((k, v)) => (tensor(k, prepared.kv_seq), tensor(v, prepared.kv_seq)),
            None => (query.clone(), query.clone()),
        };
        let masks = AttnOptions::new(prepared.config.attention.clone()).with_masks(case.masks.clone());
        let out = layer.forward_cross(query.clone(), key.clone(), value.clone(), &masks)?;
        if pass == Pass::Forward {
            return Ok(MultiheadGrads32 { out: values(out)?, grads: vec![] });
        }
        let go = case.tensor("grad_out")?;
        let go = Tensor::<3>::from_data(
            TensorData::new(go.data.clone(), [prepared.batch, prepared.q_seq, e]),
            (&device, dtype),
        );
        let grads = (out.clone() * go).sum().cast(burn_tensor::DType::F32).backward();
        let grad = |t: &Tensor<3>, name: &str| match t.grad(&grads) {
            Some(g) => Ok((name.to_string(), values(g)?)),
            None => Err(AttnError::backend("burn", format!("no gradient reached {name}"))),
        };
        let mut named = vec![grad(&query, "d_query")?];
        if prepared.key_value.is_some() {
            named.extend([grad(&key, "d_key")?, grad(&value, "d_value")?]);
        }
        named.extend(param_grads(&layer, &grads)?.into_iter().map(|(n, g)| (format!("d.{n}"), g)));
        Ok(MultiheadGrads32 { out: values(out)?, grads: named })
    }
}

impl MultiheadBackend for BurnMultihead {
    fn name(&self) -> String {
        format!("multihead burn-flex {}", self.dtype.as_str())
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn forward(&self, case: &GoldenCase) -> Result<Vec<f32>> {
        Ok(self.run(case, Pass::Forward)?.out)
    }
    fn backward(&self, case: &GoldenCase) -> Result<MultiheadGrads32> {
        self.run(case, Pass::Backward)
    }
}
