//! Block masks in `CpuBackend` against the float64 reference on the same rounded inputs,
//! row by row: random masks (random block sizes, ragged last blocks, per batch / per head
//! or broadcast, densities from none to all) over the feature cases (both mixings,
//! windows, causal, grouped heads, key padding, packed sequences) and keys of their own
//! length; forward output and LSE, gradients, and gradients with a gradient into the LSE;
//! f32 on every ISA this CPU runs, bf16 and f16 on the detected one. A mask that does not
//! fit the call is a typed error.

use attn_core::{AttnError, AttnShape, BlockDims, BlockMaskBuf, DilatedConfig, Masks, Shape4};
use attn_kernels::{CpuBackend, Isa};
use attn_testkit::golden::DilatedBackend;
use attn_testkit::judge::{Expected, judge_backward, judge_forward, round_to, verdict};
use attn_testkit::problem::Problem;
use attn_testkit::{FeatureCase, Typed, feature_case, random_vec};
use half::{bf16, f16};
use proptest::prelude::*;

/// A feature case with a block mask.
#[derive(Debug, Clone)]
struct BlockCase {
    case: FeatureCase,
    mask: BlockMaskBuf,
}

impl BlockCase {
    fn problem(&self) -> Problem<'_> {
        self.case.problem().with_masks(Masks { block: Some(self.mask.view()), ..self.case.masks() })
    }
}

/// A hash of a mask entry, uniform in `[0, 1)`.
fn unit(seed: u64, i: usize) -> f64 {
    let mut x = seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x ^ (x >> 31)) as f64 / 2f64.powi(64)
}

/// Mask sizes for `case` at `block_size`: per batch row or broadcast, per head or
/// broadcast; with packed sequences, the longest sequence's square.
fn dims(case: &FeatureCase, block_size: usize, per_batch: bool, per_head: bool) -> BlockDims {
    let (q, kv) = (case.shape.q, case.shape.kv);
    let (nq, nk) = match &case.cu_seqlens {
        Some(cu) => {
            let longest = cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
            (longest, longest)
        }
        None => (q.seq, kv.seq),
    };
    BlockDims {
        batch: if per_batch { q.batch } else { 1 },
        heads: if per_head { q.heads } else { 1 },
        q_blocks: nq.div_ceil(block_size),
        k_blocks: nk.div_ceil(block_size),
    }
}

/// Keys of `kv_seq` rows (dilated cases without packing; windows stay self-attention),
/// the padding redrawn for them.
fn with_keys(mut case: FeatureCase, kv_seq: usize) -> FeatureCase {
    if case.cu_seqlens.is_some() || case.cfg.window().is_some() {
        return case;
    }
    case.shape.kv = case.shape.kv.with_seq(kv_seq).expect("small shape");
    if case.padding.is_some() {
        let n = case.shape.kv.batch * kv_seq;
        case.padding = Some((0..n).map(|i| unit(case.seed ^ 0xbad, i) < 0.3).collect());
    }
    case
}

/// Block-masked cases: block sizes 1 to 12 (most lengths leave a ragged last block), a
/// density of kept tiles from 0 to 1, cross-attention half the time.
fn block_case(
    seq: std::ops::RangeInclusive<usize>,
    max_w: usize,
    head_dims: Vec<usize>,
) -> impl Strategy<Value = BlockCase> {
    let max_kv = *seq.end() + 20;
    (
        feature_case(seq, max_w, head_dims),
        1..=12usize,
        prop_oneof![Just(0.0), Just(1.0), 0.0f64..1.0],
        any::<(bool, bool)>(),
        prop::option::of(1..=max_kv),
        any::<u64>(),
    )
        .prop_map(|(case, block_size, density, (per_batch, per_head), kv_seq, seed)| {
            let case = match kv_seq {
                Some(m) => with_keys(case, m),
                None => case,
            };
            let d = dims(&case, block_size, per_batch, per_head);
            let flat = |b: usize, h: usize, i: usize, j: usize| ((b * d.heads + h) * d.q_blocks + i) * d.k_blocks + j;
            let mask = BlockMaskBuf::from_fn(d, block_size, |b, h, i, j| unit(seed, flat(b, h, i, j)) < density)
                .expect("valid mask");
            BlockCase { case, mask }
        })
}

