//! `attn-golden DIR [--backend NAME] [--dtype T] [--world-size N --strategy S [--ulysses U] --layout L]
//! [--expect N] [--expect-refused R]`: runs every `*.safetensors` conformance case in DIR
//! through one backend, prints one line per case and `N passed, M failed` (`, R refused`
//! where the backend refused cases as unsupported), and exits with one of the
//! [`exit`] statuses: non-zero on any failure, when DIR holds no case or not the
//! expected number, and a status of its own when the backend cannot run here.
#![forbid(unsafe_code)]

mod backends;
mod options;

use std::process::ExitCode;

use attn_core::AttnError;
use attn_testkit::golden::{CaseReport, check_case, load_dir};

/// The runner's exit statuses.
pub mod exit {
    /// Every case passed, and as many as `--expect` asked for.
    pub const PASSED: u8 = 0;
    /// A case failed, the directory held no case, or a count other than `--expect`, or
    /// a number of refused cases other than `--expect-refused` (default 0).
    pub const FAILED: u8 = 1;
    /// Bad options or an unreadable directory.
    pub const USAGE: u8 = 2;
    /// The backend is compiled in but cannot run here (no GPU, driver or library).
    pub const UNAVAILABLE: u8 = 3;
    /// The backend is not compiled into this binary (a cargo feature is off).
    pub const NOT_COMPILED: u8 = 4;
}

fn main() -> ExitCode {
    let opts = match options::Options::parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("attn-golden: {e}\n\n{}", options::USAGE);
            return ExitCode::from(exit::USAGE);
        }
    };
    let backends = match backends::select(&opts) {
        Ok(b) => b,
        Err(backends::Refusal::Usage(e)) => {
            eprintln!("attn-golden: {e}");
            return ExitCode::from(exit::USAGE);
        }
        Err(backends::Refusal::Backend(e)) => {
            eprintln!("attn-golden: {e}");
            return ExitCode::from(match e {
                AttnError::NotCompiled { .. } => exit::NOT_COMPILED,
                AttnError::BackendUnavailable { .. } => exit::UNAVAILABLE,
                _ => exit::USAGE,
            });
        }
    };
    let cases = match load_dir(&opts.dir) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("attn-golden: {e}");
            return ExitCode::from(exit::USAGE);
        }
    };
    let (mut passed, mut failed, mut refused) = (0usize, 0usize, 0usize);
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
        } else if report.refused {
            refused += 1;
        } else {
            failed += 1;
        }
    }
    match refused {
        0 => println!("{passed} passed, {failed} failed"),
        r => println!("{passed} passed, {failed} failed, {r} refused"),
    }
    let total = passed + failed + refused;
    if total == 0 {
        eprintln!("attn-golden: no *.safetensors case in {}", opts.dir.display());
        return ExitCode::from(exit::FAILED);
    }
    if let Some(expect) = opts.expect.filter(|&n| n != total) {
        eprintln!("attn-golden: {total} case(s) in {}, expected {expect}", opts.dir.display());
        return ExitCode::from(exit::FAILED);
    }
    if refused != opts.expect_refused {
        eprintln!("attn-golden: {refused} case(s) refused as unsupported, expected {}", opts.expect_refused);
        return ExitCode::from(exit::FAILED);
    }
    ExitCode::from(if failed > 0 { exit::FAILED } else { exit::PASSED })
}
