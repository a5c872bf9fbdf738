//! The three-stage tensor-core forward (`dilated_fwd_mma3.cu`) on the CUDA emulation: every
//! attention golden file with the sm_90 block shape (128 rows over 4 warps) and with 64
//! rows, direct against partial; the same bits as the two-stage forward wherever the two
//! plan the same block shape and key tile; its fused launches against one a pattern.
#![cfg(feature = "cuda")]

use attn_kernels::cuda::launch_plan::plan_forward;
use attn_kernels::cuda::plan::{ForwardKernel, ForwardRows, ForwardStages, forward_kernel};
use attn_kernels::cuda::{CudaElement, ForwardPath};
use attn_testkit::golden::{Problem, assert_attention_dirs_pass, attention_cases};
use half::{bf16, f16};

use crate::cuda_emulation::{Emulated, call_geometry, conv};
use crate::cuda_emulation_paths::direct_equals_partial;

#[test]
fn three_stage_golden_bf16_rows_128w4() {
    let emulated = Emulated::<bf16>::new(ForwardRows::M128W4).with_stages(ForwardStages::Three);
    direct_equals_partial(&emulated);
    assert_attention_dirs_pass(&emulated);
}

#[test]
fn three_stage_golden_f16_rows_64() {
    let emulated = Emulated::<f16>::new(ForwardRows::M64).with_stages(ForwardStages::Three);
    direct_equals_partial(&emulated);
    assert_attention_dirs_pass(&emulated);
}

/// Output and lse bits of `e`'s forward of `p` on `path`.
fn forward_bits<T: CudaElement>(e: &Emulated<T>, p: &Problem<'_>, qkv: [&[T]; 3], path: ForwardPath) -> Vec<u32> {
    let (out, lse) = e.forward_on(p, qkv, path).unwrap();
    out.iter().map(|v| v.to_f32().to_bits()).chain(lse.iter().map(|v| v.to_bits())).collect()
}

/// The block shape and key tile `e` runs a head dim with.
fn tiles<T: CudaElement>(e: &Emulated<T>, head_dim: usize) -> Option<(ForwardRows, usize)> {
    match forward_kernel(T::DTYPE, T::SUFFIX, head_dim, e.options()) {
        ForwardKernel::Mma { rows, block_n, .. } => Some((rows, block_n)),
        ForwardKernel::Rows { .. } => None,
    }
}

/// Every golden file whose two- and three-stage plans run the same block shape and key
/// tile: the same bits on the direct and the partial path (the same arithmetic in the same
/// order; only how tiles arrive and which tiles skip the mask test differ). Counts the
/// comparisons, so it cannot pass by comparing none.
fn three_stages_equal_two<T: CudaElement>(fused: bool) {
    let mut compared = 0;
    for rows in ForwardRows::ALL {
        let two = if fused { Emulated::<T>::fused(rows) } else { Emulated::<T>::new(rows) };
        let three = if fused { Emulated::<T>::fused(rows) } else { Emulated::<T>::new(rows) };
        let three = three.with_stages(ForwardStages::Three);
        for case in attention_cases() {
            let cfg = case.config().unwrap();
            let p = Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
            let d = p.shape.q.head_dim;
            if tiles(&two, d).is_none() || tiles(&two, d) != tiles(&three, d) {
                continue;
            }
            let launches = |e: &Emulated<T>| plan_forward(&call_geometry(&p), T::DTYPE, T::SUFFIX, e.options());
            assert_eq!(launches(&two).unwrap().len(), launches(&three).unwrap().len(), "{}", case.name);
            let [q, k, v]: [Vec<T>; 3] = ["q", "k", "v"].map(|t| conv(&case.tensor(t).unwrap().data));
            for path in [ForwardPath::Direct, ForwardPath::Partial] {
                let (a, b) = (forward_bits(&two, &p, [&q, &k, &v], path), forward_bits(&three, &p, [&q, &k, &v], path));
                assert!(a == b, "{} {rows:?} {path:?}: three stages differ from two", case.name);
                compared += 1;
            }
        }
    }
    println!("three stages = two bit for bit: {compared} comparisons");
    assert!(compared >= 60, "only {compared} comparisons");
}

#[test]
fn three_stages_give_the_bits_of_two_where_their_tiles_match_bf16() {
    three_stages_equal_two::<bf16>(false);
}

#[test]
fn three_stages_give_the_bits_of_two_where_their_tiles_match_f16_fused() {
    three_stages_equal_two::<f16>(true);
}

/// Blocks of 64 and 128 rows inside one segment under a window, a causal window and causal
/// dilated segments, where the tiles that need no mask are a strict range of a block's
/// keys (the band's edges cut the first and last tiles): the forward of every block shape with two
/// and three stages against the float64 reference, bf16 (the golden files' segments are too
/// short for a whole 128-row block).
#[test]
fn full_tile_ranges_under_windows_match_the_reference() {
    use attn_testkit::judge::{Expected, judge_forward, round_to, verdict};
    let b = attn_core::DilatedConfig::builder;
    let configs = [
        b().window(150, 70).build(),
        b().window(300, 20).causal().build(),
        b().segments(&[512, 1024]).dilations(&[1, 2]).causal().build(),
    ];
    let shape = attn_core::AttnShape::self_attn(attn_core::Shape4::new(1, 1024, 2, 64).unwrap());
    let n = shape.q.numel();
    let [q, k, v] = [0, 1, 2].map(|i| attn_testkit::rng::random_vec(77 + i, n));
    for cfg in configs {
        let cfg = cfg.unwrap();
        let p = Problem::new(&cfg, shape);
        let r =
            [&q, &k, &v].map(|x| round_to(attn_core::DType::BF16, x).into_iter().map(f64::from).collect::<Vec<_>>());
        let want = Expected::for_problem(&p, [&r[0], &r[1], &r[2]], None).unwrap();
        for rows in ForwardRows::ALL {
            for stages in ForwardStages::ALL {
                let emulated = Emulated::<bf16>::new(rows).with_stages(stages);
                let got = attn_testkit::golden::DilatedBackend::forward(&emulated, &p, [&q, &k, &v]).unwrap();
                if let Err(e) = verdict(&judge_forward(&want, &got.out, &got.lse, attn_core::DType::BF16)) {
                    panic!("{cfg:?}, {rows:?}, {stages:?}: {e}");
                }
            }
        }
    }
}
