//! [`DilatedAttentionBackend`] for burn-flex: the call's compute backend (the CPU kernels,
//! a ring rank) reads flex's host storage in place when a tensor's layout has unit
//! head_dim stride and no negative stride (contiguous BSHD, a transposed BHSD tensor, a
//! narrowed fused projection); other layouts are first made contiguous. Every float dtype flex stores (f32, f64,
//! bf16, f16) computes; the LSE is f32.

use attn_core::{
    Attention, AttnError, AttnInputs, AttnShape, Grads, Saved, Shape4, TensorName, TensorView, TensorViewMut,
};
use burn_backend::{DType, TensorData};
use burn_flex::{Flex, FlexTensor};
use half::{bf16, f16};

use crate::backend::{AttnPrimitives, DilatedAttentionBackend, InputGrads, SavedForward, Upstream};
use crate::compute::Compute;
use crate::options::AttnOptions;

/// An element type of both the kernels and flex's storage.
trait FlexElement: attn_core::Element + burn_backend::Element + bytemuck::Pod {}

impl FlexElement for f32 {}
impl FlexElement for f64 {}
impl FlexElement for bf16 {}
impl FlexElement for f16 {}

/// The dtypes the op computes on flex, for messages.
const FLEX_DTYPES: &str = "f32, f64, bf16 or f16";

/// `t` itself when the kernels can read its layout in place (no negative stride, unit
/// stride along head_dim), else a contiguous copy.
fn readable(t: FlexTensor) -> FlexTensor {
    let layout = t.layout();
    let dims = layout.shape().as_slice();
    let strides = layout.strides();
    let negative = dims.iter().zip(strides).any(|(&d, &s)| d > 1 && s < 0);
    let inner_ok = dims.last().is_none_or(|&d| d <= 1) || strides.last() == Some(&1);
    if negative || !inner_ok { t.to_contiguous() } else { t }
}

/// The `[batch, seq, heads, head_dim]` view of `t` over its storage (a layout
/// [`readable`] returned). A dimension of size 1 may carry any stride; it is taken as 1.
fn view<'a, T: FlexElement>(name: TensorName, t: &'a FlexTensor) -> attn_core::Result<TensorView<'a, T>> {
    let layout = t.layout();
    let shape = Shape4::from_dims(name, layout.shape().as_slice())?;
    let mut strides = [1usize; 4];
    for ((st, &s), &d) in strides.iter_mut().zip(layout.strides()).zip(&shape.dims()) {
        if d > 1 {
            *st =
                usize::try_from(s).map_err(|_| AttnError::InvalidArgument(format!("{name} has a negative stride")))?;
        }
    }
    let storage = t.storage::<T>();
    let start = layout.start_offset();
    let data =
        storage.get(start..).ok_or(AttnError::BufferTooSmall { tensor: name, len: storage.len(), needed: start })?;
    TensorView::strided(name, data, shape, strides)
}

/// The checked shapes of a call's q, k and v. The masks are the compute backend's to
/// check: a ring rank's rows do not have the global length its packed sequences and
/// block mask describe.
fn call_shape<T: FlexElement>(inputs: &AttnInputs<'_, T>) -> attn_core::Result<AttnShape> {
    let [q, k, v] = [&inputs.q, &inputs.k, &inputs.v].map(|x| x.shape().dims());
    AttnShape::of_call(inputs.cfg, [&q[..], &k[..], &v[..]])
}

/// The name of a dtype, for messages.
fn dtype_name(dtype: DType) -> String {
    format!("{dtype:?}").to_lowercase()
}

/// Checks that `t` has q's dtype `want`.
fn same_dtype(name: TensorName, t: &FlexTensor, want: DType) -> attn_core::Result<()> {
    if t.dtype() == want {
        return Ok(());
    }
    let expected = match want {
        DType::F64 => "f64 (q's dtype)",
        DType::BF16 => "bf16 (q's dtype)",
        DType::F16 => "f16 (q's dtype)",
        _ => "f32 (q's dtype)",
    };
    Err(AttnError::DTypeMismatch { tensor: name, expected, got: dtype_name(t.dtype()) })
}

/// A flex tensor owning `values` laid out row-major in `dims`.
fn tensor_of<T: FlexElement>(values: Vec<T>, dims: &[usize]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, dims.to_vec()))
}

fn forward_t<T: FlexElement>(
    compute: &dyn Attention<T>,
    [q, k, v]: [&FlexTensor; 3],
    options: &AttnOptions,
) -> attn_core::Result<AttnPrimitives<Flex>> {
    let (qv, kv, vv) =
        (view::<T>(TensorName::Query, q)?, view::<T>(TensorName::Key, k)?, view::<T>(TensorName::Value, v)?);
    let inputs = AttnInputs::new(&options.config, qv, kv, vv).with_masks(options.masks());
    let shape = call_shape(&inputs)?;
    let mut out = vec![T::default(); shape.q.numel()];
    let mut lse = vec![0f32; shape.q.lse_len()];
    let out_view = TensorViewMut::contiguous(TensorName::Output, &mut out, shape.q)?;
    compute.forward(&inputs, out_view, &mut lse)?;
    let [b, s, h, _] = shape.q.dims();
    Ok(AttnPrimitives { out: tensor_of(out, &shape.q.dims()), lse: tensor_of(lse, &[b, s, h]) })
}

