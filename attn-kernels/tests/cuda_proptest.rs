//! Property tests on the GPU: random valid configs (both mixing modes, causal, ragged
//! tails, `w > n`) against the float64 reference and against the CPU backend (f16, bf16),
//! and the block API (LSE-merging key blocks in any order) against the whole call. Skips
//! with a printed reason without a GPU.
#![cfg(feature = "cuda")]

mod cuda_support;

use attn_core::DType;
use attn_core::reference;
use attn_kernels::cuda::{DevicePartial, DeviceTensor, finish_forward, forward_block};
use attn_testkit::strategies::dilated_case;
use attn_testkit::{DilatedBackend, Tolerance, mixed_error, rel_l2_error};
use cuda_support::{Gpu, conv, device_or_skip};
use half::bf16;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

fn runner() -> TestRunner {
    TestRunner::new(Config { cases: 48, max_shrink_iters: 64, ..Config::default() })
}

#[test]
fn forward_and_backward_match_the_reference() {
    let Some(dev) = device_or_skip("forward_and_backward_match_the_reference") else { return };
    let (f32_gpu, bf16_gpu) = (Gpu::<f32>::new(dev.clone()), Gpu::<bf16>::new(dev));
    runner()
        .run(&dilated_case(), |case| {
            let shape = case.attn_shape();
            let [q, k, v, go] = case.inputs();
            let (fwd, grads) =
                reference::dilated_backward(&case.cfg, shape, &to64(&q), &to64(&k), &to64(&v), &to64(&go))
                    .expect("valid case");
            let tol32 = Tolerance::for_dtype(attn_core::DType::F32).rel_l2;
            let got = f32_gpu.forward(&case.cfg, shape, &q, &k, &v).expect("gpu f32 forward");
            prop_assert!(rel_l2_error(&got.out, &fwd.out) <= tol32, "out {:?}", case);
            let lse_ok = got.lse.iter().zip(&fwd.lse).all(|(a, b)| {
                (a.is_infinite() && b.is_infinite()) || ((*a as f64) - b).abs() <= 1e-4 * (1.0 + b.abs())
            });
            prop_assert!(lse_ok, "lse {:?}", case);
            let g = f32_gpu.backward(&case.cfg, shape, &q, &k, &v, &go).expect("gpu f32 backward");
            for (name, a, b) in [("dq", &g.dq, &grads.dq), ("dk", &g.dk, &grads.dk), ("dv", &g.dv, &grads.dv)] {
                prop_assert!(rel_l2_error(a, b) <= tol32, "{name}: {} {:?}", rel_l2_error(a, b), case);
            }
            // bf16: against the reference on the bf16-rounded inputs, by the mixed bound
            // (an output whose terms cancel is judged by their magnitudes).
            let (want, mag) = rounded_reference::<bf16>(&case.cfg, shape, [&q, &k, &v, &go]);
            let got = bf16_gpu.forward(&case.cfg, shape, &q, &k, &v).expect("gpu bf16 forward");
            let tol16 = Tolerance::for_dtype(DType::BF16);
            let err = mixed_error(&got.out, &want.out, &mag.out, tol16, DType::BF16);
            prop_assert!(err <= 1.0, "bf16 out at {err:.3} of the bound: {:?}", case);
            Ok(())
        })
        .unwrap();
}

/// The GPU and the CPU backend agree in f16 and bf16 (forward and gradients). Each is
/// within the dtype's mixed bound of the exact result, so they are within twice of each
/// other: twice the relative tolerance plus twice the magnitudes' term.
#[test]
fn half_precision_matches_the_cpu_backend() {
    let Some(dev) = device_or_skip("half_precision_matches_the_cpu_backend") else { return };
    let cpu = attn_kernels::CpuBackend::new(2).expect("cpu backend");
    let (g16, gb16) = (Gpu::<half::f16>::new(dev.clone()), Gpu::<bf16>::new(dev));
    runner()
        .run(&dilated_case(), |case| {
            let shape = case.attn_shape();
            let [q, k, v, go] = case.inputs();
            for (gpu, dtype) in [(&g16 as &dyn DilatedBackend, attn_core::DType::F16), (&gb16, attn_core::DType::BF16)]
            {
                let bound = Tolerance { rel_l2: 2.0 * Tolerance::for_dtype(dtype).rel_l2 };
                let ((cpu_out, cpu_grads), (_, mag)) = match dtype {
                    DType::F16 => (
                        cpu_run::<half::f16>(&cpu, &case.cfg, shape.q, &q, &k, &v, &go),
                        rounded_reference::<half::f16>(&case.cfg, shape, [&q, &k, &v, &go]),
                    ),
                    _ => (
                        cpu_run::<bf16>(&cpu, &case.cfg, shape.q, &q, &k, &v, &go),
                        rounded_reference::<bf16>(&case.cfg, shape, [&q, &k, &v, &go]),
                    ),
                };
                let twice = |m: &[f64]| m.iter().map(|x| 2.0 * x).collect::<Vec<f64>>();
                let got = gpu.forward(&case.cfg, shape, &q, &k, &v).expect("gpu forward");
                let err = mixed_error(&got.out, &to64(&cpu_out), &twice(&mag.out), bound, dtype);
                prop_assert!(err <= 1.0, "{dtype:?} out at {err:.3} of the bound: {:?}", case);
                let g = gpu.backward(&case.cfg, shape, &q, &k, &v, &go).expect("gpu backward");
                for (name, a, b, m) in [
                    ("dq", &g.dq, &cpu_grads[0], &mag.dq),
                    ("dk", &g.dk, &cpu_grads[1], &mag.dk),
                    ("dv", &g.dv, &cpu_grads[2], &mag.dv),
                ] {
                    let err = mixed_error(a, &to64(b), &twice(m), bound, dtype);
                    prop_assert!(err <= 1.0, "{dtype:?} {name} at {err:.3} of the bound: {:?}", case);
                }
            }
            Ok(())
        })
        .unwrap();
}

