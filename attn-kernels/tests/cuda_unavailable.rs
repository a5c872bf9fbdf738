//! Without a GPU (or NVRTC) every CUDA entry point returns a typed error instead of
//! panicking; with one, bad inputs are typed errors too. Runs on every machine; with
//! `ATTN_REQUIRE_GPU=1` a missing GPU or library is a failure naming it.
#![cfg(feature = "cuda")]

use attn_core::error::TensorName;
use attn_core::{Attention, AttnInputs};
use attn_core::{AttnError, DilatedConfig, Shape4, TensorView, TensorViewMut};
use attn_kernels::cuda::{CudaBackend, CudaDevice, check_available, driver_library_present};
use attn_testkit::gpu_policy::{GpuPolicy, required_failure, skip_gpu_test};

#[test]
fn missing_device_is_a_typed_error() {
    match check_available(10_000) {
        Err(AttnError::BackendUnavailable { backend: "cuda", reason }) => println!("cuda unavailable: {reason}"),
        other => panic!("device 10000 cannot exist: {other:?}"),
    }
    match CudaDevice::new(0) {
        Ok(dev) => println!("GPU present: sm_{}{}", dev.compute_capability().0, dev.compute_capability().1),
        Err(AttnError::BackendUnavailable { backend: "cuda", reason }) => {
            println!("no GPU: {reason}");
            if let Some(msg) = required_failure("missing_device_is_a_typed_error", &reason, GpuPolicy::from_env()) {
                panic!("{msg}");
            }
        }
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

/// The driver check is the library's own (not cudarc's, which only exists when cudarc
/// loads libcuda at run time): without the driver, opening a device says so.
#[test]
fn a_missing_driver_is_named() {
    if driver_library_present() {
        return println!("libcuda loads here");
    }
    match check_available(0) {
        Err(AttnError::BackendUnavailable { backend: "cuda", reason }) => {
            assert!(reason.contains("libcuda"), "{reason}")
        }
        other => panic!("no libcuda here, yet: {other:?}"),
    }
}

#[test]
fn bad_inputs_are_typed_errors_on_a_gpu() {
    let dev = match CudaDevice::new(0) {
        Ok(dev) => dev,
        Err(e) => return skip_gpu_test("bad_inputs_are_typed_errors_on_a_gpu", e),
    };
    let cfg = DilatedConfig::new(&[4, 8], &[1, 2]).unwrap();
    let s = Shape4::new(1, 8, 1, 300).unwrap();
    let x = vec![0.0f32; s.numel()];
    let v = TensorView::contiguous(TensorName::Query, &x, s).unwrap();
    let mut o = vec![0.0f32; s.numel()];
    let mut lse = vec![0.0f32; s.lse_len()];
    let gpu = CudaBackend::on(dev);
    // 1 head < 2 head groups, then head_dim 300 > 256 with LongNet.
    let ov = TensorViewMut::contiguous(TensorName::Output, &mut o, s).unwrap();
    let r = gpu.forward(&AttnInputs::new(&cfg, v, v, v), ov, &mut lse);
    assert!(matches!(r, Err(AttnError::TooFewHeads { .. })), "{r:?}");
    let ln =
        DilatedConfig::builder().segments(&[4]).dilations(&[1]).mixing(attn_core::Mixing::LongNet).build().unwrap();
    let ov = TensorViewMut::contiguous(TensorName::Output, &mut o, s).unwrap();
    let r = gpu.forward(&AttnInputs::new(&ln, v, v, v), ov, &mut lse);
    assert!(matches!(r, Err(AttnError::InvalidArgument(_))), "{r:?}");
}
