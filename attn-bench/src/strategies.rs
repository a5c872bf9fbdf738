//! The sequence-parallel strategies section: the row strategies (ring pass, all-gather)
//! against the head strategies (Ulysses, the hybrid at `U` = 2 and 4) and what
//! `Strategy::Auto` picks among them, on `P` = 2, 4, 8 in-process ranks (and the one-rank
//! baseline the peak memory falls from), f32, 8 heads,
//! forward: time, per-rank bytes and messages sent and per-rank peak memory, measured on
//! the bench patterns (segments 2048, 4096, 8192 at rates 1, 2, 4; under `--full` at 65536
//! and, first call only, 262144: [`pattern_seqs`]); for dense attention
//! (one segment of `n`, rate 1) bytes, messages and the workspace bound per rank from the
//! plan's formulas at 16384 and 262144 ([`FORMULA_SEQS`]), measured at 16384 too under
//! `--full` (a dense call at 16384 takes seconds on 2 cores).

use attn_ring::{Layout, Strategy};

use crate::case::{CaseSpec, DILATIONS, Implementation, SEGMENTS, ring_case};
use crate::cli::SuiteSize;
use crate::measure::Timing;

/// The report section of these cases.
pub const SECTION: &str = "strategies";
/// World sizes of the section.
pub const WORLDS: [usize; 3] = [2, 4, 8];
/// World sizes measured: the one-rank baseline, then [`WORLDS`].
pub const MEASURED_WORLDS: [usize; 4] = [1, 2, 4, 8];
/// Dense attention's lengths counted from the formulas.
pub const FORMULA_SEQS: [usize; 2] = [16 * 1024, 256 * 1024];
/// The measured dense length (under `--full`).
pub const DENSE_SEQ: usize = 16 * 1024;

/// The strategies compared on `world` ranks: ring, all-gather, Ulysses, the hybrids of
/// degree 2 and 4 where the degree is below the world and divides it, and Auto; on one
/// rank every strategy is the same local call, so the ring alone.
pub fn strategies(world: usize) -> Vec<Strategy> {
    if world == 1 {
        return vec![Strategy::Ring];
    }
    let mut out = vec![Strategy::Ring, Strategy::AllGather, Strategy::Ulysses];
    out.extend(
        [2, 4]
            .into_iter()
            .filter(|&u| u < world && world.is_multiple_of(u))
            .map(|ulysses| Strategy::Hybrid { ulysses }),
    );
    out.push(Strategy::Auto);
    out
}

/// The bench patterns' sequence lengths of a suite size, each with its timing (the
/// longest, under `--full`, its first call alone).
pub fn pattern_seqs(size: SuiteSize) -> Vec<(usize, Timing)> {
    match size {
        SuiteSize::Quick | SuiteSize::Default => vec![(8 * 1024, Timing::Suite)],
        SuiteSize::Full => vec![(64 * 1024, Timing::Suite), (256 * 1024, Timing::FirstCallOnly)],
    }
}

/// Dense attention (one segment of `n` at rate 1) on one rank.
pub fn dense(n: usize) -> CaseSpec {
    CaseSpec::dilated(Implementation::Cpu, n, &[n], &[1])
}

/// Every case of the section, in run order: the bench patterns at every world and
/// strategy (at each of [`pattern_seqs`] with its timing), under `--full` dense attention
/// at [`DENSE_SEQ`] too (its first call alone). The quick suite measures `P` = 1 and 4 only.
pub fn cases(size: SuiteSize) -> Vec<(CaseSpec, Timing)> {
    let mut bases: Vec<(CaseSpec, Timing)> = pattern_seqs(size)
        .into_iter()
        .map(|(n, timing)| (CaseSpec::dilated(Implementation::Cpu, n, &SEGMENTS, &DILATIONS), timing))
        .collect();
    if size == SuiteSize::Full {
        bases.push((dense(DENSE_SEQ), Timing::FirstCallOnly));
    }
    let worlds: &[usize] = if size == SuiteSize::Quick { &[1, 4] } else { &MEASURED_WORLDS };
    let mut out = Vec::new();
    for (base, timing) in &bases {
        for &p in worlds {
            for s in strategies(p) {
                out.push((ring_case(base, p, s, Layout::Contiguous), *timing));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::CaseKind;

    #[test]
    fn every_world_compares_each_strategy_on_valid_cases() {
        assert_eq!(strategies(2).len(), 4);
        assert_eq!(
            strategies(4),
            [Strategy::Ring, Strategy::AllGather, Strategy::Ulysses, Strategy::Hybrid { ulysses: 2 }, Strategy::Auto]
        );
        assert!(strategies(8).contains(&Strategy::Hybrid { ulysses: 4 }));
        for size in [SuiteSize::Quick, SuiteSize::Default, SuiteSize::Full] {
            let cases = cases(size);
            for (spec, _) in &cases {
                assert_eq!(spec.kind, CaseKind::Ring);
                let problem = crate::ring_runner::problem(spec).unwrap();
                attn_ring::Plan::new(problem).unwrap();
            }
            let dense_rows = cases.iter().filter(|(s, _)| s.segments == [s.seq_len]).count();
            assert_eq!(dense_rows, if size == SuiteSize::Full { 16 } else { 0 }, "{size:?}");
            let longest = cases.iter().filter(|(s, _)| s.seq_len == 256 * 1024).count();
            assert_eq!(longest, if size == SuiteSize::Full { 16 } else { 0 }, "{size:?}");
        }
        assert_eq!(strategies(1), [Strategy::Ring]);
        assert_eq!(cases(SuiteSize::Default).len(), 1 + 4 + 5 + 6);
        assert_eq!(cases(SuiteSize::Quick).len(), 1 + 5);
    }
}
