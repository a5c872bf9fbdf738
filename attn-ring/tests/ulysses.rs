//! Ulysses and the hybrid (`Strategy::Ulysses`, `Strategy::Hybrid`) compute the
//! single-device function: every golden file of `conformance/dilated` and
//! `conformance/features` (refused with the typed error where the Ulysses degree exceeds
//! the heads), random feature cases against the float64 reference (gradients into the
//! LSE included), uneven head splits and grouped key/value heads read by several slots;
//! the bytes each rank sends equal `expected_bytes`.

use crate::common;

use attn_core::error::TensorName;
use attn_core::{AttnError, AttnShape, DType, DilatedConfig, Mixing, Pass, Shape4, TensorView};
use attn_ring::comm::EmulatedNccl;
use attn_ring::{Layout, Plan, RingProblem, Strategy, ThreadComm, expected_bytes, run_problem_backward_on};
use attn_ring::{run_in_process, run_problem_on};
use attn_testkit::feature_case::{feature_case, judge_lse_gradients};
use attn_testkit::golden::{DilatedBackend, GoldenCase, Problem, check_case, golden_dir, load_dir};
use attn_testkit::judge::{Expected, judge_backward, judge_forward, verdict};
use attn_testkit::random_vec;
use common::{CommBackend, RingBackend, views};
use proptest::prelude::*;

/// The (world, strategy) pairs CI runs: Ulysses at P = 2, 3, 4, 8 and the hybrid at
/// (U, P) = (2, 4), (2, 6), (4, 8).
const RUNS: [(usize, Strategy); 7] = [
    (2, Strategy::Ulysses),
    (3, Strategy::Ulysses),
    (4, Strategy::Ulysses),
    (8, Strategy::Ulysses),
    (4, Strategy::Hybrid { ulysses: 2 }),
    (6, Strategy::Hybrid { ulysses: 2 }),
    (8, Strategy::Hybrid { ulysses: 4 }),
];

fn refused(r: Result<(), AttnError>) -> bool {
    matches!(r, Err(AttnError::Unsupported { backend: "ring", .. }))
}

/// Every file of `dir` at every run and layout through the in-process ring.
fn golden_dir_through_heads(dir: &str) -> (usize, usize) {
    golden_dir_through(dir, &RUNS, |world, layout, strategy| RingBackend { world, layout, strategy })
}

/// Every file of `dir` through `backend(world, layout, strategy)` at every run and layout:
/// (passed, refused) counts; a file with fewer heads than the degree must be refused.
pub(crate) fn golden_dir_through<B: DilatedBackend>(
    dir: &str,
    runs: &[(usize, Strategy)],
    backend: impl Fn(usize, Layout, Strategy) -> B,
) -> (usize, usize) {
    golden_dir_through_layouts(dir, runs, &[Layout::Contiguous, Layout::Zigzag], backend)
}

