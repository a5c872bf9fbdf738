//! Block masks on the CUDA path without a GPU (the CPU emulation of the `.cu` kernels):
//! every file of `conformance/blocks`, and a block-masked call cut into ring blocks
//! (global positions, several query and key blocks) equal to the whole call, forward and
//! gradients.
#![cfg(feature = "cuda")]

use attn_core::{BlockDims, BlockMaskBuf, Causality, DType, DilatedConfig, Masks, Shape4};
use attn_kernels::cuda::CudaElement;
use attn_kernels::cuda::emulation::{HostAccs, HostArgs};
use attn_kernels::cuda::launch_plan::{BlockGeometry, BlockMaskShape, plan_backward, plan_forward};
use attn_kernels::cuda::plan::{
    BackwardDq, BackwardKeys, BackwardLoads, BackwardOptions, ForwardOptions, ForwardRows, ForwardStages,
};
use attn_testkit::golden::{DilatedBackend, Problem};
use attn_testkit::rng::random_vec;
use attn_testkit::tolerance::{Tolerance, rel_l2_error};
use half::{bf16, f16};

use crate::cuda_emulation::{Emulated, call_geometry, emulator_for};

/// Every file of `conformance/blocks` (8) on the emulation, forward and gradients, against
/// the float64 reference: f32 on the row kernels, bf16 and f16 on the tensor-core kernels
/// that read the mask (`_bm_`; the backward with dq by atomics and with the deterministic
/// dq kernel; pipelined query-tile loads asked for are planned as loads before compute). The plans must name those kernels and carry
/// the mask, so the check cannot pass on kernels that ignore it.
#[test]
fn emulated_cuda_golden_block_masks() {
    let (name, count) = attn_testkit::golden::BLOCK_DIR;
    let dir = attn_testkit::golden::golden_dir().join(name);
    let cases = attn_testkit::golden::load_dir(&dir).unwrap();
    assert_eq!(cases.len(), count);
    for (path, case) in cases {
        let case = case.unwrap();
        let (cfg, shape, masks) = (case.config().unwrap(), case.attn_shape().unwrap(), case.masks());
        assert!(masks.block.is_some(), "{}: no block mask", path.display());
        let p = Problem { cfg: &cfg, shape, masks };
        let g = call_geometry(&p);
        for (dtype, suffix, fwd, bwd) in [
            (DType::F32, "f32", "dilated_fwd_rows_f32", "dilated_bwd_dq_rows_f32"),
            (DType::BF16, "bf16", "dilated_fwd_mma_bm_bf16_d", "dilated_bwd_mma_bm_bf16_d"),
            (DType::F16, "f16", "dilated_fwd_mma_bm_f16_d", "dilated_bwd_mma_bm_f16_d"),
        ] {
            let plan = plan_forward(&g, dtype, suffix, ForwardOptions::default()).unwrap();
            let bplan = plan_backward(&g, dtype, suffix, BackwardOptions::default()).unwrap();
            let names: Vec<_> = plan.iter().chain(&bplan).map(|l| &l.kernel).collect();
            assert!(
                plan.iter().all(|l| l.bmask && l.kernel.starts_with(fwd))
                    && bplan.iter().all(|l| l.bmask)
                    && bplan.iter().any(|l| l.kernel.starts_with(bwd)),
                "{}: {names:?}",
                path.display()
            );
        }
    }
    let mut failed = attn_testkit::golden::block_case_failures(&Emulated::<f32>::new(ForwardRows::M64));
    failed.extend(attn_testkit::golden::block_case_failures(&Emulated::<bf16>::new(ForwardRows::M64)));
    failed.extend(attn_testkit::golden::block_case_failures(&Emulated::<f16>::new(ForwardRows::M64)));
    let pipelined = BackwardOptions { loads: BackwardLoads::Pipelined, ..Default::default() };
    failed.extend(attn_testkit::golden::block_case_failures(
        &Emulated::<f16>::new(ForwardRows::M64).with_backward(pipelined),
    ));
    let det = BackwardOptions { dq: BackwardDq::Deterministic, ..Default::default() };
    failed
        .extend(attn_testkit::golden::block_case_failures(&Emulated::<bf16>::new(ForwardRows::M64).with_backward(det)));
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

/// A banded mask with holes over 32 blocks of 24 positions (2 heads): query block 5 keeps
/// nothing (its rows: o = 0, lse = -inf, no gradient), the far blocks of every row are
/// removed, so whole key tiles (and the backward's query tiles) are skipped, and the
/// holes and the band's edges cut the tiles near the diagonal (blocks of 24 never line up
/// with tiles of 64 selected indices, dilated by 2 in the long segments).
fn banded_mask() -> BlockMaskBuf {
    let dims = BlockDims { batch: 1, heads: 2, q_blocks: 32, k_blocks: 32 };
    BlockMaskBuf::from_fn(dims, 24, |_, h, i, j| {
        i != 5 && (i == j || (i.abs_diff(j) <= 2 && (i * 7 + j * 3 + h) % 5 != 0))
    })
    .unwrap()
}

/// The tensor-core kernels under a block mask that removes whole tiles and cuts others,
/// causal and not: out, lse and dq, dk, dv in bf16 and f16 judged row by row against the
/// float64 reference, the backward with atomic and deterministic dq (the other forward and
/// backward shapes, stages and loads asked for are planned as these under a block mask).
#[test]
fn tensor_core_block_masks_skip_removed_tiles_and_cut_the_rest() {
    use attn_testkit::judge::{Expected, judge_backward, judge_forward, round_to, verdict};
    let mask = banded_mask();
    let shape = attn_core::AttnShape::self_attn(Shape4::new(1, 768, 2, 32).unwrap());
    let fwd_opts = [
        (ForwardRows::M64, ForwardStages::Two),
        (ForwardRows::M128, ForwardStages::Three),
        (ForwardRows::M128W4, ForwardStages::Two),
    ];
    let bwd_opts = [
        BackwardOptions::default(),
        BackwardOptions { dq: BackwardDq::Deterministic, ..Default::default() },
        BackwardOptions { loads: BackwardLoads::Pipelined, keys: BackwardKeys::K128, ..Default::default() },
    ];
    for causality in [Causality::Full, Causality::Causal] {
        let cfg =
            DilatedConfig::builder().segments(&[192, 768]).dilations(&[1, 2]).causality(causality).build().unwrap();
        let p = Problem { cfg: &cfg, shape, masks: Masks { block: Some(mask.view()), ..Masks::NONE } };
        let [q, k, v, go] = [21, 22, 23, 24].map(|seed| random_vec(seed, shape.q.numel()));
        for (i, ((rows, stages), bwd)) in fwd_opts.into_iter().zip(bwd_opts).enumerate() {
            let (dtype, backend): (DType, Box<dyn DilatedBackend>) = if i % 2 == 0 {
                (DType::BF16, Box::new(Emulated::<bf16>::new(rows).with_stages(stages).with_backward(bwd)))
            } else {
                (DType::F16, Box::new(Emulated::<f16>::new(rows).with_stages(stages).with_backward(bwd)))
            };
            let r = [&q, &k, &v, &go].map(|x| round_to(dtype, x).into_iter().map(f64::from).collect::<Vec<_>>());
            let want = Expected::for_problem(&p, [&r[0], &r[1], &r[2]], Some(&r[3])).unwrap();
            assert!(want.fwd.lse.iter().any(|l| !l.is_finite()), "no row without a kept key");
            let out = backend.forward(&p, [&q, &k, &v]).unwrap();
            let g = backend.backward(&p, [&q, &k, &v], &go).unwrap();
            let mut checks = judge_forward(&want, &out.out, &out.lse, dtype);
            checks.extend(judge_backward(&want, [&g.dq, &g.dk, &g.dv], dtype));
            if let Err(e) = verdict(&checks) {
                panic!("{causality:?}, {rows:?}, {stages:?}, {bwd:?}: {e}");
            }
        }
    }
}

/// Rows `[a, b)` of a batch-1 tensor of `heads` x `d` values a row.
fn rows<T>(x: &[T], (a, b): (usize, usize), heads: usize, d: usize) -> &[T] {
    &x[a * heads * d..b * heads * d]
}

/// The geometry of q rows `qr` and k rows `kr` of a batch-1 call of `s` under `mask`.
fn piece<'a>(
    cfg: &'a DilatedConfig,
    s: Shape4,
    qr: (usize, usize),
    kr: (usize, usize),
    mask: &BlockMaskBuf,
) -> BlockGeometry<'a> {
    let (sq, sk) = (s.with_seq(qr.1 - qr.0).unwrap(), s.with_seq(kr.1 - kr.0).unwrap());
    BlockGeometry {
        cfg,
        q: (sq, sq.contiguous_strides()),
        q_start: qr.0,
        k: (sk, sk.contiguous_strides()),
        v_strides: sk.contiguous_strides(),
        k_start: kr.0,
        g_strides: Some(sq.contiguous_strides()),
        band: cfg.band(),
        kpad_seq: None,
        packing: None,
        block_mask: Some(BlockMaskShape::from(mask.view())),
        window: None,
    }
}

