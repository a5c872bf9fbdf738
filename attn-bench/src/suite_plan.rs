//! Which cases each suite (`--quick`, default, `--full`) measures, by report section.

use attn_core::{DType, Mixing};
use attn_ring::{Layout, Strategy};

use crate::blocks;
use crate::case::{CaseKind, CaseSpec, DILATIONS, Implementation, SEGMENTS, SMALL_SEGMENTS, ring_case};
use crate::cli::SuiteSize;
use crate::features;
use crate::measure::Timing;
use crate::strategies;

/// Ring strategies and the default one used by the scaling tables.
pub const STRATEGIES: [Strategy; 3] = [Strategy::Auto, Strategy::Ring, Strategy::AllGather];
pub const DEFAULT_STRATEGY: Strategy = Strategy::Auto;
/// World sizes of the ring-size sweep.
pub const SWEEP_WORLDS: [usize; 5] = [1, 2, 4, 8, 16];

/// One planned case and the report section it belongs to.
#[derive(Debug, Clone)]
pub struct Planned {
    pub section: &'static str,
    pub spec: CaseSpec,
    pub timing: Timing,
}

/// The sequence lengths and world sizes of a suite.
#[derive(Debug, Clone)]
pub struct SuiteShape {
    pub single_seqs: Vec<usize>,
    pub ring_seqs: Vec<usize>,
    pub sweep_seq: usize,
    pub reference_seqs: Vec<usize>,
    pub variants: bool,
    /// Sequence lengths of the multihead layer cases.
    pub multihead_seqs: Vec<usize>,
    /// Every ring strategy in both layouts in the comparison (else zigzag for `auto` only).
    pub all_layouts: bool,
}

impl SuiteShape {
    pub fn of(size: SuiteSize) -> Self {
        let k = 1024;
        match size {
            // 40-50 s of measurement on 2 shared cores: every table and plot, smaller
            // ring problems (the sweep at 8K) and fewer comparison layouts.
            SuiteSize::Quick => SuiteShape {
                single_seqs: vec![2 * k, 4 * k, 8 * k, 16 * k, 32 * k, 64 * k],
                ring_seqs: vec![2 * k, 8 * k],
                sweep_seq: 8 * k,
                reference_seqs: vec![2 * k],
                variants: false,
                multihead_seqs: vec![8 * k],
                all_layouts: false,
            },
            // About 3 minutes of measurement on 2 quiet cores: the one-rank table to 128K,
            // the ring table at 2K, 8K, 32K and the sweep's 64K.
            SuiteSize::Default => SuiteShape {
                single_seqs: vec![2 * k, 4 * k, 8 * k, 16 * k, 32 * k, 64 * k, 128 * k],
                ring_seqs: vec![2 * k, 8 * k, 32 * k],
                sweep_seq: 64 * k,
                reference_seqs: vec![2 * k, 4 * k],
                variants: true,
                multihead_seqs: vec![8 * k, 16 * k],
                all_layouts: true,
            },
            SuiteSize::Full => SuiteShape {
                single_seqs: (11..=20).map(|e| 1usize << e).collect(),
                ring_seqs: (11..=18).map(|e| 1usize << e).collect(),
                sweep_seq: 256 * k,
                reference_seqs: vec![2 * k, 4 * k, 8 * k],
                variants: true,
                multihead_seqs: vec![8 * k, 16 * k],
                all_layouts: true,
            },
        }
    }
}

