//! The float64 reference passes every dilated and feature conformance file (forward,
//! LSE, gradients): grouped key/value heads, key padding, packed sequences, windows and
//! block masks.

use attn_testkit::golden::{check_case, golden_dir, load_dir};
use attn_testkit::reference;

fn passes_every_file_in(dir: &str, expected: usize) {
    let cases = load_dir(&golden_dir().join(dir)).expect("golden dir readable");
    assert!(cases.len() == expected, "expected the {expected} files of {dir}/, found {}", cases.len());
    let mut failures = vec![];
    for (path, case) in cases {
        let case = case.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let report = check_case(&case, Some(&reference()), None);
        println!("{report}");
        // Forward, and dq/dk/dv: every dilated file has gradients; LongNet files also LSE.
        assert!(report.checks.len() >= 4, "{report}");
        if !report.passed() {
            failures.push(report.to_string());
        }
    }
    assert!(failures.is_empty(), "failures:\n{}", failures.join("\n"));
}

#[test]
fn reference_passes_every_dilated_golden_file() {
    passes_every_file_in("dilated", 9);
}

#[test]
fn reference_passes_every_feature_golden_file() {
    passes_every_file_in("features", 9);
}

/// The block-sparse files: the block mask ANDed with the pattern, padding and packing.
#[test]
fn reference_passes_every_block_golden_file() {
    passes_every_file_in("blocks", 8);
}
