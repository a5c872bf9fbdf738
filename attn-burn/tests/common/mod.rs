//! Shared helpers: burn tensors from the test inputs in a chosen dtype and layout, and
//! one forward plus backward of the op (or of any function of q, k, v) under autodiff.

pub mod compose;
pub mod encoder;
pub mod golden_op;
pub mod ring;

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

/// What a function of q, k, v returns: the output, the LSE as a tensor (differentiable
/// where the function makes it so) and the LSE's values as the run reports them.
pub struct Attended {
    pub out: Tensor<4>,
    pub lse: Tensor<3>,
    pub lse_values: Vec<f32>,
}

/// What a run differentiates.
pub type Attend<'a> = dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Result<Attended, AttnError> + 'a;

/// The tensors of one run, row-major f32: q `[b, n, h, d]`, k and v `[b, m, kv_heads, d]`
/// (`dims`: q's and k's), the gradient into the output and the one into the LSE (`[b,
/// n, h]`; `None`: the loss does not use the LSE).
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    pub qkv: [&'a [f32]; 3],
    pub grad_out: &'a [f32],
    pub grad_lse: Option<&'a [f32]>,
    pub dims: [[usize; 4]; 2],
}

/// `f` on the case's inputs in `dtype` and `layout`, and the gradients of
/// `sum(out * grad_out)` (plus `sum(lse * grad_lse)` where given) by burn's autodiff.
pub fn run_with(
    case: &FeatureCase,
    f: &Attend<'_>,
    grad_lse: Option<&[f32]>,
    dtype: DType,
    layout: Layout,
) -> Result<Run, AttnError> {
    let [q, k, v, go] = case.inputs();
    let dims = [case.shape.q.dims(), case.shape.kv.dims()];
    run_inputs(Inputs { qkv: [&q, &k, &v], grad_out: &go, grad_lse, dims }, f, dtype, layout)
}

/// `f` on `inputs` in `dtype` and `layout` under autodiff, and the gradients of
/// `sum(out * grad_out)` (plus `sum(lse * grad_lse)` where given, in f32) by burn's
/// autodiff.
pub fn run_inputs(inputs: Inputs<'_>, f: &Attend<'_>, dtype: DType, layout: Layout) -> Result<Run, AttnError> {
    let device = grad_device();
    let ([q, k, v], [qd, kd]) = (inputs.qkv, inputs.dims);
    let q = tensor4(q, qd, dtype, layout, &device).require_grad();
    let k = tensor4(k, kd, dtype, layout, &device).require_grad();
    let v = tensor4(v, kd, dtype, layout, &device).require_grad();
    let go = tensor4(inputs.grad_out, qd, dtype, Layout::Bshd, &device);
    let Attended { out, lse, lse_values } = f(q.clone(), k.clone(), v.clone())?;
    let mut loss = (out.clone() * go).sum().cast(DType::F32);
    if let Some(gl) = inputs.grad_lse {
        let [b, n, h, _] = qd;
        let gl = Tensor::<3>::from_data(TensorData::new(gl.to_vec(), [b, n, h]), (&device, DType::F32));
        loss = loss + (lse * gl).sum();
    }
    let grads = loss.backward();
    let grad = |t: &Tensor<4>| values(t.grad(&grads).expect("a gradient"));
    Ok(Run { out: values(out), lse: lse_values, grads: [grad(&q), grad(&k), grad(&v)] })
}

/// The op's output and LSE (both differentiable).
pub fn attend_op(opts: &AttnOptions, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Result<Attended, AttnError> {
    let r = attn_burn::dilated_attention_with_lse(q, k, v, opts)?;
    Ok(Attended { out: r.out, lse_values: values(r.lse.clone()), lse: r.lse })
}

/// The op on the case, the loss using the LSE where `grad_lse` is given.
pub fn run_op_lse(
    case: &FeatureCase,
    grad_lse: Option<&[f32]>,
    dtype: DType,
    layout: Layout,
) -> Result<Run, AttnError> {
    let opts = options(case);
    run_with(case, &|q, k, v| attend_op(&opts, q, k, v), grad_lse, dtype, layout)
}

/// The op on the case.
pub fn run_op(case: &FeatureCase, dtype: DType, layout: Layout) -> Result<Run, AttnError> {
    run_op_lse(case, None, dtype, layout)
}

/// `got` against `want` (f32 runs, both of the loss with `grad_lse` where given) with
/// the f32 row bounds, magnitudes from the float64 reference.
pub fn agree(case: &FeatureCase, grad_lse: Option<&[f32]>, got: &Run, want: &Run) -> Result<(), String> {
    let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
    let [q, k, v, go] = case.inputs().map(|x| wide(&x));
    let p = case.problem();
    let expected = match grad_lse {
        None => Expected::for_problem(&p, [&q, &k, &v], Some(&go)),
        Some(gl) => Expected::for_problem_lse(&p, [&q, &k, &v], &go, &wide(gl)),
    };
    let mut expected = expected.map_err(|e| e.to_string())?;
    expected.fwd.out = wide(&want.out);
    expected.fwd.lse = wide(&want.lse);
    [expected.grads.dq, expected.grads.dk, expected.grads.dv] = want.grads.each_ref().map(|g| wide(g));
    judge_run(&expected, got, AttnDType::F32)
}

/// The case's gradient into the LSE ([`FeatureCase::grad_lse`]), 0 on the rows whose
/// LSE (`lse`, a run's) is `-inf`: rows with no key, which take none of it.
pub fn grad_lse_of(case: &FeatureCase, lse: &[f32]) -> Vec<f32> {
    case.grad_lse().into_iter().zip(lse).map(|(g, l)| if l.is_finite() { g } else { 0.0 }).collect()
}

/// Every row of `got` within `dtype`'s row bound of `want`.
pub fn judge_run(want: &Expected, got: &Run, dtype: AttnDType) -> Result<(), String> {
    let mut rows = judge_forward(want, &got.out, &got.lse, dtype);
    let [dq, dk, dv] = &got.grads;
    rows.extend(judge_backward(want, [dq, dk, dv], dtype));
    verdict(&rows)
}
