//! Property tests on the GPU: random valid configs (both mixing modes, causal, ragged
//! tails, `w > n`) and the attention features (grouped key/value heads, key padding,
//! packed sequences, windows) in f32, bf16 and f16, judged row by row against the float64
//! reference on the same rounded inputs, and the block API (LSE-merging key blocks in any order)
//! against the reference. Without a GPU they skip with the reason, or fail under
//! `ATTN_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

mod cuda_support;

use attn_core::{AttnShape, DType, DilatedConfig};
use attn_kernels::cuda::{DeviceBlock, DevicePartial, DeviceTensor, finish_forward, forward_block};
use attn_testkit::DilatedBackend;
use attn_testkit::golden::Problem;
use attn_testkit::judge::{Expected, check_rows, judge_backward, judge_forward, round_to, verdict};
use attn_testkit::strategies::dilated_case;
use attn_testkit::{FeatureCase, feature_case, judge_lse_gradients};
use cuda_support::{conv, device_or_skip, gpu};
use half::bf16;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Cases per property: 48, or `PROPTEST_CASES` (the device check bounds its run with it).
fn runner() -> TestRunner {
    TestRunner::new(Config { cases: attn_testkit::proptest_cases(48), max_shrink_iters: 64, ..Config::default() })
}

/// The float64 reference on the inputs `[q, k, v, grad_out]` rounded to `dtype`.
fn rounded_reference(cfg: &DilatedConfig, shape: AttnShape, inputs: [&[f32]; 4], dtype: DType) -> Expected {
    let [q, k, v, go] = inputs.map(|x| round_to(dtype, x).into_iter().map(f64::from).collect::<Vec<f64>>());
    Expected::compute(cfg, shape, [&q, &k, &v], Some(&go)).expect("valid case")
}

#[test]
fn forward_and_backward_match_the_reference() {
    let Some(dev) = device_or_skip("forward_and_backward_match_the_reference") else { return };
    let gpus: [Box<dyn DilatedBackend>; 3] =
        [Box::new(gpu::<f32>(&dev)), Box::new(gpu::<bf16>(&dev)), Box::new(gpu::<half::f16>(&dev))];
    runner()
        .run(&dilated_case(), |case| {
            let shape = case.attn_shape();
            let [q, k, v, go] = case.inputs();
            for gpu in &gpus {
                let dtype = gpu.dtype();
                let want = rounded_reference(&case.cfg, shape, [&q, &k, &v, &go], dtype);
                let problem = Problem::new(&case.cfg, shape);
                let got = gpu.forward(&problem, [&q, &k, &v]).expect("gpu forward");
                let g = gpu.backward(&problem, [&q, &k, &v], &go).expect("gpu backward");
                let mut checks = judge_forward(&want, &got.out, &got.lse, dtype);
                checks.extend(judge_backward(&want, [&g.dq, &g.dk, &g.dv], dtype));
                let v = verdict(&checks);
                prop_assert!(v.is_ok(), "{}: {} {:?}", gpu.name(), v.unwrap_err(), case);
            }
            Ok(())
        })
        .unwrap();
}

/// Forward and backward (without and with a gradient into the LSE) of a feature case on
/// every dtype against the reference on the inputs rounded to that dtype.
fn check_features(gpus: &[Box<dyn DilatedBackend>], case: &FeatureCase) -> Result<(), TestCaseError> {
    let problem = case.problem();
    let [q, k, v, go] = case.inputs();
    for gpu in gpus {
        let dtype = gpu.dtype();
        let got = gpu.forward(&problem, [&q, &k, &v]).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let g = gpu.backward(&problem, [&q, &k, &v], &go).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let [rq, rk, rv, rgo] =
            [&q, &k, &v, &go].map(|x| round_to(dtype, x).into_iter().map(f64::from).collect::<Vec<f64>>());
        let want = Expected::for_problem(&problem, [&rq, &rk, &rv], Some(&rgo)).expect("valid case");
        let mut checks = judge_forward(&want, &got.out, &got.lse, dtype);
        checks.extend(judge_backward(&want, [&g.dq, &g.dk, &g.dv], dtype));
        let v = verdict(&checks);
        prop_assert!(v.is_ok(), "{}: {} {:?}", gpu.name(), v.unwrap_err(), case);
        let v = judge_lse_gradients(gpu.as_ref(), case);
        prop_assert!(v.is_ok(), "{}: {} {:?}", gpu.name(), v.unwrap_err(), case);
    }
    Ok(())
}

#[test]
fn features_match_the_reference() {
    let Some(dev) = device_or_skip("features_match_the_reference") else { return };
    let gpus: [Box<dyn DilatedBackend>; 3] =
        [Box::new(gpu::<f32>(&dev)), Box::new(gpu::<bf16>(&dev)), Box::new(gpu::<half::f16>(&dev))];
    runner().run(&feature_case(1..=48, 24, vec![1, 4, 5, 8, 16, 20]), |case| check_features(&gpus, &case)).unwrap();
    // Long enough for several key tiles and query blocks per segment.
    runner().run(&feature_case(100..=400, 200, vec![8, 20, 40, 72]), |case| check_features(&gpus, &case)).unwrap();
}

/// Splitting the keys into blocks at arbitrary points and merging them in reverse order
/// gives the function (global positions carry the mask across blocks), as the whole call does.
#[test]
fn key_blocks_merge_to_the_whole_call() {
    let Some(dev) = device_or_skip("key_blocks_merge_to_the_whole_call") else { return };
    let gpu = gpu::<bf16>(&dev);
    runner()
        .run(&(dilated_case(), 0.0f64..1.0), |(case, cut)| {
            let shape = case.attn_shape();
            let inputs = case.inputs();
            let [q, k, v, _] = &inputs;
            let (q, k, v) = (conv::<bf16>(q), conv::<bf16>(k), conv::<bf16>(v));
            let (whole, _) = gpu.forward_t(&case.cfg, shape, [&q, &k, &v]).expect("whole");
            let n = shape.q.seq;
            let split = ((n as f64) * cut) as usize;
            let up = |x: &[bf16], s: attn_core::Shape4| -> DeviceTensor<bf16> {
                let view = attn_core::TensorView::contiguous(attn_core::error::TensorName::Query, x, s).unwrap();
                DeviceTensor::from_view(&dev, &view).unwrap()
            };
            let tq = up(&q, shape.q);
            let mut partial = DevicePartial::empty::<bf16>(&dev, shape.q).unwrap();
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
                let block = DeviceBlock::new(&case.cfg, (&tq, 0), (&tk, &tv, lo));
                forward_block(&dev, &block, &mut partial).unwrap();
            }
            let mut out = DeviceTensor::<bf16>::zeros(&dev, shape.q).unwrap();
            finish_forward(&dev, &case.cfg, &partial, &mut out).unwrap();
            let got = out.to_host_contiguous(&dev).unwrap();
            // Blocks merged in reverse order, and the whole call, both within the row bound.
            let want = rounded_reference(&case.cfg, shape, inputs.each_ref().map(|x| x.as_slice()), DType::BF16);
            let d = shape.q.head_dim;
            for (what, out) in [("blocks", &got), ("whole", &whole)] {
                let c = check_rows(
                    "out",
                    out,
                    &want.fwd.out,
                    [&want.mag.out, &want.mag.flushable.out, &want.mag.quantum.out],
                    d,
                    DType::BF16,
                );
                prop_assert!(c.passed(), "{what}: {c} {:?}", case);
            }
            Ok(())
        })
        .unwrap();
}
