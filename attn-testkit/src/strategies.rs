//! proptest strategies: small valid dilated-attention cases, and invalid inputs.

use attn_core::{AttnShape, DilatedConfig, Mixing, Shape4};
use proptest::prelude::*;

use crate::rng::random_vec;

/// A property test's case count: `cases`, or `PROPTEST_CASES` where it is set. proptest's
/// default config reads that variable, but an explicit count would hide it; the valgrind
/// run sets a few cases, a deeper run sets many.
pub fn proptest_cases(cases: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases)
}

/// A valid case: config, query shape (self-attention) and an input seed.
#[derive(Debug, Clone)]
pub struct DilatedCase {
    pub cfg: DilatedConfig,
    pub shape: Shape4,
    pub seed: u64,
}

impl DilatedCase {
    pub fn attn_shape(&self) -> AttnShape {
        AttnShape::self_attn(self.shape)
    }
    /// Seeded q, k, v, grad_out (standard normal).
    pub fn inputs(&self) -> [Vec<f32>; 4] {
        let n = self.shape.numel();
        [0, 1, 2, 3].map(|i| random_vec(self.seed.wrapping_mul(4).wrapping_add(i), n))
    }
}

fn patterns(max_g: usize, max_w: usize) -> impl Strategy<Value = Vec<(usize, usize)>> {
    prop::collection::vec((1..=max_w).prop_flat_map(|w| (Just(w), 1..=w.min(4))), 1..=max_g)
}

/// Head dims of the default cases: below, at and between SIMD widths.
const SMALL_HEAD_DIMS: [usize; 6] = [1, 4, 5, 8, 16, 20];

/// Valid configs with sizes up to `max_seq` tokens (ragged tails, `w > n`, any mixing).
pub fn dilated_case_with(max_seq: usize, max_w: usize) -> impl Strategy<Value = DilatedCase> {
    dilated_case_in(1..=max_seq, max_w, SMALL_HEAD_DIMS.to_vec())
}

/// Valid configs with a sequence length in `seq`, segments up to `max_w` and a head dim
/// drawn from `head_dims`.
pub fn dilated_case_in(
    seq: std::ops::RangeInclusive<usize>,
    max_w: usize,
    head_dims: Vec<usize>,
) -> impl Strategy<Value = DilatedCase> {
    (patterns(3, max_w), any::<bool>(), any::<bool>(), prop::option::weighted(0.2, 0.05f64..2.0))
        .prop_flat_map(move |(pats, longnet, causal, scale)| {
            let (seq, head_dims) = (seq.clone(), head_dims.clone());
            let g = pats.len();
            let mixing = if longnet { Mixing::LongNet } else { Mixing::HeadGroups };
            let min_heads = if longnet { 1 } else { g };
            let (w, r): (Vec<usize>, Vec<usize>) = pats.into_iter().unzip();
            let cfg = DilatedConfig::builder()
                .segments(&w)
                .dilations(&r)
                .mixing(mixing)
                .causality(causal.into())
                .maybe_scale(scale)
                .build()
                .expect("strategy builds valid configs");
            (Just(cfg), 1..=2usize, seq, min_heads..=min_heads + 2, prop::sample::select(head_dims), any::<u64>())
        })
        .prop_map(|(cfg, b, n, h, d, seed)| DilatedCase {
            cfg,
            shape: Shape4::new(b, n, h, d).expect("nonzero small shape"),
            seed,
        })
}

/// The default small valid case (sequences up to 48, segments up to 24).
pub fn dilated_case() -> impl Strategy<Value = DilatedCase> {
    dilated_case_with(48, 24)
}

/// An input some validation step must reject.
#[derive(Debug, Clone)]
pub enum InvalidInput {
    /// Segment lengths, dilation rates and scale for `DilatedConfig::builder`.
    Config { segments: Vec<usize>, rates: Vec<usize>, scale: Option<f64> },
    /// A valid config whose HeadGroups mode needs more heads than given.
    TooFewHeads { groups: usize, heads: usize },
    /// Shape dims for `Shape4::new` with a zero or an overflowing product.
    Shape { dims: [usize; 4] },
    /// q, k, v dims that disagree for self-attention.
    Qkv { q: Vec<usize>, k: Vec<usize>, v: Vec<usize> },
}

