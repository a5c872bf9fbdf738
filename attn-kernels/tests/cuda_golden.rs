//! Golden conformance on the GPU: every file in `conformance/dilated`, `conformance/wide`
//! (cross-attention, explicit scales, head_dim 64 and 128), `conformance/features` (grouped key/value heads, key padding, packed sequences,
//! sliding windows) and `conformance/blocks` (block masks) through the CUDA backend in f32, bf16 and f16 (forward, lse where
//! present, dq/dk/dv) with the device's own kernel choices, judged like the CPU golden
//! tests; then each choice named whatever the device's default: every forward block shape,
//! the patterns of a call in one launch, both query-tile loads of the backward, and 64 and
//! 128 keys a backward block on wide heads; and the forward's direct path against its
//! partial path, fused launches against one a pattern and three K/V stages against two,
//! bit for bit.
//! Skips, printing the reason, when no driver, NVRTC or GPU is present (fails instead with
//! `ATTN_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

mod cuda_support;

use attn_core::TensorName;
use attn_core::TensorView;
use attn_kernels::cuda::plan::{
    BackwardDq, BackwardKeys, BackwardLoads, BackwardWrites, ForwardRows, ForwardStages, PatternFusion,
};
use attn_kernels::cuda::{CudaDevice, CudaElement, DeviceBlock, DeviceKeyPadding, DeviceTensor, ForwardPath};
use attn_kernels::cuda::{forward_call, launch_plan::one_pattern_per_head};
use attn_testkit::golden::{
    DilatedBackend, GoldenCase, assert_attention_dirs_pass, attention_cases, block_case_failures,
};
use cuda_support::{conv, device_or_skip, gpu};
use half::{bf16, f16};

/// The forward of golden case `case` on `dev` by `path`: output and lse bits.
fn forward_bits<T: CudaElement>(dev: &CudaDevice, case: &GoldenCase, path: ForwardPath) -> (Vec<u32>, Vec<u32>) {
    let cfg = case.config().unwrap();
    let (shape, masks) = (case.attn_shape().unwrap(), case.masks());
    let [q, k, v]: [Vec<T>; 3] = ["q", "k", "v"].map(|t| conv(&case.tensor(t).unwrap().data));
    let up =
        |x: &[T], s| DeviceTensor::from_view(dev, &TensorView::contiguous(TensorName::Query, x, s).unwrap()).unwrap();
    let (dq, dk, dv) = (up(&q, shape.q), up(&k, shape.kv), up(&v, shape.kv));
    let mask = masks.key_padding.map(|m| DeviceKeyPadding::upload(dev, &m).unwrap());
    let block = DeviceBlock {
        key_padding: mask.as_ref(),
        packing: masks.packing,
        ..DeviceBlock::new(&cfg, (&dq, 0), (&dk, &dv, 0))
    };
    let mut out = DeviceTensor::<T>::zeros(dev, shape.q).unwrap();
    let lse = forward_call(dev, &block, &mut out, path).unwrap();
    let lse = dev.stream().clone_dtoh(&lse).unwrap();
    let out = out.to_host_contiguous(dev).unwrap();
    (out.iter().map(|x| x.to_f32().to_bits()).collect(), lse.iter().map(|x| x.to_bits()).collect())
}

/// Every golden file whose heads have one pattern: the forward written straight from the
/// kernel equals the forward through the f32 partial bit for bit (output and lse).
fn direct_equals_partial<T: CudaElement>(dev: &CudaDevice) {
    let mut compared = 0;
    for case in attention_cases() {
        if !one_pattern_per_head(&case.config().unwrap()) {
            continue;
        }
        let (direct, partial) =
            (forward_bits::<T>(dev, &case, ForwardPath::Direct), forward_bits::<T>(dev, &case, ForwardPath::Partial));
        assert!(direct.0 == partial.0, "{}: the direct output differs from the partial path's", case.name);
        assert!(direct.1 == partial.1, "{}: the direct lse differs from the partial path's", case.name);
        compared += 1;
    }
    assert!(compared >= 12, "only {compared} golden files have one pattern per head");
}

#[test]
fn direct_forward_equals_the_partial_path_on_the_gpu() {
    let Some(dev) = device_or_skip("direct_forward_equals_the_partial_path_on_the_gpu") else { return };
    direct_equals_partial::<bf16>(&dev);
    direct_equals_partial::<f16>(&dev);
}

fn run_all<T: CudaElement>(test: &str) {
    let Some(dev) = device_or_skip(test) else { return };
    assert_attention_dirs_pass(&gpu::<T>(&dev));
}

/// The tensor-core forward with block shape `rows`: every golden file, and its direct path
/// equal to its partial path.
fn golden_with_rows<T: CudaElement>(test: &str, rows: ForwardRows) {
    let Some(dev) = device_or_skip(test) else { return };
    let dev = dev.with_forward_rows(rows);
    direct_equals_partial::<T>(&dev);
    assert_attention_dirs_pass(&gpu::<T>(&dev));
}