/// The f32 values of the LSE-shaped tensor `t` (`name`: the LSE or its gradient), `len`
/// of them.
fn lse_values(name: TensorName, t: &FlexTensor, len: usize) -> attn_core::Result<FlexTensor> {
    if t.dtype() != DType::F32 {
        return Err(AttnError::DTypeMismatch { tensor: name, expected: "f32", got: dtype_name(t.dtype()) });
    }
    let t = t.clone().to_contiguous();
    if t.storage::<f32>().len() != len {
        let got = t.layout().shape().as_slice().to_vec();
        return Err(AttnError::ShapeMismatch { tensor: name, expected: vec![len], got });
    }
    Ok(t)
}

fn backward_t<T: FlexElement>(
    compute: &dyn Attention<T>,
    saved: &SavedForward<Flex>,
    [grad_out, grad_lse]: [Option<&FlexTensor>; 2],
    options: &AttnOptions,
) -> attn_core::Result<InputGrads<Flex>> {
    let qv = view::<T>(TensorName::Query, &saved.q)?;
    let (kv, vv) = (view::<T>(TensorName::Key, &saved.k)?, view::<T>(TensorName::Value, &saved.v)?);
    let inputs = AttnInputs::new(&options.config, qv, kv, vv).with_masks(options.masks());
    let shape = call_shape(&inputs)?;
    let out = view::<T>(TensorName::Output, &saved.out)?;
    // No gradient into the output is a zero one.
    let zeros = vec![T::default(); if grad_out.is_none() { shape.q.numel() } else { 0 }];
    let grad = match grad_out {
        Some(g) => view::<T>(TensorName::GradOutput, g)?,
        None => TensorView::contiguous(TensorName::GradOutput, &zeros, shape.q)?,
    };
    let lse_t = lse_values(TensorName::Lse, &saved.lse, shape.q.lse_len())?;
    let lse: &[f32] = lse_t.storage::<f32>();
    let grad_lse = grad_lse.map(|g| lse_values(TensorName::GradLse, g, shape.q.lse_len())).transpose()?;
    let mut dq = vec![T::default(); shape.q.numel()];
    let (mut dk, mut dv) = (vec![T::default(); shape.kv.numel()], vec![T::default(); shape.kv.numel()]);
    let grads = Grads::contiguous(shape, [&mut dq, &mut dk, &mut dv])?;
    let gl = grad_lse.as_ref().map(|g| g.storage::<f32>());
    compute.backward_with_lse_grad(&inputs, Saved { out, lse }, grad, gl, grads)?;
    let (qd, kd) = (shape.q.dims(), shape.kv.dims());
    Ok(InputGrads { dq: tensor_of(dq, &qd), dk: tensor_of(dk, &kd), dv: tensor_of(dv, &kd) })
}

/// q's dtype, checked against k's and v's and against the dtypes the kernels compute.
fn common_dtype(q: &FlexTensor, k: &FlexTensor, v: &FlexTensor) -> attn_core::Result<DType> {
    let dtype = q.dtype();
    if !matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16) {
        return Err(AttnError::DTypeMismatch {
            tensor: TensorName::Query,
            expected: FLEX_DTYPES,
            got: dtype_name(dtype),
        });
    }
    same_dtype(TensorName::Key, k, dtype)?;
    same_dtype(TensorName::Value, v, dtype)?;
    Ok(dtype)
}

impl DilatedAttentionBackend for Flex {
    fn dilated_attention_with_lse(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        options: &AttnOptions,
        compute: &Compute,
    ) -> attn_core::Result<AttnPrimitives<Flex>> {
        let dtype = common_dtype(&q, &k, &v)?;
        let host = compute.host()?;
        let qkv = [&readable(q), &readable(k), &readable(v)];
        match dtype {
            DType::F64 => forward_t::<f64>(host, qkv, options),
            DType::BF16 => forward_t::<bf16>(host, qkv, options),
            DType::F16 => forward_t::<f16>(host, qkv, options),
            _ => forward_t::<f32>(host, qkv, options),
        }
    }

    fn dilated_attention_backward(
        saved: SavedForward<Flex>,
        upstream: Upstream<Flex>,
        options: &AttnOptions,
        compute: &Compute,
    ) -> attn_core::Result<InputGrads<Flex>> {
        let dtype = common_dtype(&saved.q, &saved.k, &saved.v)?;
        let host = compute.host()?;
        same_dtype(TensorName::Output, &saved.out, dtype)?;
        if let Some(g) = &upstream.grad_out {
            same_dtype(TensorName::GradOutput, g, dtype)?;
        }
        let saved = SavedForward {
            q: readable(saved.q),
            k: readable(saved.k),
            v: readable(saved.v),
            out: readable(saved.out),
            lse: saved.lse,
        };
        let grad_out = upstream.grad_out.map(readable);
        let grads = [grad_out.as_ref(), upstream.grad_lse.as_ref()];
        match dtype {
            DType::F64 => backward_t::<f64>(host, &saved, grads, options),
            DType::BF16 => backward_t::<bf16>(host, &saved, grads, options),
            DType::F16 => backward_t::<f16>(host, &saved, grads, options),
            _ => backward_t::<f32>(host, &saved, grads, options),
        }
    }
}
