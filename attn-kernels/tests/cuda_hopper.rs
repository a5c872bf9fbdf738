//! The sm_90a forward and backward (`dilated_fwd_wgmma.cu`, `dilated_bwd_wgmma.cu`: TMA
//! tiles through stride-r tensor maps, wgmma) through this crate's launch plans on the CUDA
//! emulation told it emulates sm_90a (`ForwardMma::Wgmma`, `BackwardMma::Wgmma`): every
//! attention golden file in bf16 and f16, forward and gradients, the tensor maps encoded on
//! the Rust side (`cuda::plan::tensor_maps`) by the emulation's `cuTensorMapEncodeTiled`;
//! each file the kernels support must have run them (counted by kernel name), the others
//! run the `mma.sync` kernels; the forward's direct path (output straight from the kernel)
//! against its partial path, bit for bit.
#![cfg(feature = "cuda")]

use attn_core::{AttnShape, DType, DilatedConfig, Mixing, Shape4};
use attn_kernels::cuda::emulation::{Emulator, HostArgs};
use attn_kernels::cuda::launch_plan::plan_forward;
use attn_kernels::cuda::plan::{BackwardMma, BackwardOptions, BackwardWrites, ForwardMma, ForwardOptions, ForwardRows};
use attn_kernels::cuda::scratch::ScratchPool;
use attn_kernels::cuda::{CudaElement, ForwardPath};
use attn_testkit::golden::{Problem, attention_cases, check_case};
use attn_testkit::judge::{Expected, judge_forward, round_to, verdict};
use attn_testkit::rng::random_vec;
use half::{bf16, f16};

use crate::cuda_alignment::Placed;
use crate::cuda_emulation::{Emulated, call_geometry, conv, emulator_for, fresh_emulator};
use crate::cuda_emulation_paths::direct_equals_partial;

/// Whether the sm_90a forward takes some launch of a call: a head dim it has an instance
/// for whose rows are 16-byte multiples (the golden tensors are contiguous), and a pattern
/// whose selected rows are one stride (a window, or `r` dividing `w`).
fn sm90a_takes(cfg: &DilatedConfig, head_dim: usize) -> bool {
    let one_stride = cfg.window().is_some()
        || cfg.segment_lengths().iter().zip(cfg.dilation_rates()).any(|(&w, &r)| w.is_multiple_of(r));
    head_dim <= 128 && head_dim.is_multiple_of(8) && one_stride
}

