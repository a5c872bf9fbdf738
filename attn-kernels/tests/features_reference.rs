//! The CPU backend with the attention features (grouped key/value heads, key padding,
//! packed sequences, sliding windows, each mixed with both dilated modes and causal)
//! against the float64 reference on the same rounded inputs, row by row, in f32 (the
//! detected and the portable kernels), bf16 and f16, with and without a gradient into the
//! LSE; small cases and cases long enough for several key tiles, query chunks and work
//! units.

use attn_kernels::{CpuBackend, Isa};
use attn_testkit::golden::DilatedBackend;
use attn_testkit::judge::{Expected, judge_backward, judge_forward, round_to, verdict};
use attn_testkit::{FeatureCase, Typed, feature_case, judge_lse_gradients};
use half::{bf16, f16};
use proptest::prelude::*;

/// Forward and backward of `case` through `backend` against the reference on the inputs
/// rounded to the backend's dtype.
fn check(backend: &dyn DilatedBackend, case: &FeatureCase) -> Result<(), String> {
    let problem = case.problem();
    let [q, k, v, go] = case.inputs();
    let fwd = backend.forward(&problem, [&q, &k, &v]).map_err(|e| e.to_string())?;
    let g = backend.backward(&problem, [&q, &k, &v], &go).map_err(|e| e.to_string())?;
    let dtype = backend.dtype();
    let [q, k, v, go] = [&q, &k, &v, &go].map(|x| round_to(dtype, x).into_iter().map(f64::from).collect::<Vec<_>>());
    let want = Expected::for_problem(&problem, [&q, &k, &v], Some(&go)).map_err(|e| e.to_string())?;
    let mut rows = judge_forward(&want, &fwd.out, &fwd.lse, dtype);
    rows.extend(judge_backward(&want, [&g.dq, &g.dk, &g.dv], dtype));
    verdict(&rows).map_err(|e| format!("{} {dtype:?}: {e}", backend.name()))
}

fn cpu(isa: Isa) -> CpuBackend {
    CpuBackend::new(2).unwrap().with_isa(isa).unwrap()
}

/// Every dtype on the detected kernels, and f32 on the portable ones.
fn check_all(case: &FeatureCase) -> Result<(), TestCaseError> {
    let backends: [Box<dyn DilatedBackend>; 4] = [
        Box::new(Typed::<_, f32>::new(cpu(Isa::detect()))),
        Box::new(Typed::<_, f32>::new(cpu(Isa::Portable))),
        Box::new(Typed::<_, bf16>::new(cpu(Isa::detect()))),
        Box::new(Typed::<_, f16>::new(cpu(Isa::detect()))),
    ];
    for b in &backends {
        check(b.as_ref(), case).map_err(|e| TestCaseError::fail(format!("{e}\n{case:?}")))?;
        judge_lse_gradients(b.as_ref(), case)
            .map_err(|e| TestCaseError::fail(format!("{} {:?}: {e}\n{case:?}", b.name(), b.dtype())))?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(96), max_shrink_iters: 100, ..ProptestConfig::default() })]

    #[test]
    fn small_feature_cases_match_the_reference(case in feature_case(1..=48, 24, vec![1, 4, 5, 8, 16, 20])) {
        check_all(&case)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(24), max_shrink_iters: 40, ..ProptestConfig::default() })]

    #[test]
    fn longer_feature_cases_match_the_reference(case in feature_case(100..=400, 200, vec![8, 20, 40, 72])) {
        check_all(&case)?;
    }
}

/// A fixed case per feature at a length that spans several units and key tiles: the
/// forward units of a window (2048-row units, keys around them), a grouped fused
/// backward, a padded split backward, packed lanes of mixed lengths.
#[test]
fn long_fixed_cases_match_the_reference() {
    use attn_core::{AttnShape, DilatedConfig, Mixing, Shape4};
    let be = Typed::<_, f32>::new(cpu(Isa::detect()));
    let window = DilatedConfig::builder().window(300, 20).causal().build().unwrap();
    let longnet =
        DilatedConfig::builder().segments(&[256, 512]).dilations(&[1, 2]).mixing(Mixing::LongNet).build().unwrap();
    let groups = DilatedConfig::new(&[128, 1024], &[1, 4]).unwrap();
    let shape =
        |b, n, h, kvh, d| AttnShape { q: Shape4::new(b, n, h, d).unwrap(), kv: Shape4::new(b, n, kvh, d).unwrap() };
    let pad = |b: usize, n: usize| Some((0..b * n).map(|i| i % 7 == 3 || (i % n) > n - 40).collect::<Vec<bool>>());
    for (cfg, shape, padding, cu_seqlens) in [
        (window.clone(), shape(1, 2600, 2, 1, 16), None, None),
        (longnet.clone(), shape(1, 1100, 4, 2, 16), pad(1, 1100), None),
        (groups, shape(2, 1030, 4, 2, 8), pad(2, 1030), None),
        (longnet, shape(1, 1500, 2, 1, 8), None, Some(vec![0, 1, 700, 701, 1500])),
        (window, shape(1, 900, 3, 3, 8), pad(1, 900), Some(vec![0, 450, 900])),
    ] {
        let case = FeatureCase { cfg, shape, padding, cu_seqlens, seed: 17 };
        check(&be, &case).unwrap_or_else(|e| panic!("{e}\n{:?} {:?}", case.cfg, case.shape));
    }
}
