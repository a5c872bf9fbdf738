//! The attention-features section of the suite: which cases it measures at each suite
//! size, and the seeded sequence lengths of its packed-against-padded rows.
//!
//! - Grouped-query attention, 8 query heads on 1 key/value head, against the same
//!   problem with K/V repeated to 8 heads by the caller (time and peak memory).
//! - 8 sequences of lengths drawn uniformly from `1..=max_len`, packed into one row
//!   with `cu_seqlens` against padded to the longest with a key padding mask (real
//!   tokens per second), causal, under the suite's dilated patterns and under dense
//!   attention, forward and, in the default and full suites, forward+backward.
//! - A causal sliding window `(4095, 0)` against dense causal attention (one segment of
//!   the whole sequence) of the same length.
//! - Bytes per rank on the ring (4 in-process ranks, contiguous and zigzag) for a causal
//!   and a two-sided window and for grouped heads under a dilated config whose segments
//!   span ranks, one call each, against the counts of `ring_bytes`. The strategy is
//!   all-gather, so every row goes straight from its owner to each rank that reads it.

use attn_core::Causality;
use attn_ring::{Layout, Strategy};

use crate::case::{CaseKind, CaseSpec, Implementation, VarLenLayout};
use crate::case::{DILATIONS, SEGMENTS, ring_case};
use crate::cli::SuiteSize;
use crate::inputs::SplitMix;
use crate::measure::Timing;

/// The report section of these cases.
pub const SECTION: &str = "features";
/// The seed of the packed/padded sequence lengths.
pub const LENGTHS_SEED: u64 = 2026;
/// Sequences in the packed/padded batch.
pub const SEQUENCES: usize = 8;
/// Query heads per key/value head of the grouped-query rows.
pub const GQA_GROUP: usize = 8;
/// The causal window (a causal window of 4096 keys) and the two-sided ring window.
pub const CAUSAL_WINDOW: [usize; 2] = [4095, 0];
pub const TWO_SIDED_WINDOW: [usize; 2] = [2048, 2048];
/// Ranks and strategy of the ring rows.
pub const RING_WORLD: usize = 4;
pub const RING_STRATEGY: Strategy = Strategy::AllGather;

/// The lengths of one suite size's feature cases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeatureSizes {
    /// Sequence length of the grouped-query, window and ring rows.
    pub seq: usize,
    /// Longest drawn sequence of the packed/padded rows.
    pub max_len: usize,
    /// Whether the packed/padded rows also run forward+backward.
    pub varlen_backward: bool,
}

impl FeatureSizes {
    pub fn of(size: SuiteSize) -> Self {
        match size {
            SuiteSize::Quick => FeatureSizes { seq: 16 * 1024, max_len: 4096, varlen_backward: false },
            SuiteSize::Default => FeatureSizes { seq: 16 * 1024, max_len: 4096, varlen_backward: true },
            // Dense causal attention at 65536 and the dense packed/padded backward at 16384
            // take seconds to tens of seconds a call on 2 cores: these rows are --full's.
            SuiteSize::Full => FeatureSizes { seq: 64 * 1024, max_len: 16 * 1024, varlen_backward: true },
        }
    }
}

/// `count` lengths drawn uniformly from `1..=max` by the SplitMix stream of `seed`.
pub fn draw_lengths(seed: u64, count: usize, max: usize) -> Vec<usize> {
    let mut rng = SplitMix::new(seed);
    (0..count).map(|_| 1 + rng.below(max as u64) as usize).collect()
}

/// The (segments, dilations) of the packed/padded rows: the suite's dilated patterns,
/// and dense attention (one segment of `max_len` at rate 1), where a padded query attends
/// every real key of its sequence.
pub fn varlen_patterns(max_len: usize) -> [(Vec<usize>, Vec<usize>); 2] {
    [(SEGMENTS.to_vec(), DILATIONS.to_vec()), (vec![max_len], vec![1])]
}

/// The ring's grouped-heads config at length `n`: segments `n/8, n/2, n` at rates 2, 8,
/// 16 (4096 selected rows each at 65536), so two of the three patterns span ranks.
pub fn ring_dilated(n: usize) -> CaseSpec {
    CaseSpec::dilated(Implementation::Cpu, n, &[n / 8, n / 2, n], &[2, 8, 16])
}

/// Timed calls at least of each packed/padded row (their ratio has a target).
pub const VARLEN_RUNS: usize = 3;

