//! `attn-golden DIR [--backend NAME] [--dtype T] [--world-size N --strategy S --layout L]`:
//! runs every `*.safetensors` conformance case in DIR through one backend, prints
//! one line per case and `N passed, M failed`, and exits non-zero on any failure
//! or when DIR holds no case.
#![forbid(unsafe_code)]

mod backends;
mod options;

use std::process::ExitCode;

use attn_testkit::golden::{CaseReport, check_case, load_dir};

fn main() -> ExitCode {
    let opts = match options::Options::parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("attn-golden: {e}\n\n{}", options::USAGE);
            return ExitCode::from(2);
        }
    };
    let backends = match backends::select(&opts) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("attn-golden: {e}");
            return ExitCode::from(2);
        }
    };
    let cases = match load_dir(&opts.dir) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("attn-golden: {e}");
            return ExitCode::from(2);
        }
    };
    let (mut passed, mut failed) = (0usize, 0usize);
    for (path, case) in cases {
        let report = match case {
            Ok(case) => check_case(&case, backends.dilated.as_deref(), backends.multihead.as_deref()),
            Err(e) => {
                let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                CaseReport::failed(&name, &backends.label, e)
            }
        };
        println!("{report}");
        if report.passed() {
            passed += 1;
        } else {
            failed += 1;
        }
    }
    println!("{passed} passed, {failed} failed");
    if passed + failed == 0 {
        eprintln!("attn-golden: no *.safetensors case in {}", opts.dir.display());
        return ExitCode::FAILURE;
    }
    if failed > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}
