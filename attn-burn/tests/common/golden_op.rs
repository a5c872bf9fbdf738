//! The op in one dtype and layout behind the testkit's golden interface
//! ([`DilatedBackend`]): the forward on the plain flex device, the gradients (into the
//! output, and into the LSE too for `backward_lse`) by burn's autodiff `backward()`.

use attn_burn::AttnOptions;
use attn_core::DType as AttnDType;
use attn_testkit::golden::{DilatedBackend, Forward32, Gradients32, Problem};
use burn_tensor::{DType, Device};

use super::{Inputs, Layout, attend_op, run_inputs, tensor4, values};

/// The burn dtypes and the testkit's names for them.
pub const DTYPES: [(DType, AttnDType); 4] = [
    (DType::F32, AttnDType::F32),
    (DType::F64, AttnDType::F64),
    (DType::BF16, AttnDType::BF16),
    (DType::F16, AttnDType::F16),
];

/// The op in one dtype and layout.
#[derive(Debug, Clone, Copy)]
pub struct BurnOp {
    pub dtype: (DType, AttnDType),
    pub layout: Layout,
}

/// The problem's config and masks.
pub fn options(p: &Problem<'_>) -> AttnOptions {
    AttnOptions::new(p.cfg.clone()).with_masks(p.masks.into())
}

/// The run inputs of a problem's tensors.
pub fn problem_inputs<'a>(
    p: &Problem<'_>,
    qkv: [&'a [f32]; 3],
    grad_out: &'a [f32],
    grad_lse: Option<&'a [f32]>,
) -> Inputs<'a> {
    Inputs { qkv, grad_out, grad_lse, dims: [p.shape.q.dims(), p.shape.kv.dims()] }
}

impl BurnOp {
    /// The gradients of `sum(out * grad_out)` plus `sum(lse * grad_lse)` where given.
    fn gradients(
        &self,
        p: &Problem<'_>,
        qkv: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: Option<&[f32]>,
    ) -> attn_core::Result<Gradients32> {
        let opts = options(p);
        let f = |q, k, v| attend_op(&opts, q, k, v);
        let inputs = problem_inputs(p, qkv, grad_out, grad_lse);
        let [dq, dk, dv] = run_inputs(inputs, &f, self.dtype.0, self.layout)?.grads;
        Ok(Gradients32 { dq, dk, dv })
    }
}

impl DilatedBackend for BurnOp {
    fn name(&self) -> String {
        format!("burn-flex {} {:?}", self.dtype.1.as_str(), self.layout).to_lowercase()
    }
    fn dtype(&self) -> AttnDType {
        self.dtype.1
    }
    fn forward(&self, p: &Problem<'_>, [q, k, v]: [&[f32]; 3]) -> attn_core::Result<Forward32> {
        let device = Device::flex();
        let (qd, kd) = (p.shape.q.dims(), p.shape.kv.dims());
        let t = |x: &[f32], dims| tensor4(x, dims, self.dtype.0, self.layout, &device);
        let r = attn_burn::dilated_attention_with_lse(t(q, qd), t(k, kd), t(v, kd), &options(p))?;
        Ok(Forward32 { out: values(r.out), lse: values(r.lse) })
    }
    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> attn_core::Result<Gradients32> {
        self.gradients(p, qkv, grad_out, None)
    }
    fn backward_lse(
        &self,
        p: &Problem<'_>,
        qkv: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: &[f32],
    ) -> attn_core::Result<Gradients32> {
        self.gradients(p, qkv, grad_out, Some(grad_lse))
    }
}
