//! Bad input is a typed `AttnError`, never a panic: mixed dtypes, shapes that disagree,
//! masks that do not fit, k and v off q's backend or autodiff context, tensors of a
//! backend the op does not compute on (burn-ndarray).

use crate::common::{Layout, tensor4};
use attn_burn::{AttnOptions, SUPPORTED_BACKENDS, dilated_attention};
use attn_core::{AttnError, DilatedConfig, Feature, KeyPaddingMask, TensorName};
use burn_tensor::{DType, Device, Tensor};

fn config() -> DilatedConfig {
    DilatedConfig::builder().segments(&[4]).dilations(&[1]).build().expect("config")
}

fn input(dims: [usize; 4], dtype: DType, device: &Device) -> Tensor<4> {
    let n = dims.iter().product::<usize>();
    let values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    tensor4(&values, dims, dtype, Layout::Bshd, device)
}

#[test]
fn mixed_dtypes_are_a_dtype_mismatch() {
    let device = Device::flex();
    let q = input([1, 8, 2, 4], DType::F32, &device);
    let k = input([1, 8, 2, 4], DType::BF16, &device);
    let v = input([1, 8, 2, 4], DType::F32, &device);
    let err = dilated_attention(q, k, v, &AttnOptions::new(config())).expect_err("mixed dtypes");
    assert!(matches!(err, AttnError::DTypeMismatch { tensor: TensorName::Key, .. }), "{err:?}");
}

#[test]
fn disagreeing_shapes_are_errors() {
    let device = Device::flex().autodiff();
    let q = input([1, 8, 2, 4], DType::F32, &device).require_grad();
    let k = input([1, 8, 2, 8], DType::F32, &device);
    let v = input([1, 8, 2, 4], DType::F32, &device);
    let err = dilated_attention(q, k, v, &AttnOptions::new(config())).expect_err("head dims differ");
    assert!(matches!(err, AttnError::ShapeMismatch { .. }), "{err:?}");
}

#[test]
fn a_padding_mask_of_the_wrong_size_is_an_error() {
    let device = Device::flex();
    let [q, k, v] = [0; 3].map(|_| input([1, 8, 2, 4], DType::F32, &device));
    let mask = KeyPaddingMask::new(vec![false; 5], 1, 5).expect("mask");
    let err = dilated_attention(q, k, v, &AttnOptions::new(config()).with_key_padding(mask)).expect_err("mask");
    assert!(matches!(err, AttnError::ShapeMismatch { tensor: TensorName::KeyPaddingMask, .. }), "{err:?}");
}

#[test]
fn k_outside_qs_autodiff_context_is_an_error() {
    let (plain, grad) = (Device::flex(), Device::flex().autodiff());
    let q = input([1, 8, 2, 4], DType::F32, &grad).require_grad();
    let k = input([1, 8, 2, 4], DType::F32, &plain);
    let v = input([1, 8, 2, 4], DType::F32, &grad);
    let err = dilated_attention(q, k, v, &AttnOptions::new(config())).expect_err("k without autodiff");
    assert!(matches!(err, AttnError::InvalidArgument(ref m) if m.contains("k is not on q")), "{err:?}");
}

#[test]
fn a_quantized_q_is_a_dtype_mismatch() {
    let device = Device::flex();
    let scheme = burn_tensor::quantization::QuantScheme::default();
    let q = input([1, 8, 2, 4], DType::F32, &device).quantize_dynamic(&scheme);
    let [k, v] = [0; 2].map(|_| input([1, 8, 2, 4], DType::F32, &device));
    let err = dilated_attention(q, k, v, &AttnOptions::new(config())).expect_err("quantized q");
    assert!(matches!(err, AttnError::DTypeMismatch { tensor: TensorName::Query, .. }), "{err:?}");
}

/// burn-ndarray, with and without autodiff: a backend the op does not compute on, refused
/// with an error naming the supported ones.
#[test]
#[allow(deprecated)] // `Device::ndarray`: burn deprecates the backend, which is why it serves here
fn tensors_of_another_backend_are_unsupported_naming_the_supported_ones() {
    for device in [Device::ndarray(), Device::ndarray().autodiff()] {
        let [q, k, v] = [0; 3].map(|_| input([1, 8, 2, 4], DType::F32, &device));
        let err = dilated_attention(q, k, v, &AttnOptions::new(config())).expect_err("an ndarray tensor");
        assert!(
            matches!(err, AttnError::Unsupported { backend: "burn", feature: Feature::Other(SUPPORTED_BACKENDS) }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("burn-flex") && msg.contains("f32, f64, bf16, f16"), "{msg}");
    }
}
