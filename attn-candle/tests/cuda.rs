//! The op on tensors of a CUDA device (feature `cuda`): the golden files through the CUDA
//! kernels in f32, bf16 and f16 and both layouts (forward, LSE and candle-autograd
//! gradients), the block-mask files too (the mask uploaded and read by the row kernels); random feature cases on the GPU within the f32 row bound of the same case
//! on the host (a planted error fails it); grouped K/V results and gradients stay on the
//! device and equal the host's; views that start off a 16-byte boundary give the output
//! bits of contiguous copies (gradients up to the order of f32 atomic adds); a host backend refuses CUDA tensors. Without a GPU each test skips, and fails under
//! `ATTN_REQUIRE_GPU=1`.

use crate::common;

use std::sync::Arc;

use attn_candle::{AttnOptions, attention_on, dilated_attention_with_lse};
use attn_core::DilatedConfig;
use attn_testkit::feature_case;
use attn_testkit::golden::{assert_attention_dirs_pass, assert_block_dir_passes};
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
fn block_mask_files_pass_on_a_cuda_device() {
    let Some(device) = gpu("block_mask_files_pass_on_a_cuda_device") else { return };
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for layout in [Layout::Bshd, Layout::Bhsd] {
            assert_block_dir_passes(&CandleOp { dtype, layout, device: device.clone() });
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
        // A gradient into the LSE too, in f32 and bf16, against the float64 reference.
        for dtype in [DType::F32, DType::BF16] {
            let op = CandleOp { dtype, layout, device: device.clone() };
            assert_eq!(attn_testkit::judge_lse_gradients(&op, &case), Ok(()), "case {i} {dtype:?}: {case:?}");
        }
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

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f32>()).expect("to the host")
}

/// `||got - want|| / ||want||`.
fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let sq = |it: &mut dyn Iterator<Item = f64>| it.map(|x| x * x).sum::<f64>().sqrt();
    sq(&mut got.iter().zip(want).map(|(a, b)| f64::from(a - b))) / sq(&mut want.iter().map(|&b| f64::from(b)))
}

/// out, lse and the gradients of `sum(out)` (dq, dk, dv) on `device`, of grouped K/V.
fn grouped_run(device: &Device, [q, k, v]: [&Tensor; 3]) -> [Tensor; 5] {
    let var = |x: &Tensor| candle_core::Var::from_tensor(&x.to_device(device).expect("copy")).expect("var");
    let (q, k, v) = (var(q), var(k), var(v));
    let r = dilated_attention_with_lse(q.as_tensor(), k.as_tensor(), v.as_tensor(), &options()).expect("runs");
    let grads = r.out.sum_all().and_then(|s| s.backward()).expect("backward");
    let grad = |x: &candle_core::Var| grads.get(x.as_tensor()).expect("a gradient").clone();
    [r.out, r.lse, grad(&q), grad(&k), grad(&v)]
}

#[test]
fn results_and_gradients_stay_on_the_device() {
    let Some(device) = gpu("results_and_gradients_stay_on_the_device") else { return };
    let host = |dims: &[usize]| Tensor::randn(0f32, 1.0, dims, &Device::Cpu).expect("tensor");
    let (q, k, v) = (host(&[2, 16, 4, 32]), host(&[2, 16, 2, 32]), host(&[2, 16, 2, 32]));
    let on_gpu = grouped_run(&device, [&q, &k, &v]);
    let on_host = grouped_run(&Device::Cpu, [&q, &k, &v]);
    let dims: [&[usize]; 5] = [&[2, 16, 4, 32], &[2, 16, 4], &[2, 16, 4, 32], &[2, 16, 2, 32], &[2, 16, 2, 32]];
    for (i, name) in ["out", "lse", "dq", "dk", "dv"].into_iter().enumerate() {
        let (g, h) = (&on_gpu[i], &on_host[i]);
        assert!(g.device().is_cuda(), "{name} left the device");
        assert_eq!((g.dims(), g.dtype()), (dims[i], DType::F32), "{name}");
        let (g, h) = (flat(g), flat(h));
        assert!(h.iter().any(|x| x.abs() > 1e-3), "{name} on the host is all zeros");
        // Rows a head's pattern leaves unselected attend nothing: their LSE is -inf on both
        // devices, and the error is taken over the finite values.
        let unattended = |x: &[f32]| x.iter().map(|v| *v == f32::NEG_INFINITY).collect::<Vec<_>>();
        assert_eq!(unattended(&g), unattended(&h), "{name}: the rows that attend nothing differ");
        let finite = |x: &[f32]| x.iter().copied().filter(|v| *v != f32::NEG_INFINITY).collect::<Vec<_>>();
        let (g, h) = (finite(&g), finite(&h));
        // The f32 bound of the golden files.
        let err = rel_l2(&g, &h);
        assert!(err <= 1e-5, "{name}: the GPU is {err:.2e} from the host");
    }
}

#[test]
fn views_off_a_16_byte_boundary_give_the_bits_of_copies() {
    let Some(device) = gpu("views_off_a_16_byte_boundary_give_the_bits_of_copies") else { return };
    let opts = options();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        // q, k, v cut from rows of 3 x 72 at columns 4, 74 and 150: 8, 4 and 12 bytes off a
        // 16-byte boundary in half precision, with strides that allow 16-byte loads.
        let x = Tensor::randn(0f32, 1.0, (2, 40, 4, 3 * 72), &device).and_then(|t| t.to_dtype(dtype)).expect("x");
        let x = candle_core::Var::from_tensor(&x).expect("var");
        let w = Tensor::randn(0f32, 1.0, (2, 40, 4, 64), &device).and_then(|t| t.to_dtype(dtype)).expect("w");
        let run = |copy: bool| -> [Vec<f32>; 3] {
            let cut = |at: usize| {
                let t = x.as_tensor().narrow(3, at, 64).expect("narrow");
                if copy { t.contiguous().expect("copy") } else { t }
            };
            let (q, k, v) = (cut(4), cut(74), cut(150));
            let r = dilated_attention_with_lse(&q, &k, &v, &opts).expect("runs");
            let grads = r.out.mul(&w).and_then(|t| t.sum_all()).and_then(|s| s.backward()).expect("backward");
            let gx = grads.get(x.as_tensor()).expect("a gradient");
            [flat(&r.out), flat(&r.lse), flat(gx)]
        };
        let ([out, lse, gx], [out_c, lse_c, gx_c]) = (run(false), run(true));
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!((bits(&out), bits(&lse)), (bits(&out_c), bits(&lse_c)), "{dtype:?}: out or lse differ");
        // The gradient up to the order of the backward's f32 atomic adds (then, in half
        // precision, a rounding that may flip an ulp).
        let bound = if dtype == DType::F32 { 1e-6 } else { 1e-3 };
        let err = rel_l2(&gx, &gx_c);
        assert!(err <= bound, "{dtype:?}: the views' gradient is {err:.2e} from the copies'");
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
    for (q, kv) in [(&x, &host), (&host, &x)] {
        let m = dilated_attention_with_lse(q, kv, kv, &options()).expect_err("mixed devices").to_string();
        assert!(m.contains("device"), "mixed devices: {m}");
    }
}