/// Invalid configs and shapes; every one must give an `AttnError`, never a panic.
pub fn invalid_input() -> impl Strategy<Value = InvalidInput> {
    let bad_config = prop_oneof![
        Just(InvalidInput::Config { segments: vec![], rates: vec![], scale: None }),
        (prop::collection::vec(1..64usize, 1..4), prop::collection::vec(1..4usize, 1..4))
            .prop_filter("different lengths", |(s, r)| s.len() != r.len())
            .prop_map(|(segments, rates)| InvalidInput::Config { segments, rates, scale: None }),
        (1..4usize, 0..3usize).prop_map(|(g, z)| {
            let mut segments = vec![8; g];
            segments[z % g] = 0;
            InvalidInput::Config { segments, rates: vec![1; g], scale: None }
        }),
        (1..4usize, 0..3usize).prop_map(|(g, z)| {
            let mut rates = vec![1; g];
            rates[z % g] = 0;
            InvalidInput::Config { segments: vec![8; g], rates, scale: None }
        }),
        (1..32usize, 1..8usize).prop_map(|(w, extra)| InvalidInput::Config {
            segments: vec![w],
            rates: vec![w + extra],
            scale: None
        }),
        prop::sample::select(vec![0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY])
            .prop_map(|s| InvalidInput::Config { segments: vec![8], rates: vec![2], scale: Some(s) }),
    ];
    let too_few = (2..6usize)
        .prop_flat_map(|g| (Just(g), 1..g))
        .prop_map(|(groups, heads)| InvalidInput::TooFewHeads { groups, heads });
    let shape = prop_oneof![
        (0..4usize, prop::array::uniform4(1..9usize)).prop_map(|(z, mut dims)| {
            dims[z] = 0;
            InvalidInput::Shape { dims }
        }),
        (prop::array::uniform4(1usize << 16..1usize << 20)).prop_map(|dims| InvalidInput::Shape { dims }),
        Just(InvalidInput::Shape { dims: [usize::MAX, 2, 1, 1] }),
    ];
    let qkv = prop_oneof![
        (1..4usize, 1..9usize).prop_map(|(a, b)| InvalidInput::Qkv {
            q: vec![1, b, 2, 4],
            k: vec![1, b + a, 2, 4],
            v: vec![1, b + a, 2, 4]
        }),
        (1..9usize).prop_map(|b| InvalidInput::Qkv { q: vec![1, b, 2, 4], k: vec![1, b, 2, 4], v: vec![1, b, 3, 4] }),
        (1..9usize).prop_map(|b| InvalidInput::Qkv { q: vec![1, b, 2, 4], k: vec![1, b, 2], v: vec![1, b, 2, 4] }),
        (1..9usize).prop_map(|b| InvalidInput::Qkv { q: vec![2, b, 2, 4], k: vec![1, b, 2, 4], v: vec![1, b, 2, 4] }),
    ];
    prop_oneof![bad_config, too_few, shape, qkv]
}

impl InvalidInput {
    /// Run the validation this input targets; `Ok(())` would be a bug.
    pub fn validate(&self) -> attn_core::Result<()> {
        match self {
            InvalidInput::Config { segments, rates, scale } => {
                DilatedConfig::builder().segments(segments).dilations(rates).maybe_scale(*scale).build().map(|_| ())
            }
            InvalidInput::TooFewHeads { groups, heads } => {
                let cfg = DilatedConfig::new(&vec![8; *groups], &vec![1; *groups])?;
                cfg.validate_heads(*heads)
            }
            InvalidInput::Shape { dims } => Shape4::new(dims[0], dims[1], dims[2], dims[3]).map(|_| ()),
            InvalidInput::Qkv { q, k, v } => AttnShape::check(q, k, v).map(|_| ()),
        }
    }
}