/// Every attention golden file through `emulated` (its launches run on `emu`), judged
/// against its expected values; the files [`sm90a_takes`] must have run a kernel whose name
/// starts with `prefix` (the sm_90a `what`) and the others must not have; `check` sees each
/// file's problem. Counts both, so it cannot pass by running none.
fn golden_through_sm90a<T: CudaElement>(
    (emulated, emu): (&Emulated<T>, &Emulator),
    (what, prefix): (&str, &str),
    check: impl Fn(&Problem<'_>),
) {
    let wgmma_launches = || launches_of(emu, prefix);
    let (mut took, mut left, mut failed) = (0, 0, Vec::new());
    for case in attention_cases() {
        let cfg = case.config().unwrap();
        let p = Problem { cfg: &cfg, shape: case.attn_shape().unwrap(), masks: case.masks() };
        let before = wgmma_launches();
        let report = check_case(&case, Some(emulated), None);
        println!("{report}");
        if !report.passed() {
            failed.push(report.to_string());
        }
        let ran = wgmma_launches() - before;
        check(&p);
        match sm90a_takes(&cfg, p.shape.q.head_dim) {
            true => {
                assert!(ran > 0, "{}: the sm_90a {what} did not run", case.name);
                took += 1;
            }
            false => {
                assert_eq!(ran, 0, "{}: the sm_90a {what} ran where it cannot", case.name);
                left += 1;
            }
        }
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
    println!("{} {took} files through the sm_90a {what}, {left} through mma.sync", T::SUFFIX);
    assert!(took >= 10, "only {took} files ran the sm_90a {what}");
}

/// Every attention golden file on the emulated sm_90a device in `T` through the wgmma
/// forward where it takes a launch; the plan's sm_90a launches, and only they, carry an
/// `mma.sync` fallback.
fn golden_through_wgmma<T: CudaElement>() {
    let emulated = Emulated::<T>::new(ForwardRows::M64).with_mma(ForwardMma::Wgmma);
    let opts = ForwardOptions { mma: ForwardMma::Wgmma, ..ForwardOptions::default() };
    let emu = emulator_for(opts, BackwardOptions::default());
    let prefix = format!("dilated_fwd_wgmma_{}_d", T::SUFFIX);
    golden_through_sm90a((&emulated, emu), ("forward", &prefix), |p| {
        let planned = plan_forward(&call_geometry(p), T::DTYPE, T::SUFFIX, opts).unwrap();
        assert!(planned.iter().all(|l| l.fallback.is_some() == l.kernel.starts_with("dilated_fwd_wgmma_")));
    });
}

/// Every attention golden file on an emulated sm_90a device in `T` with the wgmma forward
/// and backward (dk and dv written as `writes` says), gradients included, the wgmma
/// backward run where it takes a launch.
fn golden_through_wgmma_backward<T: CudaElement>(writes: BackwardWrites) {
    let bwd = BackwardOptions { mma: BackwardMma::Wgmma, writes, ..BackwardOptions::default() };
    let emulated = Emulated::<T>::new(ForwardRows::M64).with_mma(ForwardMma::Wgmma).with_backward(bwd);
    let emu = emulator_for(emulated.options(), bwd);
    let prefix = format!("dilated_bwd_wgmma_{}_d", T::SUFFIX);
    golden_through_sm90a((&emulated, emu), ("backward", &prefix), |_| {});
}

#[test]
fn wgmma_forward_golden_bf16() {
    golden_through_wgmma::<bf16>();
}

#[test]
fn wgmma_forward_golden_f16() {
    golden_through_wgmma::<f16>();
}

#[test]
fn wgmma_backward_golden_bf16() {
    golden_through_wgmma_backward::<bf16>(BackwardWrites::Accumulated);
}

#[test]
fn wgmma_backward_golden_f16() {
    golden_through_wgmma_backward::<f16>(BackwardWrites::Accumulated);
}

/// dk and dv written straight from the wgmma backward (`a.out_direct`) where a whole call
/// allows it, the fallback launches likewise.
#[test]
fn wgmma_backward_golden_bf16_direct_writes() {
    golden_through_wgmma_backward::<bf16>(BackwardWrites::Direct);
}

#[test]
fn wgmma_direct_forward_equals_its_partial_path_bf16() {
    direct_equals_partial(&Emulated::<bf16>::new(ForwardRows::M64).with_mma(ForwardMma::Wgmma));
}

/// Launches of kernels whose names start with `prefix` that `emu` has run.
fn launches_of(emu: &Emulator, prefix: &str) -> u64 {
    emu.launches().iter().filter(|(k, _)| k.starts_with(prefix)).map(|(_, n)| n).sum()
}

/// A call of two head groups, the second's rows not one stride (`r` 5 does not divide `w`
/// 24), with q starting on and off a 16-byte boundary: on the emulated sm_90a device the
/// first pattern runs the wgmma forward where q is aligned, and every other launch its
/// `mma.sync` fallback; both runs judged against the float64 reference.
#[test]
fn launches_the_sm90a_forward_cannot_take_run_mma_sync() {
    let cfg = DilatedConfig::builder().segments(&[16, 24]).dilations(&[1, 5]).mixing(Mixing::HeadGroups).build();
    let cfg = cfg.unwrap();
    let shape = Shape4::new(2, 48, 2, 64).unwrap();
    let problem = Problem::new(&cfg, AttnShape::self_attn(shape));
    let [q, k, v] = [11, 12, 13].map(|seed| random_vec(seed, shape.numel()));
    let r = [&q, &k, &v].map(|x| round_to(DType::BF16, x).into_iter().map(f64::from).collect::<Vec<_>>());
    let want = Expected::for_problem(&problem, [&r[0], &r[1], &r[2]], None).unwrap();
    let (kk, vv) = (conv::<bf16>(&k), conv::<bf16>(&v));
    for (skew, wgmma_runs) in [(0, 1), (4, 0)] {
        let emu = fresh_emulator().with_forward_mma(ForwardMma::Wgmma);
        let qb = Placed::<bf16>::new(&q, skew);
        let args = HostArgs { q: qb.view(), k: &kk, v: &vv, g: None, lse: None, delta: None, kpad: None, bmask: None };
        let (mut out, mut lse) = (vec![bf16::ZERO; shape.numel()], vec![0.0f32; shape.lse_len()]);
        let g = call_geometry(&problem);
        emu.forward_call(&g, &args, ForwardPath::Direct, (&mut out, &mut lse), &mut ScratchPool::default()).unwrap();
        let (wgmma, mma) = (launches_of(&emu, "dilated_fwd_wgmma_bf16"), launches_of(&emu, "dilated_fwd_mma_bf16"));
        assert_eq!((wgmma, mma), (wgmma_runs, 2 - wgmma_runs), "q {skew} elements past a 16-byte boundary");
        let out: Vec<f32> = out.iter().map(|x| x.to_f32()).collect();
        if let Err(e) = verdict(&judge_forward(&want, &out, &lse, DType::BF16)) {
            panic!("q {skew} elements past a 16-byte boundary: {e}");
        }
    }
}