/// Every case of the section in run order, each with how it is timed: the ring rows by
/// their first call alone (their point is bytes, not time), the packed/padded rows at
/// least `VARLEN_RUNS` times.
pub fn cases(size: SuiteSize) -> Vec<(CaseSpec, Timing)> {
    let FeatureSizes { seq: n, max_len, varlen_backward } = FeatureSizes::of(size);
    let mut out = Vec::new();
    // Grouped-query attention against K/V repeated by the caller.
    let gqa =
        CaseSpec { kv_heads: Some(8 / GQA_GROUP), ..CaseSpec::dilated(Implementation::Cpu, n, &SEGMENTS, &DILATIONS) };
    out.push((gqa.clone(), Timing::Suite));
    out.push((CaseSpec { repeat_kv: true, ..gqa }, Timing::Suite));
    // Packed against padded, under the suite's dilated patterns and under dense attention.
    let lengths = draw_lengths(LENGTHS_SEED, SEQUENCES, max_len);
    for (segments, dilations) in varlen_patterns(max_len) {
        let causal = CaseSpec { causal: true, ..CaseSpec::dilated(Implementation::Cpu, 1, &segments, &dilations) };
        for backward in if varlen_backward { vec![false, true] } else { vec![false] } {
            let base = CaseSpec { backward, ..causal.clone() };
            for layout in [VarLenLayout::Packed, VarLenLayout::Padded] {
                let spec = CaseSpec::varlen(&base, (LENGTHS_SEED, max_len), &lengths, layout);
                out.push((spec, Timing::AtLeast(VARLEN_RUNS)));
            }
        }
    }
    // A causal window against dense causal attention.
    let [left, right] = CAUSAL_WINDOW;
    out.push((CaseSpec::window(Implementation::Cpu, n, (left, right), Causality::Causal), Timing::Suite));
    out.push((CaseSpec { causal: true, ..CaseSpec::dilated(Implementation::Cpu, n, &[n], &[1]) }, Timing::Suite));
    // Ring bytes per rank.
    let windows = [CaseSpec::window(Implementation::Cpu, n, (left, right), Causality::Causal), {
        let [l, r] = TWO_SIDED_WINDOW;
        CaseSpec::window(Implementation::Cpu, n, (l, r), Causality::Full)
    }];
    let grouped = [1, 8].map(|kv| CaseSpec { kv_heads: Some(kv), ..ring_dilated(n) });
    for base in windows.iter().chain(&grouped) {
        for layout in [Layout::Contiguous, Layout::Zigzag] {
            out.push((ring_case(base, RING_WORLD, RING_STRATEGY, layout), Timing::FirstCallOnly));
        }
    }
    debug_assert!(out.iter().all(|(s, _)| s.kind != CaseKind::Ring || s.world_size == RING_WORLD));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_are_seeded_uniform_draws_in_range() {
        let a = draw_lengths(LENGTHS_SEED, SEQUENCES, 16384);
        assert_eq!(a, draw_lengths(LENGTHS_SEED, SEQUENCES, 16384));
        assert_eq!(a.len(), SEQUENCES);
        assert!(a.iter().all(|&n| (1..=16384).contains(&n)), "{a:?}");
        assert_ne!(a, draw_lengths(LENGTHS_SEED + 1, SEQUENCES, 16384));
        // Every value of a small range comes up, none outside it, about equally often.
        let many = draw_lengths(7, 40_000, 4);
        let counts: Vec<usize> = (1..=4).map(|v| many.iter().filter(|&&n| n == v).count()).collect();
        assert_eq!(counts.iter().sum::<usize>(), 40_000);
        assert!(counts.iter().all(|&c| (9_400..=10_600).contains(&c)), "{counts:?}");
        assert_eq!(draw_lengths(3, 5, 1), [1; 5]);
    }

    #[test]
    fn every_suite_measures_each_row_kind_on_valid_cases() {
        for size in [SuiteSize::Quick, SuiteSize::Default, SuiteSize::Full] {
            let cases = cases(size);
            for (spec, _) in &cases {
                spec.config().unwrap();
                spec.attn_shape().unwrap();
                assert!(spec.uses_features() || spec.segments == [spec.seq_len], "{}", spec.label());
            }
            let n = FeatureSizes::of(size).seq;
            let has = |f: &dyn Fn(&CaseSpec) -> bool| cases.iter().any(|(s, _)| f(s));
            assert!(has(&|s| s.kv_heads == Some(1) && !s.repeat_kv && s.seq_len == n));
            assert!(has(&|s| s.kv_heads == Some(1) && s.repeat_kv));
            for layout in [VarLenLayout::Packed, VarLenLayout::Padded] {
                for (segments, _) in varlen_patterns(FeatureSizes::of(size).max_len) {
                    assert!(has(&|s| s.segments == segments
                        && s.varlen.as_ref().is_some_and(|v| v.layout == layout && v.lengths.len() == 8)));
                }
            }
            assert!(has(&|s| s.window == Some(CAUSAL_WINDOW) && s.kind == CaseKind::Dilated && s.causal));
            assert!(has(&|s| s.segments == [n] && s.dilations == [1] && s.causal));
            // Ring rows are measured by one call, packed/padded rows at least 3 times.
            for (s, timing) in &cases {
                let want = match (s.kind, &s.varlen) {
                    (CaseKind::Ring, _) => Timing::FirstCallOnly,
                    (_, Some(_)) => Timing::AtLeast(VARLEN_RUNS),
                    _ => Timing::Suite,
                };
                assert_eq!(*timing, want, "{}", s.label());
            }
            assert_eq!(cases.iter().filter(|(s, _)| s.kind == CaseKind::Ring).count(), 8);
            let bwd = cases.iter().filter(|(s, _)| s.varlen.is_some() && s.backward).count();
            assert_eq!(bwd, if size == SuiteSize::Quick { 0 } else { 4 });
        }
    }
}