/// 64 query rows a block over 4 warps (the default where no architecture's timing says
/// otherwise).
#[test]
fn golden_cuda_bf16_rows_64() {
    golden_with_rows::<bf16>("golden_cuda_bf16_rows_64", ForwardRows::M64);
}

/// 128 query rows a block over 8 warps.
#[test]
fn golden_cuda_bf16_rows_128() {
    golden_with_rows::<bf16>("golden_cuda_bf16_rows_128", ForwardRows::M128);
}

/// 128 query rows a block over 4 warps (two row tiles a warp).
#[test]
fn golden_cuda_f16_rows_128w4() {
    golden_with_rows::<f16>("golden_cuda_f16_rows_128w4", ForwardRows::M128W4);
}

/// The backward with 64 and 128 keys a block (128 from head dim 64; no golden file has
/// one), both query-tile loads: gradients, without and with a gradient into the LSE,
/// against the float64 reference on `wide_head_cases` and rows that attend nothing.
#[test]
fn backward_with_64_and_128_keys_a_block_on_the_gpu() {
    let Some(dev) = device_or_skip("backward_with_64_and_128_keys_a_block_on_the_gpu") else { return };
    let cases =
        attn_testkit::wide_head_cases().into_iter().chain([("unattended rows", attn_testkit::unattended_rows_case())]);
    for (name, case) in cases {
        for (keys, loads) in BackwardKeys::ALL.into_iter().flat_map(|k| BackwardLoads::ALL.map(|l| (k, l))) {
            let dev = dev.with_backward_keys(keys).with_backward_loads(loads);
            if let Err(e) = attn_testkit::judge_gradients(&gpu::<bf16>(&dev), &case) {
                panic!("{name}, {keys:?}, {loads:?} loads: {e}");
            }
            if let Err(e) = attn_testkit::judge_lse_gradients(&gpu::<bf16>(&dev), &case) {
                panic!("{name}, {keys:?}, {loads:?} loads: {e}");
            }
        }
    }
}

