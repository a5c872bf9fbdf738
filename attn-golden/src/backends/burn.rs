//! The burn op of `attn-burn` (feature `burn`) behind the f32 golden interface: inputs
//! as burn-flex tensors in the chosen dtype (f32, f64, bf16, f16), the forward through
//! the op and the gradients through burn's autodiff `backward()`.

use attn_burn::{AttnOptions, dilated_attention_with_lse};
use attn_core::{DType, Result};
use attn_testkit::golden::Problem;
use attn_testkit::{DilatedBackend, Forward32, Gradients32};
use burn_tensor::{Device, Tensor, TensorData};

pub struct BurnDilated {
    pub dtype: DType,
}

pub(super) fn burn_dtype(dtype: DType) -> burn_tensor::DType {
    match dtype {
        DType::F64 => burn_tensor::DType::F64,
        DType::BF16 => burn_tensor::DType::BF16,
        DType::F16 => burn_tensor::DType::F16,
        DType::F32 => burn_tensor::DType::F32,
    }
}

pub(super) fn values<const N: usize>(t: Tensor<N>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| attn_core::AttnError::backend("burn", format!("{e:?}")))
}

impl BurnDilated {
    /// Forward and autodiff backward of `sum(out * grad_out)`: out, LSE, dq, dk, dv.
    fn run(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<(Forward32, Gradients32)> {
        let device = Device::flex().autodiff();
        let dtype = burn_dtype(self.dtype);
        let tensor =
            |x: &[f32], dims: [usize; 4]| Tensor::<4>::from_data(TensorData::new(x.to_vec(), dims), (&device, dtype));
        let (qd, kd) = (p.shape.q.dims(), p.shape.kv.dims());
        let q = tensor(qkv[0], qd).require_grad();
        let k = tensor(qkv[1], kd).require_grad();
        let v = tensor(qkv[2], kd).require_grad();
        let opts = AttnOptions::new(p.cfg.clone()).with_masks(p.masks.into());
        let r = dilated_attention_with_lse(q.clone(), k.clone(), v.clone(), &opts)?;
        let grads = (r.out.clone() * tensor(grad_out, qd)).sum().backward();
        let grad = |t: &Tensor<4>, name: &str| match t.grad(&grads) {
            Some(g) => values(g),
            None => Err(attn_core::AttnError::backend("burn", format!("no gradient reached {name}"))),
        };
        let fwd = Forward32 { out: values(r.out)?, lse: values(r.lse)? };
        Ok((fwd, Gradients32 { dq: grad(&q, "q")?, dk: grad(&k, "k")?, dv: grad(&v, "v")? }))
    }
}

impl DilatedBackend for BurnDilated {
    fn name(&self) -> String {
        format!("burn-flex {}", self.dtype.as_str())
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn forward(&self, p: &Problem<'_>, qkv: [&[f32]; 3]) -> Result<Forward32> {
        Ok(self.run(p, qkv, &vec![0.0; p.shape.q.numel()])?.0)
    }
    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<Gradients32> {
        Ok(self.run(p, qkv, grad_out)?.1)
    }
}
