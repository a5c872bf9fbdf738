//! Every golden file in `../shared/golden/dilated` through the ring: every
//! strategy x layout x world size 1..=8, forward (out, lse) and gradients.

mod common;

use attn_ring::{Layout, Strategy};
use attn_testkit::golden::{check_case, golden_dir, load_dir};
use common::RingBackend;

#[test]
fn ring_matches_every_golden_file() {
    let dir = golden_dir().join("dilated");
    let cases = load_dir(&dir).expect("golden dir");
    assert!(cases.len() >= 9, "expected the dilated golden files in {}", dir.display());
    let mut runs = 0;
    let mut failures = Vec::new();
    for (path, case) in cases {
        let case = case.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let seq = case.attn_shape().unwrap().q.seq;
        for world in 1..=8 {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                if layout.check(seq, world).is_err() {
                    continue;
                }
                for strategy in [Strategy::Auto, Strategy::Ring, Strategy::AllGather] {
                    let backend = RingBackend { world, layout, strategy };
                    let report = check_case(&case, Some(&backend), None);
                    runs += 1;
                    if !report.passed() {
                        failures.push(report.to_string());
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {runs} runs failed:\n{}", failures.len(), failures.join("\n"));
    assert_eq!(runs, 9 * 8 * 2 * 3);
}
