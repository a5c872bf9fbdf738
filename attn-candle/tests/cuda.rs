//! The op on tensors of a CUDA device (feature `cuda`): the golden files through the CUDA
//! kernels in f32, bf16 and f16 and both layouts (forward, LSE and candle-autograd
//! gradients); random feature cases on the GPU within the f32 row bound of the same case
//! on the host (a planted error fails it); results stay on the device; a host backend
//! refuses CUDA tensors. Without a GPU each test skips, and fails under
//! `ATTN_REQUIRE_GPU=1`.

use crate::common;

use std::sync::Arc;

use attn_candle::{AttnOptions, attention_on, dilated_attention_with_lse};
use attn_core::DilatedConfig;
use attn_testkit::feature_case;
use attn_testkit::golden::assert_attention_dirs_pass;
use attn_testkit::skip_gpu_test;
use candle_core::{DType, Device, Tensor};
use common::{CandleOp, Layout, agree, run_op, run_op_on};
use proptest::strategy::{Strategy, ValueTree};

/// CUDA device 0, or `None` after a skip (a failure under `ATTN_REQUIRE_GPU=1`).
fn gpu(test: &str) -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            skip_gpu_test(test, e);
            None
        }
    }
}

#[test]
fn golden_files_pass_on_a_cuda_device() {
    let Some(device) = gpu("golden_files_pass_on_a_cuda_device") else { return };
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for layout in [Layout::Bshd, Layout::Bhsd] {
            assert_attention_dirs_pass(&CandleOp { dtype, layout, device: device.clone() });
        }
    }
}

#[test]
fn random_feature_cases_on_the_gpu_match_the_host() {
    let Some(device) = gpu("random_feature_cases_on_the_gpu_match_the_host") else { return };
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = feature_case(1..=40, 8, vec![1, 4, 8]);
    for i in 0..32 {
        let case = strategy.new_tree(&mut runner).expect("a case").current();
        let [q, k, v, go] = case.inputs();
        let layout = if i % 2 == 0 { Layout::Bshd } else { Layout::Bhsd };
        let problem = case.problem();
        let on_gpu = run_op_on(&device, &problem, [&q, &k, &v], &go, DType::F32, layout).expect("runs on the GPU");
        let on_host = run_op(&problem, [&q, &k, &v], &go, DType::F32, layout).expect("runs on the host");
        assert_eq!(agree(&case, &on_gpu, &on_host), Ok(()), "case {i}: {case:?}");
        if i == 0 {
            let mut bad = on_gpu.clone();
            let at = bad.out.iter().position(|x| x.abs() > 0.1).expect("a sizeable output");
            bad.out[at] *= 1.05;
            assert!(agree(&case, &bad, &on_host).is_err(), "a planted output error passed");
        }
    }
}

fn options() -> AttnOptions {
    AttnOptions::new(DilatedConfig::builder().segments(&[4, 8]).dilations(&[1, 2]).build().expect("config"))
}

#[test]
fn results_and_gradients_stay_on_the_device() {
    let Some(device) = gpu("results_and_gradients_stay_on_the_device") else { return };
    let var = |dims: &[usize]| candle_core::Var::randn(0f32, 1.0, dims, &device).expect("var");
    let (q, k, v) = (var(&[2, 16, 4, 32]), var(&[2, 16, 2, 32]), var(&[2, 16, 2, 32]));
    let r = dilated_attention_with_lse(q.as_tensor(), k.as_tensor(), v.as_tensor(), &options()).expect("runs");
    assert!(r.out.device().is_cuda() && r.lse.device().is_cuda());
    assert_eq!(r.lse.dims(), &[2, 16, 4]);
    assert_eq!(r.lse.dtype(), DType::F32);
    let grads = r.out.sum_all().and_then(|s| s.backward()).expect("backward");
    for (x, dims) in [(&q, [2, 16, 4, 32]), (&k, [2, 16, 2, 32]), (&v, [2, 16, 2, 32])] {
        let g = grads.get(x.as_tensor()).expect("a gradient");
        assert!(g.device().is_cuda(), "a gradient left the device");
        assert_eq!(g.dims(), &dims);
    }
}

#[test]
fn a_host_backend_refuses_cuda_tensors_and_devices_must_agree() {
    let Some(device) = gpu("a_host_backend_refuses_cuda_tensors_and_devices_must_agree") else { return };
    let x = Tensor::randn(0f32, 1.0, (1, 8, 2, 4), &device).expect("tensor");
    let backend = Arc::new(attn_kernels::CpuBackend::new(1).expect("cpu"));
    let m = attention_on(backend, &x, &x, &x, &options()).expect_err("a host backend on CUDA tensors").to_string();
    assert!(m.contains("host backend"), "{m}");
    let host = x.to_device(&Device::Cpu).expect("copy");
    assert!(dilated_attention_with_lse(&x, &host, &host, &options()).is_err(), "mixed devices were accepted");
}
