//! The CPU backend against the float64 reference (proptest: random shapes, configs,
//! causal, both mixings, ragged lengths; f32 tight, bf16/f16 with the testkit's bounds),
//! plus larger fixed cases that span several tiles, chunks and units.

mod common;

use attn_core::reference::dilated_backward;
use attn_core::{DType, DilatedConfig, Element, Mixing, Shape4};
use attn_kernels::{CpuBackend, Isa};
use attn_testkit::strategies::{DilatedCase, dilated_case, dilated_case_with};
use attn_testkit::{Tolerance, random_vec, rel_l2_error};
use common::{back, check_lse, conv, grad_error, to64};
use half::{bf16, f16};
use proptest::prelude::*;

/// Forward and backward of `case` in dtype `T` against the reference.
fn check_case<T: Element>(be: &CpuBackend, case: &DilatedCase) -> Result<(), String> {
    let [q, k, v, go] = case.inputs();
    let (qt, kt, vt, gt) = (conv::<T>(&q), conv::<T>(&k), conv::<T>(&v), conv::<T>(&go));
    // The reference sees the inputs as rounded to T, so only the kernel's error is measured.
    let (fwd, grads) = dilated_backward(
        &case.cfg,
        case.attn_shape(),
        &to64(&back(&qt)),
        &to64(&back(&kt)),
        &to64(&back(&vt)),
        &to64(&back(&gt)),
    )
    .map_err(|e| e.to_string())?;
    let tol = Tolerance::for_dtype(T::DTYPE).rel_l2;
    let (out, lse) = be.forward_vec::<T>(&case.cfg, case.shape, &qt, &kt, &vt).map_err(|e| e.to_string())?;
    let err = rel_l2_error(&out, &fwd.out);
    if err > tol {
        return Err(format!("out rel err {err:.3e} > {tol:.0e}"));
    }
    check_lse(&lse, &fwd.lse, if T::DTYPE == DType::F32 { 1e-5 } else { tol })?;
    let (dq, dk, dv) =
        be.backward_vec::<T>(&case.cfg, case.shape, &qt, &kt, &vt, &out, &lse, &gt).map_err(|e| e.to_string())?;
    for (name, got, want) in [("dq", &dq, &grads.dq), ("dk", &dk, &grads.dk), ("dv", &dv, &grads.dv)] {
        let err = grad_error(&back(got), want, &grads.dv);
        // Gradients go through one more rounding (the stored output) in low precision.
        let bound = if T::DTYPE == DType::F32 { 2.0 * tol } else { tol };
        if err > bound {
            return Err(format!("{name} rel err {err:.3e} > {bound:.0e}"));
        }
    }
    Ok(())
}

fn backend(isa: Isa) -> CpuBackend {
    CpuBackend::new(2).unwrap().with_isa(isa).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn f32_matches_reference(case in dilated_case()) {
        let be = backend(Isa::detect());
        check_case::<f32>(&be, &case).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn f32_portable_matches_reference(case in dilated_case()) {
        let be = backend(Isa::Portable);
        check_case::<f32>(&be, &case).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn f32_larger_cases_match_reference(case in dilated_case_with(300, 160)) {
        let be = backend(Isa::detect());
        check_case::<f32>(&be, &case).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn bf16_matches_reference(case in dilated_case()) {
        let be = backend(Isa::detect());
        check_case::<bf16>(&be, &case).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn f16_matches_reference(case in dilated_case()) {
        let be = backend(Isa::detect());
        check_case::<f16>(&be, &case).map_err(TestCaseError::fail)?;
    }
}

/// Fixed cases spanning several key tiles (64), query chunks (128) and work units, with
/// head_dim not a multiple of 16, both mixings, causal or not, ragged tails.
#[test]
fn multi_tile_cases_match_reference() {
    let cases = [
        (&[256, 512][..], &[1, 2][..], Mixing::LongNet, true, 600, 2, 40),
        (&[256, 512][..], &[1, 2][..], Mixing::LongNet, false, 530, 1, 64),
        (&[200, 400, 700][..], &[1, 3, 5][..], Mixing::HeadGroups, true, 700, 4, 24),
        (&[300][..], &[1][..], Mixing::HeadGroups, false, 301, 1, 72),
        // Enough whole segments for the fused backward, with a causal ragged tail.
        (&[128, 256][..], &[1, 2][..], Mixing::HeadGroups, true, 900, 3, 64),
        (&[96, 160][..], &[1, 3][..], Mixing::HeadGroups, false, 777, 2, 20),
    ];
    for (i, (w, r, mixing, causal, n, h, d)) in cases.into_iter().enumerate() {
        let cfg = DilatedConfig::builder().segments(w).dilations(r).mixing(mixing).causal(causal).build().unwrap();
        let case = DilatedCase { cfg, shape: Shape4::new(1, n, h, d).unwrap(), seed: 100 + i as u64 };
        for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
            check_case::<f32>(&backend(isa), &case).unwrap_or_else(|e| panic!("case {i} {}: {e}", isa.as_str()));
        }
    }
}

/// Every supported kernel path agrees with the portable path (and both with the reference).
#[test]
fn simd_paths_agree_with_portable() {
    let cfg =
        DilatedConfig::builder().segments(&[128, 256]).dilations(&[1, 4]).mixing(Mixing::LongNet).build().unwrap();
    let shape = Shape4::new(2, 300, 3, 64).unwrap();
    let n = shape.numel();
    let (q, k, v) = (random_vec(1, n), random_vec(2, n), random_vec(3, n));
    let (want, _) = backend(Isa::Portable).forward_vec(&cfg, shape, &q, &k, &v).unwrap();
    for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
        let (got, _) = backend(isa).forward_vec(&cfg, shape, &q, &k, &v).unwrap();
        let err = rel_l2_error(&got, &want);
        assert!(err < 1e-6, "{} vs portable: {err:.3e}", isa.as_str());
        println!("{} vs portable: rel err {err:.3e}", isa.as_str());
    }
}