/// Forward, backward and backward with a gradient into the LSE of `c` through `backend`
/// against the reference on the inputs rounded to its dtype.
fn check(backend: &dyn DilatedBackend, c: &BlockCase) -> Result<(), String> {
    let p = c.problem();
    let [q, k, v, go] = c.case.inputs();
    let dtype = backend.dtype();
    let r = [&q, &k, &v, &go].map(|x| round_to(dtype, x).into_iter().map(f64::from).collect::<Vec<_>>());
    let fwd = backend.forward(&p, [&q, &k, &v]).map_err(|e| e.to_string())?;
    let g = backend.backward(&p, [&q, &k, &v], &go).map_err(|e| e.to_string())?;
    let want = Expected::for_problem(&p, [&r[0], &r[1], &r[2]], Some(&r[3])).map_err(|e| e.to_string())?;
    let mut rows = judge_forward(&want, &fwd.out, &fwd.lse, dtype);
    rows.extend(judge_backward(&want, [&g.dq, &g.dk, &g.dv], dtype));
    verdict(&rows).map_err(|e| format!("{} {dtype:?}: {e}", backend.name()))?;
    // A gradient into the LSE (none where a row attends nothing: its LSE is -inf).
    let mut gl = c.case.grad_lse();
    gl.iter_mut().zip(&fwd.lse).filter(|(_, l)| !l.is_finite()).for_each(|(g, _)| *g = f32::NAN);
    let gl64: Vec<f64> = gl.iter().map(|&x| f64::from(x)).collect();
    let want = Expected::for_problem_lse(&p, [&r[0], &r[1], &r[2]], &r[3], &gl64).map_err(|e| e.to_string())?;
    let g = backend.backward_lse(&p, [&q, &k, &v], &go, &gl).map_err(|e| e.to_string())?;
    verdict(&judge_backward(&want, [&g.dq, &g.dk, &g.dv], dtype))
        .map_err(|e| format!("{} {dtype:?} with grad_lse: {e}", backend.name()))
}

fn cpu(isa: Isa) -> CpuBackend {
    CpuBackend::new(2).unwrap().with_isa(isa).unwrap()
}

/// f32 on every ISA this CPU runs, bf16 and f16 on the detected one.
fn check_all(c: &BlockCase) -> Result<(), TestCaseError> {
    let mut backends: Vec<Box<dyn DilatedBackend>> = Isa::ALL
        .into_iter()
        .filter(|i| i.is_supported())
        .map(|i| Box::new(Typed::<_, f32>::new(cpu(i))) as Box<dyn DilatedBackend>)
        .collect();
    backends.push(Box::new(Typed::<_, bf16>::new(cpu(Isa::detect()))));
    backends.push(Box::new(Typed::<_, f16>::new(cpu(Isa::detect()))));
    for b in &backends {
        check(b.as_ref(), c).map_err(|e| TestCaseError::fail(format!("{e}\n{c:?}")))?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(64), max_shrink_iters: 60, ..ProptestConfig::default() })]

    #[test]
    fn small_block_masked_cases_match_the_reference(c in block_case(1..=48, 24, vec![1, 5, 8, 16])) {
        check_all(&c)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(12), max_shrink_iters: 20, ..ProptestConfig::default() })]

    #[test]
    fn longer_block_masked_cases_match_the_reference(c in block_case(100..=400, 200, vec![8, 40, 72])) {
        check_all(&c)?;
    }
}

/// Long enough for several work units, key tiles and 64-query lane blocks per piece:
/// block size 64 with a ragged last block, causal, grouped heads, per-head masks, and
/// keys of their own length.
#[test]
fn long_fixed_cases_match_the_reference() {
    let causal = DilatedConfig::builder().segments(&[512, 1100]).dilations(&[1, 2]).causal().build().unwrap();
    let shape = AttnShape { q: Shape4::new(1, 1100, 4, 32).unwrap(), kv: Shape4::new(1, 1100, 2, 32).unwrap() };
    let cross = AttnShape { q: Shape4::new(1, 700, 2, 32).unwrap(), kv: Shape4::new(1, 1000, 2, 32).unwrap() };
    let plain = DilatedConfig::new(&[2000], &[1]).unwrap();
    for (cfg, shape, block_size) in [(causal, shape, 64), (plain, cross, 100)] {
        let case = FeatureCase { cfg, shape, padding: None, cu_seqlens: None, seed: 77 };
        let d = dims(&case, block_size, false, true);
        let mask = BlockMaskBuf::from_fn(d, block_size, |_, h, i, j| i == j || unit(h as u64, i * 64 + j) < 0.3)
            .expect("valid mask");
        check_all(&BlockCase { case, mask }).unwrap();
    }
}

/// A mask that does not fit the call (sizes for other lengths or more heads) is
/// `InvalidBlockMask` naming it, forward and backward.
#[test]
fn a_mask_that_does_not_fit_is_a_typed_error() {
    let cfg = DilatedConfig::new(&[8], &[1]).unwrap();
    let shape = AttnShape::self_attn(Shape4::new(1, 8, 2, 4).unwrap());
    let x = random_vec(3, shape.q.numel());
    let typed = Typed::<_, f32>::new(CpuBackend::new(1).unwrap());
    for d in [
        BlockDims { batch: 1, heads: 1, q_blocks: 3, k_blocks: 2 },
        BlockDims { batch: 1, heads: 3, q_blocks: 2, k_blocks: 2 },
    ] {
        let mask = BlockMaskBuf::from_fn(d, 4, |_, _, _, _| true).unwrap();
        let p = Problem::new(&cfg, shape).with_masks(Masks { block: Some(mask.view()), ..Masks::NONE });
        let Err(e) = typed.forward(&p, [&x, &x, &x]) else { panic!("{d:?}: forward ran") };
        assert!(matches!(e, AttnError::InvalidBlockMask(_)), "{e:?}");
        let Err(e) = typed.backward(&p, [&x, &x, &x], &x) else { panic!("{d:?}: backward ran") };
        assert!(matches!(e, AttnError::InvalidBlockMask(_)), "{e:?}");
    }
}