/// The float64 reference and its magnitudes on the inputs `[q, k, v, grad_out]` rounded
/// to `T`, so that only a kernel's own error is measured.
fn rounded_reference<T: attn_core::Element>(
    cfg: &attn_core::DilatedConfig,
    shape: attn_core::AttnShape,
    inputs: [&[f32]; 4],
) -> (reference::Forward, reference::Magnitudes) {
    let [q, k, v, go] = inputs.map(|x| x.iter().map(|&y| T::from_f32(y).to_f64()).collect::<Vec<f64>>());
    let (fwd, _, mag) = reference::dilated_backward_with_magnitudes(cfg, shape, &q, &k, &v, &go).expect("valid case");
    (fwd, mag)
}

/// CPU backend in dtype `T`: (out, [dq, dk, dv]) as f32.
fn cpu_run<T: attn_core::Element>(
    cpu: &attn_kernels::CpuBackend,
    cfg: &attn_core::DilatedConfig,
    shape: attn_core::Shape4,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    go: &[f32],
) -> (Vec<f32>, [Vec<f32>; 3]) {
    let c = |x: &[f32]| -> Vec<T> { x.iter().map(|&y| T::from_f32(y)).collect() };
    let b = |x: &[T]| -> Vec<f32> { x.iter().map(|y| y.to_f32()).collect() };
    let (q, k, v, go) = (c(q), c(k), c(v), c(go));
    let (out, lse) = cpu.forward_vec::<T>(cfg, shape, &q, &k, &v).expect("cpu forward");
    let (dq, dk, dv) = cpu.backward_vec::<T>(cfg, shape, &q, &k, &v, &out, &lse, &go).expect("cpu backward");
    (b(&out), [b(&dq), b(&dk), b(&dv)])
}

/// Splitting the keys into blocks at arbitrary points and merging them in reverse order
/// gives the whole-call result (global positions carry the mask across blocks).
#[test]
fn key_blocks_merge_to_the_whole_call() {
    let Some(dev) = device_or_skip("key_blocks_merge_to_the_whole_call") else { return };
    let gpu = Gpu::<bf16>::new(dev.clone());
    runner()
        .run(&(dilated_case(), 0.0f64..1.0), |(case, cut)| {
            let shape = case.attn_shape();
            let inputs = case.inputs();
            let [q, k, v, _] = &inputs;
            let (q, k, v) = (conv::<bf16>(q), conv::<bf16>(k), conv::<bf16>(v));
            let (whole, _) = gpu.forward_t(&case.cfg, shape, &q, &k, &v).expect("whole");
            let n = shape.q.seq;
            let split = ((n as f64) * cut) as usize;
            let up = |x: &[bf16], s: attn_core::Shape4| -> DeviceTensor<bf16> {
                let view = attn_core::TensorView::contiguous(attn_core::error::TensorName::Query, x, s).unwrap();
                DeviceTensor::from_view(&dev, &view).unwrap()
            };
            let tq = up(&q, shape.q);
            let mut partial = DevicePartial::empty(&dev, shape.q).unwrap();
            // Key rows [split, n) first, then [0, split).
            let row = shape.q.heads * shape.q.head_dim;
            for (lo, hi) in [(split, n), (0, split)] {
                if lo == hi {
                    continue;
                }
                let s = shape.q.with_seq(hi - lo).unwrap();
                let pick = |x: &[bf16]| -> Vec<bf16> {
                    (0..shape.q.batch).flat_map(|b| x[(b * n + lo) * row..(b * n + hi) * row].to_vec()).collect()
                };
                let (tk, tv) = (up(&pick(&k), s), up(&pick(&v), s));
                forward_block(&dev, &case.cfg, &tq, 0, &tk, &tv, lo, &mut partial).unwrap();
            }
            let mut out = DeviceTensor::<bf16>::zeros(&dev, shape.q).unwrap();
            finish_forward(&dev, &case.cfg, &partial, &mut out).unwrap();
            let got = out.to_host_contiguous(&dev).unwrap();
            // Both round p to bf16 in a different order of blocks: 1e-2 relative plus the
            // magnitudes' term, so a whole result whose terms cancel is judged by them.
            let (_, mag) = rounded_reference::<bf16>(&case.cfg, shape, inputs.each_ref().map(|x| x.as_slice()));
            let whole64: Vec<f64> = whole.iter().map(|x| x.to_f64()).collect();
            let err = mixed_error(&got, &whole64, &mag.out, Tolerance { rel_l2: 1e-2 }, DType::BF16);
            prop_assert!(err <= 1.0, "block merge at {err:.3} of the bound: {:?}", case);
            Ok(())
        })
        .unwrap();
}