/// The deterministic backward (dk, dv by the tensor-core kernel without dq, dq by the row
/// kernel): every golden file in bf16, and on a problem whose rows read 8 key blocks, two
/// runs give the same bits.
#[test]
fn deterministic_dq_on_the_gpu() {
    let Some(dev) = device_or_skip("deterministic_dq_on_the_gpu") else { return };
    let dev = dev.with_backward_dq(BackwardDq::Deterministic);
    assert_attention_dirs_pass(&gpu::<bf16>(&dev));
    let cfg = attn_core::DilatedConfig::builder().segments(&[512, 1024]).dilations(&[1, 2]).build().unwrap();
    let shape = attn_core::AttnShape::self_attn(attn_core::Shape4::new(1, 1024, 4, 64).unwrap());
    let case = attn_testkit::FeatureCase { cfg, shape, padding: None, cu_seqlens: None, seed: 11 };
    let [q, k, v, go] = case.inputs();
    let run = || {
        let g = gpu::<bf16>(&dev).backward(&case.problem(), [&q, &k, &v], &go).unwrap();
        [g.dq, g.dk, g.dv].map(|x| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
    };
    assert!(run() == run(), "two deterministic backward runs differ");
    if let Err(e) = attn_testkit::judge_gradients(&gpu::<bf16>(&dev), &case) {
        panic!("deterministic dq: {e}");
    }
}

/// The patterns of a call in one launch (the 64-row fused kernel): every golden file, and
/// its forward equal to one launch a pattern bit for bit on both paths.
#[test]
fn golden_cuda_bf16_fused_patterns() {
    let Some(dev) = device_or_skip("golden_cuda_bf16_fused_patterns") else { return };
    // The fused kernel has 64 rows a block; other block shapes stay one launch a pattern.
    let dev = dev.with_forward_rows(ForwardRows::M64);
    let (apart, fused) =
        (dev.with_pattern_fusion(PatternFusion::PerPattern), dev.with_pattern_fusion(PatternFusion::Fused));
    let mut compared = 0;
    for case in attention_cases() {
        if !one_pattern_per_head(&case.config().unwrap()) {
            continue;
        }
        for path in [ForwardPath::Direct, ForwardPath::Partial] {
            let (a, b) = (forward_bits::<bf16>(&fused, &case, path), forward_bits::<bf16>(&apart, &case, path));
            assert!(a == b, "{} {path:?}: the fused forward differs from one launch a pattern", case.name);
        }
        compared += 1;
    }
    assert!(compared >= 12, "only {compared} golden files have one pattern per head");
    assert_attention_dirs_pass(&gpu::<bf16>(&fused));
}

/// The backward loading its query tiles before each tile's compute and in two stages:
/// every golden file in bf16 and f16 (dq adds with atomics in any order on a GPU, so bit
/// equality of the two is checked on the emulation, `cuda_emulation`).
#[test]
fn golden_cuda_backward_sync_and_pipelined() {
    let Some(dev) = device_or_skip("golden_cuda_backward_sync_and_pipelined") else { return };
    for loads in BackwardLoads::ALL {
        let dev = dev.with_backward_loads(loads);
        assert_attention_dirs_pass(&gpu::<bf16>(&dev));
        assert_attention_dirs_pass(&gpu::<f16>(&dev));
    }
}

/// Every file of `conformance/blocks` (8) through the CUDA backend in f32, bf16 and f16.
#[test]
fn golden_cuda_block_masks() {
    let Some(dev) = device_or_skip("golden_cuda_block_masks") else { return };
    let mut failed = block_case_failures(&gpu::<f32>(&dev));
    failed.extend(block_case_failures(&gpu::<bf16>(&dev)));
    failed.extend(block_case_failures(&gpu::<f16>(&dev)));
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

#[test]
fn golden_cuda_f32() {
    run_all::<f32>("golden_cuda_f32");
}

#[test]
fn golden_cuda_bf16() {
    run_all::<bf16>("golden_cuda_bf16");
}

#[test]
fn golden_cuda_f16() {
    run_all::<f16>("golden_cuda_f16");
}

/// The three-stage forward with 64 rows a block and with the sm_90 shape (128 over 4
/// warps): every golden file, its direct path equal to its partial path, and each file's
/// forward equal to the two-stage one bit for bit on both paths (the same key tiles).
#[test]
fn golden_cuda_bf16_three_stages() {
    let Some(dev) = device_or_skip("golden_cuda_bf16_three_stages") else { return };
    let mut compared = 0;
    for rows in [ForwardRows::M64, ForwardRows::M128W4] {
        let two = dev.with_forward_rows(rows).with_forward_stages(ForwardStages::Two);
        let three = two.with_forward_stages(ForwardStages::Three);
        direct_equals_partial::<bf16>(&three);
        assert_attention_dirs_pass(&gpu::<bf16>(&three));
        for case in attention_cases() {
            for path in [ForwardPath::Direct, ForwardPath::Partial] {
                let (a, b) = (forward_bits::<bf16>(&two, &case, path), forward_bits::<bf16>(&three, &case, path));
                assert!(a == b, "{} {rows:?} {path:?}: three stages differ from two", case.name);
                compared += 1;
            }
        }
    }
    assert!(compared >= 60, "only {compared} comparisons");
}

/// A whole call's backward writing dk and dv straight into the gradients: every golden
/// file in bf16 and f16, and dk and dv (one writer a row, no atomics) equal to the
/// accumulated path's bit for bit where it applies.
#[test]
fn golden_cuda_direct_dk_dv() {
    let Some(dev) = device_or_skip("golden_cuda_direct_dk_dv") else { return };
    let direct = dev.with_backward_writes(BackwardWrites::Direct);
    let accumulated = dev.with_backward_writes(BackwardWrites::Accumulated);
    assert_attention_dirs_pass(&gpu::<bf16>(&direct));
    assert_attention_dirs_pass(&gpu::<f16>(&direct));
    let mut compared = 0;
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = attn_testkit::golden::Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        if !one_pattern_per_head(&cfg) || p.shape.is_grouped() {
            continue;
        }
        let [q, k, v, go] = ["q", "k", "v", "grad_out"].map(|t| case.tensor(t).unwrap().data.clone());
        let run = |d: &CudaDevice| gpu::<bf16>(d).backward(&p, [&q, &k, &v], &go).unwrap();
        let (a, b) = (run(&accumulated), run(&direct));
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert!(bits(&a.dk) == bits(&b.dk) && bits(&a.dv) == bits(&b.dv), "{}: direct dk/dv differ", case.name);
        compared += 1;
    }
    assert_eq!(compared, 12, "golden files with one pattern a head and no grouped heads");
}

/// Under the deterministic dq kernel, dq written straight into the gradient too: every
/// golden file in bf16, and every gradient equal to the accumulated path's bit for bit
/// (each row has one writer either way) on the files with one pattern a head.
#[test]
fn golden_cuda_direct_dq() {
    let Some(dev) = device_or_skip("golden_cuda_direct_dq") else { return };
    let det = dev.with_backward_dq(BackwardDq::Deterministic);
    let (direct, accumulated) =
        (det.with_backward_writes(BackwardWrites::Direct), det.with_backward_writes(BackwardWrites::Accumulated));
    assert_attention_dirs_pass(&gpu::<bf16>(&direct));
    let mut compared = 0;
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = attn_testkit::golden::Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        if !one_pattern_per_head(&cfg) {
            continue;
        }
        let [q, k, v, go] = ["q", "k", "v", "grad_out"].map(|t| case.tensor(t).unwrap().data.clone());
        let run = |d: &CudaDevice| gpu::<bf16>(d).backward(&p, [&q, &k, &v], &go).unwrap();
        let (a, b) = (run(&accumulated), run(&direct));
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (name, x, y) in [("dq", &a.dq, &b.dq), ("dk", &a.dk, &b.dk), ("dv", &a.dv, &b.dv)] {
            assert!(bits(x) == bits(y), "{}: direct {name} differs", case.name);
        }
        compared += 1;
    }
    assert_eq!(compared, 15, "golden files with one pattern a head");
}
