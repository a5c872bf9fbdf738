//! The block-sparse section of the suite: which cases it measures at each suite size.
//!
//! One pattern over the whole sequence at rate 1, block size 128, f32, 8 heads of 64, on
//! `CpuBackend`: random block masks keeping `round(f * nb)` key blocks of each query
//! block (the diagonal among them) and `local_window` masks of `round(f * nb)` blocks, at
//! f = 5, 10, 25, 50 and 100%, forward and forward+backward, each timed against the
//! all-kept mask (the random mask at 100%) of the same pass. Then ring bytes at 4
//! in-process ranks (contiguous layout, ring strategy, one forward call each) for the
//! local window masks and the all-kept mask, against `attn_ring::expected_bytes`.

use attn_ring::{Layout, Strategy};

use crate::block_sparse::{BlockSparse, SparseKind};
use crate::case::{CaseSpec, Implementation, ring_case};
use crate::cli::SuiteSize;
use crate::measure::Timing;

/// The report section of these cases.
pub const SECTION: &str = "blocks";
/// Block size, kept shares and seed of the random masks.
pub const BLOCK: usize = 128;
pub const KEPT_PERCENT: [usize; 5] = [5, 10, 25, 50, 100];
pub const SEED: u64 = 2026;
/// Ranks, strategy and layout of the ring bytes rows.
pub const RING_WORLD: usize = 4;
pub const RING_STRATEGY: Strategy = Strategy::Ring;
pub const RING_LAYOUT: Layout = Layout::Contiguous;

/// The sequence length of a suite size's block-sparse rows. The all-kept forward+backward
/// at 16384 takes about 15 s a call on 2 cores and at 65536 about 16 times that, so the
/// quick suite stays at 4096 and 65536 is `--full`'s.
pub fn seq(size: SuiteSize) -> usize {
    match size {
        SuiteSize::Quick => 4096,
        SuiteSize::Default => 16 * 1024,
        SuiteSize::Full => 64 * 1024,
    }
}

/// The mask `kind` at `kept_percent`.
pub fn mask(kind: SparseKind, kept_percent: usize) -> BlockSparse {
    BlockSparse { block_size: BLOCK, kept_percent, seed: SEED, kind }
}

/// The all-kept mask every row is timed against.
pub fn all_kept() -> BlockSparse {
    mask(SparseKind::Random, 100)
}

/// Every case of the section in run order: the timed rows (each mask forward, then
/// forward+backward), then the ring rows timed by their first call alone (their point
/// is bytes).
pub fn cases(size: SuiteSize) -> Vec<(CaseSpec, Timing)> {
    let n = seq(size);
    let whole = CaseSpec::dilated(Implementation::Cpu, n, &[n], &[1]);
    let mut out = Vec::new();
    for kind in [SparseKind::Random, SparseKind::LocalWindow] {
        for kept_percent in KEPT_PERCENT {
            for backward in [false, true] {
                let spec = CaseSpec { block_sparse: Some(mask(kind, kept_percent)), backward, ..whole.clone() };
                out.push((spec, Timing::Suite));
            }
        }
    }
    let ring_masks = KEPT_PERCENT.map(|p| mask(SparseKind::LocalWindow, p));
    for b in std::iter::once(all_kept()).chain(ring_masks) {
        let spec = CaseSpec { block_sparse: Some(b), ..whole.clone() };
        out.push((ring_case(&spec, RING_WORLD, RING_STRATEGY, RING_LAYOUT), Timing::FirstCallOnly));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::case::CaseKind;

    #[test]
    fn every_suite_times_both_masks_at_every_share_and_passes_and_counts_ring_bytes() {
        for (size, n) in [(SuiteSize::Quick, 4096), (SuiteSize::Default, 16384), (SuiteSize::Full, 65536)] {
            let cases = cases(size);
            assert_eq!(cases.len(), 2 * 5 * 2 + 6, "{size:?}");
            for (spec, timing) in &cases {
                spec.config().unwrap();
                spec.attn_shape().unwrap();
                assert_eq!(
                    (spec.seq_len, spec.segments.as_slice(), spec.dilations.as_slice()),
                    (n, &[n][..], &[1][..])
                );
                assert_eq!((spec.heads, spec.head_dim, spec.dtype), (8, 64, attn_core::DType::F32));
                let b = spec.block_sparse.unwrap();
                assert_eq!((b.block_size, b.seed), (128, 2026));
                let ring = spec.kind == CaseKind::Ring;
                assert_eq!(*timing, if ring { Timing::FirstCallOnly } else { Timing::Suite }, "{}", spec.label());
                if ring {
                    assert_eq!(
                        (spec.world_size, spec.layout, spec.strategy),
                        (4, Some(RING_LAYOUT), Some(Strategy::Ring))
                    );
                    assert!(!spec.backward && (b == all_kept() || b.kind == SparseKind::LocalWindow));
                }
            }
            for kind in [SparseKind::Random, SparseKind::LocalWindow] {
                for p in KEPT_PERCENT {
                    for backward in [false, true] {
                        let hit = |s: &CaseSpec| {
                            s.kind == CaseKind::Dilated
                                && s.backward == backward
                                && s.block_sparse == Some(mask(kind, p))
                        };
                        assert_eq!(cases.iter().filter(|(s, _)| hit(s)).count(), 1, "{kind:?} {p}% {backward}");
                    }
                }
            }
        }
    }
}
