//! Shared helpers: burn tensors from the test inputs in a chosen dtype and layout, and
//! one forward plus backward of the op (or of any function of q, k, v) under autodiff.

pub mod compose;

use attn_burn::{AttnOptions, OwnedMasks};
use attn_core::{AttnError, DType as AttnDType, KeyPaddingMask};
use attn_testkit::FeatureCase;
use attn_testkit::judge::{Expected, judge_backward, judge_forward, verdict};
use burn_tensor::{DType, Device, Tensor, TensorData};

/// How q, k, v are laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Contiguous `[batch, seq, heads, head_dim]`.
    Bshd,
    /// Contiguous `[batch, heads, seq, head_dim]`, handed over transposed (a strided view).
    Bhsd,
}

/// Out, LSE and gradients of one run, as f32.
#[derive(Debug, Clone)]
pub struct Run {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
    pub grads: [Vec<f32>; 3],
}

/// The autodiff flex device.
pub fn grad_device() -> Device {
    Device::flex().autodiff()
}

/// A `[b, s, h, d]` tensor of `values` (row-major in that order) in `dtype` and `layout`
/// (checked: burn would otherwise fall back to the device's default dtype unnoticed).
pub fn tensor4(values: &[f32], dims: [usize; 4], dtype: DType, layout: Layout, device: &Device) -> Tensor<4> {
    let [b, s, h, d] = dims;
    let t = match layout {
        Layout::Bshd => Tensor::<4>::from_data(TensorData::new(values.to_vec(), dims), (device, dtype)),
        Layout::Bhsd => {
            let mut t = vec![0f32; values.len()];
            for (i, &x) in values.iter().enumerate() {
                let (bi, si, hi, di) = (i / (s * h * d), i / (h * d) % s, i / d % h, i % d);
                t[((bi * h + hi) * s + si) * d + di] = x;
            }
            Tensor::<4>::from_data(TensorData::new(t, [b, h, s, d]), (device, dtype)).swap_dims(1, 2)
        }
    };
    assert_eq!(t.dtype(), dtype, "burn created the tensor in another dtype");
    t
}

/// The values of `t` as f32, row-major.
pub fn values<const N: usize>(t: Tensor<N>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().expect("f32 values")
}

/// The case's options: its config and masks.
pub fn options(case: &FeatureCase) -> AttnOptions {
    let mut masks = OwnedMasks::none();
    if let Some(p) = &case.padding {
        let kv = case.shape.kv;
        masks = masks.with_key_padding(KeyPaddingMask::new(p.clone(), kv.batch, kv.seq).expect("sized mask"));
    }
    if let Some(cu) = &case.cu_seqlens {
        masks = masks.with_cu_seqlens(cu.clone()).expect("valid cu_seqlens");
    }
    AttnOptions::new(case.cfg.clone()).with_masks(masks)
}

/// What a run differentiates: `f(q, k, v)` returns the output and the LSE.
pub type Attend<'a> = dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Result<(Tensor<4>, Vec<f32>), AttnError> + 'a;

/// `f` on the case's inputs in `dtype` and `layout`, and the gradients of
/// `sum(out * grad_out)` by burn's autodiff.
pub fn run_with(case: &FeatureCase, f: &Attend<'_>, dtype: DType, layout: Layout) -> Result<Run, AttnError> {
    let device = grad_device();
    let [q, k, v, go] = case.inputs();
    let (qd, kd) = (case.shape.q.dims(), case.shape.kv.dims());
    let q = tensor4(&q, qd, dtype, layout, &device).require_grad();
    let k = tensor4(&k, kd, dtype, layout, &device).require_grad();
    let v = tensor4(&v, kd, dtype, layout, &device).require_grad();
    let go = tensor4(&go, qd, dtype, Layout::Bshd, &device);
    let (out, lse) = f(q.clone(), k.clone(), v.clone())?;
    let grads = (out.clone() * go).sum().backward();
    let grad = |t: &Tensor<4>| values(t.grad(&grads).expect("a gradient"));
    Ok(Run { out: values(out), lse, grads: [grad(&q), grad(&k), grad(&v)] })
}

/// The op on the case.
pub fn run_op(case: &FeatureCase, dtype: DType, layout: Layout) -> Result<Run, AttnError> {
    let opts = options(case);
    let f = |q, k, v| {
        let r = attn_burn::dilated_attention_with_lse(q, k, v, &opts)?;
        Ok((r.out, values(r.lse)))
    };
    run_with(case, &f, dtype, layout)
}

/// `got` against `want` (f32 runs) with the f32 row bounds, magnitudes from the float64
/// reference.
pub fn agree(case: &FeatureCase, got: &Run, want: &Run) -> Result<(), String> {
    let [q, k, v, go] = case.inputs().map(|x| x.into_iter().map(f64::from).collect::<Vec<_>>());
    let mut expected = Expected::for_problem(&case.problem(), [&q, &k, &v], Some(&go)).map_err(|e| e.to_string())?;
    let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
    expected.fwd.out = wide(&want.out);
    expected.fwd.lse = wide(&want.lse);
    [expected.grads.dq, expected.grads.dk, expected.grads.dv] = want.grads.each_ref().map(|g| wide(g));
    judge_run(&expected, got, AttnDType::F32)
}

/// Every row of `got` within `dtype`'s row bound of `want`.
pub fn judge_run(want: &Expected, got: &Run, dtype: AttnDType) -> Result<(), String> {
    let mut rows = judge_forward(want, &got.out, &got.lse, dtype);
    let [dq, dk, dv] = &got.grads;
    rows.extend(judge_backward(want, [dq, dk, dv], dtype));
    verdict(&rows)
}