/// Every case of a suite, in run order.
pub fn plan(size: SuiteSize, threads: usize) -> Vec<Planned> {
    let shape = SuiteShape::of(size);
    let mut cases = Vec::new();
    let mut push_case = |section, mut spec: CaseSpec, timing| {
        spec.threads = threads;
        cases.push(Planned { section, spec, timing });
    };
    let mut push = |section, spec: CaseSpec| push_case(section, spec, Timing::Suite);
    // Scaling: one rank per sequence length, then the ring over world sizes.
    for &n in &shape.single_seqs {
        push("scaling", CaseSpec::dilated(Implementation::Cpu, n, &SEGMENTS, &DILATIONS));
    }
    let mut ring_seqs = shape.ring_seqs.clone();
    if !ring_seqs.contains(&shape.sweep_seq) {
        ring_seqs.push(shape.sweep_seq);
    }
    for &n in &ring_seqs {
        for &p in &SWEEP_WORLDS {
            let base = CaseSpec::dilated(Implementation::Cpu, n, &SEGMENTS, &DILATIONS);
            push("scaling", ring_case(&base, p, DEFAULT_STRATEGY, Layout::Contiguous));
        }
    }
    // Comparison 1: a size the f64 reference can do in about a second. CUDA rows are
    // planned on every build: without the feature or a GPU they report why they skipped.
    for &n in &shape.reference_seqs {
        for imp in [Implementation::Reference, Implementation::Cpu, Implementation::Cuda] {
            push("comparison", CaseSpec::dilated(imp, n, &SMALL_SEGMENTS, &DILATIONS));
        }
        push(
            "comparison",
            ring_case(
                &CaseSpec::dilated(Implementation::Cpu, n, &SMALL_SEGMENTS, &DILATIONS),
                2,
                Strategy::Auto,
                Layout::Contiguous,
            ),
        );
    }
    // Comparison 2: the peer script's default case, every ring strategy and layout.
    let base = CaseSpec::dilated(Implementation::Cpu, 8192, &SEGMENTS, &DILATIONS);
    push("comparison", base.clone());
    let cuda = CaseSpec::dilated(Implementation::Cuda, 8192, &SEGMENTS, &DILATIONS);
    push("comparison", cuda.clone());
    push("comparison", CaseSpec { dtype: DType::BF16, ..cuda });
    for strategy in STRATEGIES {
        for layout in [Layout::Contiguous, Layout::Zigzag] {
            if shape.all_layouts || layout == Layout::Contiguous || strategy == DEFAULT_STRATEGY {
                push("comparison", ring_case(&base, 4, strategy, layout));
            }
        }
    }
    // Multihead: projections + attention + norm + output projection.
    for &n in &shape.multihead_seqs {
        let mut mh = CaseSpec::dilated(Implementation::Cpu, n, &SEGMENTS, &DILATIONS);
        mh.kind = CaseKind::Multihead;
        push("multihead", mh);
    }
    if shape.variants {
        let n = 16 * 1024;
        let v = CaseSpec::dilated(Implementation::Cpu, n, &SEGMENTS, &DILATIONS);
        push("variants", v.clone());
        push("variants", CaseSpec { causal: true, ..v.clone() });
        push("variants", CaseSpec { dtype: DType::BF16, ..v.clone() });
        push("variants", CaseSpec { dtype: DType::F16, ..v.clone() });
        push("variants", CaseSpec { backward: true, ..v.clone() });
        push("variants", CaseSpec { mixing: Mixing::LongNet, ..v.clone() });
        let mut h = v.clone();
        h.kind = CaseKind::Hilbert;
        push("variants", h);
        push("variants", ring_case(&CaseSpec { causal: true, ..v.clone() }, 4, Strategy::Auto, Layout::Contiguous));
        push("variants", ring_case(&CaseSpec { causal: true, ..v.clone() }, 4, Strategy::Auto, Layout::Zigzag));
        push("variants", ring_case(&CaseSpec { backward: true, ..v }, 4, Strategy::Auto, Layout::Contiguous));
    }
    // Grouped heads, packed sequences, windows (`features` says which).
    for (spec, timing) in features::cases(size) {
        push_case(features::SECTION, spec, timing);
    }
    // Block masks: time against the all-kept mask, ring bytes (`blocks` says which).
    for (spec, timing) in blocks::cases(size) {
        push_case(blocks::SECTION, spec, timing);
    }
    // Ring, all-gather, Ulysses, hybrid and Auto side by side (`strategies` says which).
    for (spec, timing) in strategies::cases(size) {
        push_case(strategies::SECTION, spec, timing);
    }
    cases
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_planned_case_is_valid_and_sweep_covers_all_world_sizes() {
        for size in [SuiteSize::Quick, SuiteSize::Default, SuiteSize::Full] {
            let p = plan(size, 2);
            for c in &p {
                c.spec.config().unwrap();
                c.spec.attn_shape().unwrap();
            }
            assert!(p.iter().any(|c| c.section == features::SECTION), "{size:?}");
            let sweep = SuiteShape::of(size).sweep_seq;
            for w in SWEEP_WORLDS {
                let ring = |c: &&Planned| c.spec.kind == CaseKind::Ring && c.spec.seq_len == sweep;
                assert!(p.iter().filter(ring).any(|c| c.spec.world_size == w), "{size:?} P={w}");
            }
            // Every strategy and the CUDA rows are in the comparison of every suite.
            let cmp = |imp: &str| p.iter().any(|c| c.section == "comparison" && c.spec.implementation.as_str() == imp);
            assert!(["reference", "cpu", "cuda", "ring-auto", "ring-ring", "ring-allgather"].into_iter().all(cmp));
        }
    }

    #[test]
    fn ring_tables_cover_their_lengths_at_every_world_size() {
        let full: Vec<usize> = (11..=18).map(|e| 1 << e).collect();
        for (size, seqs) in [(SuiteSize::Default, vec![2048, 8192, 32768, 65536]), (SuiteSize::Full, full)] {
            let p = plan(size, 2);
            for n in seqs {
                for w in SWEEP_WORLDS {
                    let hit =
                        |c: &Planned| c.section == "scaling" && c.spec.kind == CaseKind::Ring && c.spec.seq_len == n;
                    assert!(p.iter().any(|c| hit(c) && c.spec.world_size == w), "{size:?} seq {n} P={w}");
                }
            }
        }
    }
}