/// A causal dilated call over 37 positions, blocks of 5 (a ragged last block), a per-head
/// mask, cut into query and key ranges that do not line up with the blocks: each query
/// range LSE-merges every key range (forward), then adds every pair's gradients given the
/// whole call's lse and delta; out, lse, dq, dk and dv equal the whole call's (one block),
/// and the mask changes the output. In T: f32 on the row kernels, f16 on the tensor-core
/// kernels (the plans must name them), within `tol`: f16's unit roundoff, as the cut and
/// the whole call round their probabilities to f16 against different running maxima
/// (about 3e-5 apart in out, 1e-8 in the gradients).
fn ring_blocks_equal_the_whole_call<T: CudaElement>(
    loads: BackwardLoads,
    fwd_kernel: &str,
    bwd_kernel: &str,
    tol: f64,
) {
    let cfg =
        DilatedConfig::builder().segments(&[8, 16]).dilations(&[1, 2]).causality(Causality::Causal).build().unwrap();
    let s = Shape4::new(1, 37, 2, 16).unwrap();
    let dims = BlockDims { batch: 1, heads: 2, q_blocks: 8, k_blocks: 8 };
    let mask = BlockMaskBuf::from_fn(dims, 5, |_, h, i, j| i == j || (i * 3 + j + h) % 3 == 1).unwrap();
    let (h, d, n) = (s.heads, s.head_dim, s.numel());
    let [q, k, v, go] =
        [11, 12, 13, 14].map(|seed| random_vec(seed, n).into_iter().map(T::from_f32).collect::<Vec<T>>());
    let bwd_opts = BackwardOptions { loads, ..BackwardOptions::default() };
    let emu = emulator_for(ForwardOptions::default(), bwd_opts);
    let cut = [(0, 13), (13, 29), (29, 37)];
    for (qr, kr) in [((0, 13), (13, 29)), ((29, 37), (0, 37))] {
        let g = piece(&cfg, s, qr, kr, &mask);
        let fwd = plan_forward(&g, T::DTYPE, T::SUFFIX, ForwardOptions::default()).unwrap();
        let bwd = plan_backward(&g, T::DTYPE, T::SUFFIX, bwd_opts).unwrap();
        assert!(fwd.iter().all(|l| l.bmask && l.kernel.starts_with(fwd_kernel)), "{fwd:?}");
        assert!(bwd.iter().all(|l| l.bmask) && bwd.iter().any(|l| l.kernel.starts_with(bwd_kernel)), "{bwd:?}");
    }
    let run_forward = |mask_of: Option<&BlockMaskBuf>, pieces: &[(usize, usize)]| {
        let (mut out, mut lse) = (vec![0.0f32; n], vec![f32::NEG_INFINITY; s.lse_len()]);
        for &qr in pieces {
            let (o, l) = (&mut out[qr.0 * h * d..qr.1 * h * d], &mut lse[qr.0 * h..qr.1 * h]);
            for &kr in pieces {
                let mut g = piece(&cfg, s, qr, kr, &mask);
                g.g_strides = None;
                g.block_mask = mask_of.map(|m| BlockMaskShape::from(m.view()));
                let args = HostArgs {
                    q: rows(&q, qr, h, d),
                    k: rows(&k, kr, h, d),
                    v: rows(&v, kr, h, d),
                    g: None,
                    lse: None,
                    delta: None,
                    kpad: None,
                    bmask: mask_of.map(|m| m.view().keep()),
                };
                emu.forward_block(&g, &args, HostAccs { q_acc: o, lse: Some(&mut *l), dk: None, dv: None }).unwrap();
            }
        }
        (out, lse)
    };
    let (whole_out, whole_lse) = run_forward(Some(&mask), &[(0, 37)]);
    let (cut_out, cut_lse) = run_forward(Some(&mask), &cut);
    let (unmasked, _) = run_forward(None, &[(0, 37)]);
    assert!(rel_l2_error(&whole_out, &unmasked) > 1e-2, "the mask changes nothing");
    assert!(rel_l2_error(&cut_out, &whole_out) < tol, "out {:.2e}", rel_l2_error(&cut_out, &whole_out));
    let finite = |x: &[f32]| x.iter().map(|&v| if v.is_finite() { v } else { -1e4 }).collect::<Vec<_>>();
    assert!(rel_l2_error(&finite(&cut_lse), &finite(&whole_lse)) < tol, "lse");
    // delta from the unscaled partial output: the same for both runs, all the comparison needs.
    let delta: Vec<f32> =
        (0..s.lse_len()).map(|r| (0..d).map(|c| go[r * d + c].to_f32() * whole_out[r * d + c]).sum()).collect();
    let run_backward = |pieces: &[(usize, usize)]| {
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
        for &qr in pieces {
            for &kr in pieces {
                let args = HostArgs {
                    q: rows(&q, qr, h, d),
                    k: rows(&k, kr, h, d),
                    v: rows(&v, kr, h, d),
                    g: Some(rows(&go, qr, h, d)),
                    lse: Some(&whole_lse[qr.0 * h..qr.1 * h]),
                    delta: Some(&delta[qr.0 * h..qr.1 * h]),
                    kpad: None,
                    bmask: Some(mask.view().keep()),
                };
                let acc = HostAccs {
                    q_acc: &mut dq[qr.0 * h * d..qr.1 * h * d],
                    lse: None,
                    dk: Some(&mut dk[kr.0 * h * d..kr.1 * h * d]),
                    dv: Some(&mut dv[kr.0 * h * d..kr.1 * h * d]),
                };
                emu.backward_block(&piece(&cfg, s, qr, kr, &mask), &args, acc).unwrap();
            }
        }
        [dq, dk, dv]
    };
    let (whole, parts) = (run_backward(&[(0, 37)]), run_backward(&cut));
    for (name, (a, b)) in ["dq", "dk", "dv"].into_iter().zip(parts.iter().zip(&whole)) {
        assert!(b.iter().any(|&x| x != 0.0), "{name}: all zero");
        assert!(rel_l2_error(a, b) < tol, "{name} {:.2e}", rel_l2_error(a, b));
    }
}

/// [`ring_blocks_equal_the_whole_call`] on the row kernels (f32).
#[test]
fn block_masked_ring_blocks_equal_the_whole_call() {
    ring_blocks_equal_the_whole_call::<f32>(
        BackwardLoads::Sync,
        "dilated_fwd_rows_f32",
        "dilated_bwd_dq_rows_f32",
        1e-6,
    );
}

/// [`ring_blocks_equal_the_whole_call`] on the tensor-core kernels (f16); the pipelined
/// query-tile loads asked for are planned as loads before compute under a block mask.
#[test]
fn block_masked_ring_blocks_equal_the_whole_call_on_tensor_cores() {
    for loads in BackwardLoads::ALL {
        let (fwd, bwd) = ("dilated_fwd_mma_bm_f16_d", "dilated_bwd_mma_bm_f16_d");
        ring_blocks_equal_the_whole_call::<f16>(loads, fwd, bwd, Tolerance::unit_roundoff(DType::F16));
    }
}