/// [`golden_dir_through`] at the given layouts only (a sampled sweep).
pub(crate) fn golden_dir_through_layouts<B: DilatedBackend>(
    dir: &str,
    runs: &[(usize, Strategy)],
    layouts: &[Layout],
    backend: impl Fn(usize, Layout, Strategy) -> B,
) -> (usize, usize) {
    let cases: Vec<GoldenCase> =
        load_dir(&golden_dir().join(dir)).unwrap().into_iter().map(|(_, c)| c.unwrap()).collect();
    assert_eq!(cases.len(), if dir == "blocks" { 8 } else { 9 }, "{dir}");
    let (mut passed, mut refusals, mut failures) = (0, 0, Vec::new());
    // Runs whose heads travel (the rest have every segment inside a rank: segment-local).
    let mut exchanged = 0;
    for case in &cases {
        let (cfg, shape) = (case.config().unwrap(), case.attn_shape().unwrap());
        for &(world, strategy) in runs {
            for &layout in layouts {
                if layout.check(shape.q.seq, world).is_err() {
                    continue;
                }
                let ring = backend(world, layout, strategy);
                let problem = RingProblem::new(&cfg, shape, layout, strategy, world).with_masks(case.masks().into());
                exchanged += usize::from(Plan::new(problem).is_ok_and(|plan| plan.head_split().is_some()));
                if shape.q.heads < strategy.ulysses_degree(world).unwrap() {
                    let problem = Problem::new(&cfg, shape).with_masks(case.masks());
                    let [q, k, v, go] = ["q", "k", "v", "grad_out"].map(|t| case.tensor(t).unwrap().data.as_slice());
                    assert!(refused(ring.forward(&problem, [q, k, v]).map(|_| ())), "{} {}", case.name, ring.name());
                    assert!(refused(ring.backward(&problem, [q, k, v], go).map(|_| ())), "{}", case.name);
                    refusals += 1;
                    continue;
                }
                let report = check_case(case, Some(&ring), None);
                if report.passed() {
                    passed += 1;
                } else {
                    failures.push(format!("{strategy:?} {report}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} runs failed:\n{}", failures.len(), failures.join("\n"));
    assert!(exchanged > 0 || passed == 0, "{dir} {runs:?}: no run exchanged heads");
    (passed, refusals)
}

#[test]
fn head_strategies_match_every_dilated_golden_file() {
    let (passed, refused) = golden_dir_through_heads("dilated");
    assert!(passed > 0 && refused > 0);
    assert_eq!((passed, refused), (DILATED_COUNTS.0, DILATED_COUNTS.1));
}

#[test]
fn head_strategies_match_every_feature_golden_file() {
    let (passed, refused) = golden_dir_through_heads("features");
    assert!(passed > 0 && refused > 0);
    assert_eq!((passed, refused), (FEATURE_COUNTS.0, FEATURE_COUNTS.1));
}

/// The block-mask files through the head strategies: each rank's heads keep their own
/// mask rows (`conformance/blocks` has masks per head and per batch row).
#[test]
fn head_strategies_match_every_block_mask_file() {
    let (passed, refused) = golden_dir_through_heads("blocks");
    assert!(passed > 0);
    assert_eq!((passed, refused), BLOCK_COUNTS);
}

/// Over the emulated NCCL transport (a send completes only when its peer receives), where
/// an all-to-all or a ring step that relied on buffered sends would time out: the feature
/// files at Ulysses P = 2, 4 and the hybrid (2, 4) and (2, 6) (a ring of three groups).
#[test]
fn head_strategies_over_emulated_nccl_match_the_feature_files() {
    let runs = [
        (2, Strategy::Ulysses),
        (4, Strategy::Ulysses),
        (4, Strategy::Hybrid { ulysses: 2 }),
        (6, Strategy::Hybrid { ulysses: 2 }),
    ];
    let counts = golden_dir_through("features", &runs, |world, layout, strategy| CommBackend {
        label: "emulated-nccl",
        world,
        layout,
        strategy,
        join: |p| EmulatedNccl::world_with_timeout(p, std::time::Duration::from_secs(20)),
    });
    assert_eq!(counts, (68, 4));
}

/// (passed, refused) runs of the golden sweeps above.
const DILATED_COUNTS: (usize, usize) = (102, 24);
const FEATURE_COUNTS: (usize, usize) = (100, 26);
const BLOCK_COUNTS: (usize, usize) = (62, 50);

/// Ulysses degrees that divide `world`, as strategies.
fn head_strategies(world: usize) -> Vec<Strategy> {
    let mut s = vec![Strategy::Ulysses];
    s.extend((1..world).filter(|&u| world.is_multiple_of(u)).map(|ulysses| Strategy::Hybrid { ulysses }));
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(64), max_shrink_iters: 64, ..ProptestConfig::default() })]

    /// Random configs and features (grouped heads, padding, packing, windows, causal,
    /// both mixings) on every world size, layout and Ulysses degree the heads allow,
    /// forward and gradients (with and without a gradient into the LSE) within the f32
    /// bound of the float64 reference.
    #[test]
    fn head_strategies_equal_the_reference(
        case in feature_case(1..=40, 24, vec![1, 4, 8]),
        world in 1usize..=8,
        pick in any::<prop::sample::Index>(),
        layout in prop::sample::select(vec![Layout::Contiguous, Layout::Zigzag]),
    ) {
        prop_assume!(layout.check(case.shape.q.seq, world).is_ok());
        let strategies = head_strategies(world);
        let strategy = strategies[pick.index(strategies.len())];
        prop_assume!(case.shape.q.heads >= strategy.ulysses_degree(world).unwrap());
        let backend = RingBackend { world, layout, strategy };
        let problem = case.problem();
        let v = passes_against_the_reference(&backend, &problem, case.inputs());
        prop_assert!(v.is_ok(), "{strategy:?}: {}", v.unwrap_err());
        let v = judge_lse_gradients(&backend, &case);
        prop_assert!(v.is_ok(), "{strategy:?}: {}", v.unwrap_err());
    }
}

/// Heads that do not divide the degree and key/value heads read by several slots (and a
/// slot reading two): 8 query heads over 2 key/value heads at U = 3 (slots of 3, 3, 2
/// heads: slot 1 reads both key/value heads), 6 over 2 at U = 4, 5 over 1 at U = 4, every
/// mixing, causal or not, against the float64 reference.
#[test]
fn uneven_heads_and_shared_kv_heads_equal_the_reference() {
    let mut runs = 0;
    for (heads, kv_heads, world, strategy) in [
        (8, 2, 3, Strategy::Ulysses),
        (6, 2, 4, Strategy::Ulysses),
        (5, 1, 4, Strategy::Ulysses),
        (7, 1, 6, Strategy::Hybrid { ulysses: 3 }),
        (6, 3, 8, Strategy::Hybrid { ulysses: 4 }),
    ] {
        for (mixing, causal) in [(Mixing::HeadGroups, false), (Mixing::LongNet, true), (Mixing::HeadGroups, true)] {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                let backend = RingBackend { world, layout, strategy };
                let v = uneven_heads_case(&backend, (heads, kv_heads), mixing, causal);
                assert!(
                    v.is_ok(),
                    "heads {heads}/{kv_heads} {strategy:?} p={world} {layout:?} {mixing:?}: {}",
                    v.unwrap_err()
                );
                runs += 1;
            }
        }
    }
    assert_eq!(runs, 5 * 3 * 2);
}

/// The bytes each rank sends equal `expected_bytes`, forward and backward, for Ulysses and
/// hybrids at several worlds, layouts and head splits (uneven, grouped).
#[test]
fn measured_bytes_equal_the_formula() {
    let cfg = DilatedConfig::builder().segments(&[8, 16, 64]).dilations(&[1, 2, 4]).causal().build().unwrap();
    let mut checked = 0;
    for (heads, kv_heads) in [(4, 4), (6, 2), (5, 1)] {
        for world in [2, 3, 4, 6] {
            for strategy in head_strategies(world).into_iter().filter(|s| s.ulysses_degree(world).unwrap() <= heads) {
                for layout in [Layout::Contiguous, Layout::Zigzag] {
                    let shape = AttnShape {
                        q: Shape4::new(2, 45, heads, 4).unwrap(),
                        kv: Shape4::named(TensorName::Key, [2, 45, kv_heads, 4]).unwrap(),
                    };
                    let (nq, nk) = (shape.q.numel(), shape.kv.numel());
                    let (q, k, v, go) = (random_vec(1, nq), random_vec(2, nk), random_vec(3, nk), random_vec(4, nq));
                    let problem = RingProblem::new(&cfg, shape, layout, strategy, world);
                    let plan = Plan::new(problem.clone()).unwrap();
                    let qkv = views(shape, &q, &k, &v).unwrap();
                    let f = run_problem_on(ThreadComm::world(world).unwrap(), &problem, qkv).unwrap();
                    let got: Vec<u64> = f.stats.iter().map(|s| s.data_bytes_sent).collect();
                    let want = expected_bytes(&plan, DType::F32, Pass::Forward);
                    assert_eq!(got, want, "fwd {heads}/{kv_heads} p={world} {strategy:?} {layout:?}");
                    let gov = TensorView::contiguous(TensorName::GradOutput, &go, shape.q).unwrap();
                    let b = run_problem_backward_on(ThreadComm::world(world).unwrap(), &problem, qkv, gov).unwrap();
                    let got: Vec<u64> = b.stats.iter().map(|s| s.data_bytes_sent).collect();
                    let want = expected_bytes(&plan, DType::F32, Pass::Backward);
                    assert_eq!(got, want, "bwd {heads}/{kv_heads} p={world} {strategy:?} {layout:?}");
                    assert!(got.iter().all(|&x| x > 0));
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 40, "{checked}");
}

/// A degree above the heads is the typed `Unsupported` naming the fix, on every rank; a
/// degree not dividing the world is `InvalidArgument`; the strategy parses from its label.
#[test]
fn bad_degrees_are_typed_errors() {
    let cfg = DilatedConfig::builder().segments(&[8]).dilations(&[1]).build().unwrap();
    let shape = Shape4::new(1, 16, 2, 4).unwrap();
    let x = random_vec(5, shape.numel());
    let view = || TensorView::contiguous(TensorName::Query, &x, shape).unwrap();
    let e = run_in_process(4, &cfg, Layout::Contiguous, Strategy::Ulysses, view(), view(), view()).unwrap_err();
    assert!(matches!(e, AttnError::Unsupported { backend: "ring", .. }), "{e}");
    assert!(e.to_string().contains("U <= heads"), "{e}");
    let odd = Strategy::Hybrid { ulysses: 3 };
    let e = run_in_process(4, &cfg, Layout::Contiguous, odd, view(), view(), view()).unwrap_err();
    assert!(matches!(e, AttnError::InvalidArgument(ref m) if m.contains("does not divide")), "{e}");
    for s in [Strategy::Ulysses, Strategy::Hybrid { ulysses: 4 }] {
        assert_eq!(Strategy::parse(&s.label()).unwrap(), s);
    }
    assert!(Strategy::parse("hybrid").is_err() && Strategy::parse("hybrid:x").is_err());
}

/// Where segments span ranks Ulysses sends less: dense attention (one segment of n, rate
/// 1), forward, non-causal, `kv_heads = heads`, at P = 8, each rank's bytes are at most 0.3x
/// the ring's (about 2/P by the formulas, which the measured counts above equal).
#[test]
fn ulysses_sends_a_quarter_of_the_rings_bytes_on_dense_attention_at_eight_ranks() {
    let n = 4096;
    let cfg = DilatedConfig::builder().segments(&[n]).dilations(&[1]).build().unwrap();
    let shape = Shape4::new(1, n, 8, 64).unwrap();
    let bytes = |strategy| {
        let plan = Plan::new(attn_ring::problem_for(&cfg, shape, Layout::Contiguous, strategy, 8)).unwrap();
        expected_bytes(&plan, DType::F32, Pass::Forward).into_iter().max().unwrap()
    };
    let (ulysses, ring) = (bytes(Strategy::Ulysses), bytes(Strategy::Ring));
    let ratio = ulysses as f64 / ring as f64;
    assert!(ratio <= 0.3 && ratio > 0.2, "ulysses {ulysses} / ring {ring} = {ratio}");
}

/// Where every segment sits inside a rank's rows (contiguous layout, segments 8 and 16
/// on chunks of 16 or 32 rows) Ulysses and the hybrid have nothing to exchange: every
/// rank sends no data, forward and backward, and the result is the reference's.
#[test]
fn head_strategies_send_nothing_where_every_segment_sits_inside_a_rank() {
    let cfg = DilatedConfig::builder().segments(&[8, 16]).dilations(&[1, 2]).causal().build().unwrap();
    let shape: AttnShape = Shape4::new(2, 64, 4, 4).unwrap().into();
    let (nq, nk) = (shape.q.numel(), shape.kv.numel());
    let (q, k, v, go) = (random_vec(1, nq), random_vec(2, nk), random_vec(3, nk), random_vec(4, nq));
    for (world, strategy) in [(2, Strategy::Ulysses), (4, Strategy::Ulysses), (4, Strategy::Hybrid { ulysses: 2 })] {
        let problem = RingProblem::new(&cfg, shape, Layout::Contiguous, strategy, world);
        let qkv = views(shape, &q, &k, &v).unwrap();
        let f = run_problem_on(ThreadComm::world(world).unwrap(), &problem, qkv).unwrap();
        let gov = TensorView::contiguous(TensorName::GradOutput, &go, shape.q).unwrap();
        let b = run_problem_backward_on(ThreadComm::world(world).unwrap(), &problem, qkv, gov).unwrap();
        let sent: Vec<(u64, u64)> =
            f.stats.iter().zip(&b.stats).map(|(f, b)| (f.data_bytes_sent, b.data_bytes_sent)).collect();
        assert!(sent.iter().all(|&s| s == (0, 0)), "p={world} {strategy:?}: {sent:?}");
        let backend = RingBackend { world, layout: Layout::Contiguous, strategy };
        passes_against_the_reference(
            &backend,
            &Problem::new(&cfg, shape),
            [q.clone(), k.clone(), v.clone(), go.clone()],
        )
        .unwrap_or_else(|e| panic!("p={world} {strategy:?}: {e}"));
    }
}

/// A `[2, 37, heads, 4]` problem with `kv_heads` K/V heads through `backend`: output, LSE
/// and gradients judged row by row against the float64 reference.
pub fn uneven_heads_case(
    backend: &impl DilatedBackend,
    (heads, kv_heads): (usize, usize),
    mixing: Mixing,
    causal: bool,
) -> Result<(), String> {
    let cfg = DilatedConfig::builder()
        .segments(&[6, 12, 40])
        .dilations(&[1, 2, 4])
        .mixing(mixing)
        .causality(causal.into())
        .build()
        .unwrap();
    let shape = AttnShape {
        q: Shape4::new(2, 37, heads, 4).unwrap(),
        kv: Shape4::named(TensorName::Key, [2, 37, kv_heads, 4]).unwrap(),
    };
    let (nq, nk) = (shape.q.numel(), shape.kv.numel());
    let (q, k, v, go) = (random_vec(1, nq), random_vec(2, nk), random_vec(3, nk), random_vec(4, nq));
    passes_against_the_reference(backend, &Problem::new(&cfg, shape), [q, k, v, go])
}

/// The forward and backward of `problem` through `backend` on f32 `[q, k, v, grad_out]`:
/// output, LSE and gradients judged row by row against the float64 reference.
fn passes_against_the_reference(
    backend: &impl DilatedBackend,
    problem: &Problem<'_>,
    [q, k, v, go]: [Vec<f32>; 4],
) -> Result<(), String> {
    let fwd = backend.forward(problem, [&q, &k, &v]).unwrap();
    let g = backend.backward(problem, [&q, &k, &v], &go).unwrap();
    let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
    let want = Expected::for_problem(problem, [&wide(&q), &wide(&k), &wide(&v)], Some(&wide(&go))).unwrap();
    let mut rows = judge_forward(&want, &fwd.out, &fwd.lse, DType::F32);
    rows.extend(judge_backward(&want, [&g.dq, &g.dk, &g.dv], DType::F32));
    verdict(&rows).map_err(|e| e.to_string())
}
