//! Ring attention on burn tensors: in-process ranks (1 to 4, both layouts, the row plan's
//! strategies and the head strategies) each run the op through their `RingBackend` on
//! their own rows under autodiff, and the ranks' rows put together equal the
//! single-device op, output, LSE and gradients (of a loss using both); the conformance
//! files pass through the ranks; ranks that disagree get a typed error, every one.

use crate::common::ring::{BurnRing, RankOptions, Split, ring_ranks, ring_run};
use crate::common::{Inputs, Layout, Run, attend_op, run_inputs};
use attn_burn::AttnOptions;
use attn_core::{AttnError, Causality, DilatedConfig, KeyPaddingMask, Mixing};
use attn_ring::{Layout as RingLayout, Strategy};
use attn_testkit::golden::{check_case, golden_dir, load_dir};
use attn_testkit::{random_vec, rel_l2_error};
use burn_tensor::DType;

/// q `[b, n, h, d]`, k and v with `KV_HEADS` heads (grouped).
const Q: [usize; 4] = [2, 24, 4, 8];
const KV_HEADS: usize = 2;

/// The bound on the ranks' f32 results against the single-device op's.
const BOUND: f64 = 1e-5;

fn configs() -> Vec<AttnOptions> {
    let cfg = |b: attn_core::DilatedConfigBuilder| b.build().expect("config");
    let [b, n, ..] = Q;
    let mut padding = vec![false; b * n];
    padding[n - 3..n].iter_mut().for_each(|p| *p = true);
    padding[n + 5] = true;
    vec![
        AttnOptions::new(cfg(DilatedConfig::builder()
            .segments(&[6, 12, 24])
            .dilations(&[1, 2, 4])
            .causality(Causality::Causal))),
        AttnOptions::new(cfg(DilatedConfig::builder().segments(&[8, 24]).dilations(&[1, 3]).mixing(Mixing::LongNet))),
        AttnOptions::new(cfg(DilatedConfig::builder().window(5, 2)))
            .with_key_padding(KeyPaddingMask::new(padding, b, n).expect("mask")),
    ]
}

/// The LSEs agree: `-inf` on the same rows, the rest within the bound.
fn lse_agree(got: &[f32], want: &[f32]) -> bool {
    let same_empty = got.iter().zip(want).all(|(g, w)| g.is_finite() == w.is_finite());
    let finite = |x: &[f32]| x.iter().zip(want).filter(|(_, w)| w.is_finite()).map(|(g, _)| *g).collect::<Vec<_>>();
    same_empty && rel_l2_error(&finite(got), &finite(want)) <= BOUND
}

/// The worst of out and the gradients against `want`, and whether the LSEs agree.
fn compare(got: &Run, want: &Run) -> (f64, bool) {
    let grads = got.grads.iter().zip(&want.grads).map(|(g, w)| rel_l2_error(g, w));
    (grads.fold(rel_l2_error(&got.out, &want.out), f64::max), lse_agree(&got.lse, &want.lse))
}

fn splits() -> Vec<Split> {
    let mut all = Vec::new();
    for world in 1..=4 {
        for layout in [RingLayout::Contiguous, RingLayout::Zigzag] {
            for strategy in [Strategy::Auto, Strategy::Ring, Strategy::AllGather] {
                all.push(Split { world, layout, strategy });
            }
        }
    }
    // The head strategies: the all-to-all over all ranks, and in groups of 2.
    all.push(Split { world: 4, layout: RingLayout::Zigzag, strategy: Strategy::Ulysses });
    all.push(Split { world: 4, layout: RingLayout::Contiguous, strategy: Strategy::Hybrid { ulysses: 2 } });
    all
}

#[test]
fn ring_ranks_equal_the_single_device_op_output_lse_and_gradients() {
    let [b, n, h, d] = Q;
    let kv = [b, n, KV_HEADS, d];
    let [q, k, v, go] = [(1, Q), (2, kv), (3, kv), (4, Q)].map(|(s, dims)| random_vec(s, dims.iter().product()));
    let gl = random_vec(5, b * n * h);
    let inputs = Inputs { qkv: [&q, &k, &v], grad_out: &go, grad_lse: Some(&gl), dims: [Q, kv] };
    let mut runs = 0;
    for opts in configs() {
        let want = run_inputs(inputs, &|q, k, v| attend_op(&opts, q, k, v), DType::F32, Layout::Bshd).expect("single");
        for split in splits() {
            let got = ring_run(&opts, inputs, DType::F32, split).expect("ring ranks");
            let (worst, lse_ok) = compare(&got, &want);
            let label = format!("{:?} {split:?}", opts.config.mixing());
            assert!(worst <= BOUND, "{label}: off by {worst:.2e}");
            assert!(lse_ok, "{label}: lse");
            runs += 1;
        }
    }
    assert_eq!(runs, 3 * (4 * 2 * 3 + 2));
}

/// One dtype per world size, so every dtype flex stores runs on ranks.
#[test]
fn conformance_files_pass_through_ring_ranks() {
    let dtypes = crate::common::golden_op::DTYPES;
    let mut checked = 0;
    for dir in ["dilated", "features"] {
        let dir = golden_dir().join(dir);
        let cases = load_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        assert_eq!(cases.len(), 9, "the files of {}", dir.display());
        for (path, case) in cases {
            let case = case.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let seq = case.attn_shape().expect("shape").q.seq;
            for (world, dtype) in (1..=4).zip(dtypes) {
                for layout in [RingLayout::Contiguous, RingLayout::Zigzag] {
                    if layout.check(seq, world).is_err() {
                        continue;
                    }
                    let ring = BurnRing { dtype, split: Split { world, layout, strategy: Strategy::Auto } };
                    let report = check_case(&case, Some(&ring), None);
                    assert!(report.passed(), "{report}");
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 18 * 4, "only {checked} runs");
}

/// The inputs of the disagreement tests.
fn small_inputs(values: &[Vec<f32>; 4]) -> Inputs<'_> {
    let [q, k, v, go] = values;
    Inputs { qkv: [q, k, v], grad_out: go, grad_lse: None, dims: [[1, 16, 2, 4]; 2] }
}

#[test]
fn ranks_that_disagree_get_a_typed_error_on_every_rank() {
    let values = [1, 2, 3, 4].map(|s| random_vec(s, 16 * 2 * 4));
    let inputs = small_inputs(&values);
    let split = Split { world: 3, layout: RingLayout::Zigzag, strategy: Strategy::Auto };
    let cfg = |d: usize| DilatedConfig::builder().segments(&[8]).dilations(&[d]).build().expect("config");
    // Rank 1 attends another pattern.
    let patterns = |rank: usize, _: &[usize]| Ok(AttnOptions::new(cfg(if rank == 1 { 2 } else { 1 })));
    // Rank 2 alone passes a key padding mask (of its rows).
    let padding = |rank: usize, pos: &[usize]| {
        let opts = AttnOptions::new(cfg(1));
        let n = pos.len();
        Ok(if rank == 2 { opts.with_key_padding(KeyPaddingMask::new(vec![false; n], 1, n)?) } else { opts })
    };
    for (what, opts) in [("patterns", &patterns as &RankOptions<'_>), ("padding", &padding)] {
        let ranks = ring_ranks(opts, inputs, DType::F32, split);
        assert_eq!(ranks.len(), split.world);
        for (rank, r) in ranks.into_iter().enumerate() {
            let err = r.err().unwrap_or_else(|| panic!("{what}: rank {rank} succeeded"));
            assert!(matches!(err, AttnError::RankDisagreement(_)), "{what}: rank {rank}: {err:?}");
        }
    }
}
