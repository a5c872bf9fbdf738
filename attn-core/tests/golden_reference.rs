//! The float64 reference passes every dilated conformance file (forward, LSE, gradients).

use attn_testkit::golden::{check_case, golden_dir, load_dir};
use attn_testkit::reference;

#[test]
fn reference_passes_every_dilated_golden_file() {
    let cases = load_dir(&golden_dir().join("dilated")).expect("golden dir readable");
    assert!(cases.len() == 9, "expected the 9 conformance files, found {}", cases.len());
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
