//! Command-line options of `attn-bench` (and so of `cargo xtask bench`).

use std::path::PathBuf;

use attn_core::{AttnError, DType, Mixing, Result};
use attn_ring::{Layout, Strategy};

use crate::case::{CaseKind, CaseSpec, Implementation};
use crate::names::Named;

pub const USAGE: &str = "\
attn-bench: the attn benchmark report

USAGE (suite):  attn-bench [--quick|--full] [--out DIR] [--threads T] [--torch PYTHON]
                           [--baseline results.json] [--threshold PCT] [--budget BYTES]
                           [--section NAME[,NAME...]] [--allow-errors]
USAGE (Hilbert orders, prints a markdown report): attn-bench --case hilbert [--runs N]
USAGE (one case, prints one JSON object):
  attn-bench --json --case dilated|ring|multihead|hilbert --seq-len N --batch B --heads H
             --head-dim D --segments LIST --dilations LIST [--mixing head_groups|longnet]
             [--causal] [--dtype f32|bf16|f16] [--backward] [--threads T] [--impl NAME]
             [--world-size P --strategy S --layout L] [--runs N] [--torch PYTHON]
             [--kv-heads K] [--window LEFT,RIGHT]

--backward  time forward+backward (multihead: gradients of the input and every weight,
            accumulated into buffers allocated once, as torch's .grad; no re-initialisation)
--torch     suite: add the PyTorch rows; --json (dilated, multihead; any --seq-len, 65536
            included): also run the PyTorch script with the same flags and runs and print
            `torch` and `torch_median_over_ours` (> 1: this implementation is faster); the
            script needs head_groups and segments dividing n (segments > n are passed as n)
--quick     the short suite (CI smoke)  --full   the long suite (ring tables to 256K, features
            at seq 65536, capacity confirmed by runs); the default fits 5 minutes on 2 cores
--section   measure only these report sections (scaling, comparison, multihead, variants,
            features, blocks, strategies, capacity, hilbert) of the chosen suite; the report holds
            only them
--kv-heads  key/value heads (grouped-query attention; they divide --heads)
--window    a sliding window of LEFT keys before and RIGHT after each query instead of
            --segments/--dilations (with --causal, none after)
--budget    per-rank memory budget of the capacity table (default 8GiB; accepts KiB/MiB/GiB);
            --full runs every world size P at min(budget, usable memory / P), the other suites
            confirm each row by their largest measured case
--baseline  results.json of an earlier suite run: print time/memory ratios, fail on regressions
            (suite runs only; rejected with --json)
--threshold regression threshold for --baseline in percent (default 10)
--allow-errors  suite: exit 0 even when cases fail (their `error: ...` rows stay in the
            report); without it a suite with any failed case exits non-zero naming them
            (skipped cases, `skipped: why`, are not failures)
--rerender  results.json: rebuild report.md and the plots beside it without measuring
--cuda / --no-cuda (cargo xtask bench only): build with or without the `cuda` feature
            (default: with it when nvidia-smi lists a GPU); --impl cuda selects it in --json";

/// What the user asked for.
#[derive(Debug, Clone)]
pub enum Command {
    Suite(SuiteOptions),
    Single {
        spec: Box<CaseSpec>,
        runs: Option<usize>,
        /// `--torch PYTHON`: also run the PyTorch script of the case.
        torch: Option<PathBuf>,
    },
    /// `--case hilbert` without `--json`: the Hilbert order report (best of `reps`).
    Hilbert {
        reps: usize,
    },
    Rerender(PathBuf),
    Help,
}

/// Which suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SuiteSize {
    Quick,
    Default,
    Full,
}

#[derive(Debug, Clone)]
pub struct SuiteOptions {
    pub size: SuiteSize,
    pub out: Option<PathBuf>,
    pub threads: usize,
    pub torch: Option<PathBuf>,
    pub baseline: Option<PathBuf>,
    pub threshold_pct: f64,
    pub budget_bytes: u64,
    /// `--section`: the report sections to measure (empty: all).
    pub sections: Vec<String>,
    /// `--allow-errors`: failed cases do not fail the suite.
    pub allow_errors: bool,
}

/// The report sections `--section` accepts: the planned cases' sections, the capacity
/// table (with its confirmation runs) and the Hilbert order figures.
pub const SECTIONS: [&str; 9] =
    ["scaling", "comparison", "multihead", "variants", "features", "blocks", "strategies", "capacity", "hilbert"];

fn bad(msg: impl Into<String>) -> AttnError {
    AttnError::InvalidArgument(msg.into())
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T> {
    v.parse().map_err(|_| bad(format!("{flag}: `{v}` is not a valid number")))
}

fn list(flag: &str, v: &str) -> Result<Vec<usize>> {
    v.split(',').map(|x| num(flag, x.trim())).collect()
}

/// Parse `8GiB`, `512MiB`, `64KiB`, `1e9` or plain bytes.
pub fn parse_bytes(v: &str) -> Result<u64> {
    let t = v.trim();
    let units: [(&str, f64); 6] =
        [("GiB", 1073741824.0), ("MiB", 1048576.0), ("KiB", 1024.0), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)];
    let (n, mul) = units.iter().find_map(|(u, m)| t.strip_suffix(u).map(|n| (n, *m))).unwrap_or((t, 1.0));
    let x: f64 = num("--budget", n.trim())?;
    if !(x.is_finite() && x > 0.0) {
        return Err(bad(format!("--budget: `{v}` must be positive")));
    }
    Ok((x * mul) as u64)
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Parse the arguments (without the program name).
pub fn parse(args: &[String]) -> Result<Command> {
    let mut it = args.iter();
    let mut suite = SuiteOptions {
        size: SuiteSize::Default,
        out: None,
        threads: default_threads(),
        torch: None,
        baseline: None,
        threshold_pct: 10.0,
        budget_bytes: 8 << 30,
        sections: Vec::new(),
        allow_errors: false,
    };
    let mut spec = CaseSpec::dilated(Implementation::Cpu, 8192, &[2048, 4096, 8192], &[1, 2, 4]);
    spec.threads = suite.threads;
    let (mut json, mut runs, mut impl_set, mut case_set) = (false, None, false, false);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| bad(format!("{flag} needs a value")));
        match flag.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "--quick" => suite.size = SuiteSize::Quick,
            "--full" => suite.size = SuiteSize::Full,
            "--allow-errors" => suite.allow_errors = true,
            "--out" => suite.out = Some(PathBuf::from(value()?)),
            "--torch" => suite.torch = Some(PathBuf::from(value()?)),
            "--baseline" => suite.baseline = Some(PathBuf::from(value()?)),
            "--threshold" => suite.threshold_pct = num(flag, value()?)?,
            "--budget" => suite.budget_bytes = parse_bytes(value()?)?,
            "--section" => {
                for name in value()?.split(',').map(str::trim) {
                    if !SECTIONS.contains(&name) {
                        return Err(bad(format!("--section: unknown section `{name}` ({})", SECTIONS.join("|"))));
                    }
                    suite.sections.push(name.to_string());
                }
            }
            "--threads" => {
                suite.threads = num(flag, value()?)?;
                spec.threads = suite.threads;
            }
            "--json" => json = true,
            "--rerender" => return Ok(Command::Rerender(PathBuf::from(value()?))),
            "--case" => {
                spec.kind = CaseKind::parse(value()?)?;
                case_set = true;
            }
            "--impl" => {
                spec.implementation = Implementation::parse(value()?)?;
                impl_set = true;
            }
            "--seq-len" => spec.seq_len = num(flag, value()?)?,
            "--batch" => spec.batch = num(flag, value()?)?,
            "--heads" => spec.heads = num(flag, value()?)?,
            "--head-dim" => spec.head_dim = num(flag, value()?)?,
            "--segments" => spec.segments = list(flag, value()?)?,
            "--dilations" => spec.dilations = list(flag, value()?)?,
            "--kv-heads" => spec.kv_heads = Some(num(flag, value()?)?),
            "--window" => match list(flag, value()?)?[..] {
                [left, right] => {
                    spec.window = Some([left, right]);
                    spec.mixing = Mixing::Window;
                    (spec.segments, spec.dilations) = (Vec::new(), Vec::new());
                }
                _ => return Err(bad("--window takes LEFT,RIGHT")),
            },
            "--mixing" => spec.mixing = Mixing::parse(value()?)?,
            "--causal" => spec.causal = true,
            "--dtype" => spec.dtype = DType::from_name(value()?)?,
            "--backward" => spec.backward = true,
            "--world-size" => spec.world_size = num(flag, value()?)?,
            "--strategy" => spec.strategy = Some(Strategy::parse(value()?)?),
            "--layout" => spec.layout = Some(Layout::parse(value()?)?),
            "--runs" => runs = Some(num(flag, value()?)?),
            other => return Err(bad(format!("unknown option `{other}` (see --help)"))),
        }
    }
    if !suite.sections.is_empty() && json {
        return Err(bad("--section selects parts of the suite; --json measures one case"));
    }
    if suite.threads == 0 || spec.world_size == 0 {
        return Err(bad("--threads and --world-size must be at least 1"));
    }
    match (json, case_set, spec.kind) {
        (false, false, _) => return Ok(Command::Suite(suite)),
        (false, true, CaseKind::Hilbert) => return Ok(Command::Hilbert { reps: runs.unwrap_or(5).max(1) }),
        (false, true, kind) => {
            return Err(bad(format!(
                "--case {} measures one case and prints JSON: add --json (or drop --case to run the suite)",
                kind.as_str()
            )));
        }
        (true, ..) => {}
    }
    if let Some(b) = &suite.baseline {
        return Err(bad(format!(
            "--baseline {} compares a whole suite run against an earlier results.json; it is not supported with \
             --json (run the suite with --baseline, or compare the printed JSON objects yourself)",
            b.display()
        )));
    }
    if spec.kind == CaseKind::Ring && !impl_set {
        spec.implementation = Implementation::Ring(spec.strategy.unwrap_or_default());
    }
    if suite.torch.is_some() && !matches!(spec.kind, CaseKind::Dilated | CaseKind::Multihead) {
        return Err(bad(format!("--torch with --json runs dilated and multihead cases, not {}", spec.kind.as_str())));
    }
    Ok(Command::Single { spec: Box::new(spec), runs, torch: suite.torch })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn parses_single_case_flags() {
        let c = parse(&args(
            "--json --case ring --seq-len 4096 --heads 4 --head-dim 32 --segments 512,1024 --dilations 1,2 \
             --causal --dtype bf16 --world-size 4 --strategy ring --threads 2",
        ))
        .unwrap();
        let Command::Single { spec, .. } = c else { panic!("expected a single case") };
        assert_eq!((spec.kind, spec.seq_len, spec.heads, spec.head_dim), (CaseKind::Ring, 4096, 4, 32));
        assert_eq!((spec.segments.as_slice(), spec.dilations.as_slice()), (&[512, 1024][..], &[1, 2][..]));
        assert!(spec.causal && spec.dtype == DType::BF16 && spec.world_size == 4 && spec.threads == 2);
        assert_eq!(spec.implementation, Implementation::Ring(Strategy::Ring));
    }

    #[test]
    fn multihead_json_takes_backward_any_length_and_torch() {
        let c = parse(&args("--json --case multihead --seq-len 65536 --backward --torch /usr/bin/python3")).unwrap();
        let Command::Single { spec, torch, .. } = c else { panic!("expected a single case") };
        assert_eq!((spec.kind, spec.seq_len, spec.backward), (CaseKind::Multihead, 65536, true));
        assert_eq!(torch.as_deref(), Some(std::path::Path::new("/usr/bin/python3")));
        let Command::Single { torch, .. } = parse(&args("--json --case multihead")).unwrap() else { panic!() };
        assert!(torch.is_none());
        let e = parse(&args("--json --case ring --torch py")).unwrap_err().to_string();
        assert!(e.contains("--torch") && e.contains("ring"), "{e}");
        assert!(USAGE.contains("--backward") && USAGE.contains("--torch PYTHON]"));
    }

    #[test]
    fn sections_and_feature_flags() {
        let Command::Suite(s) = parse(&args("--quick --section features")).unwrap() else { panic!("expected a suite") };
        assert_eq!((s.size, s.sections.as_slice()), (SuiteSize::Quick, &["features".to_string()][..]));
        let Command::Suite(s) = parse(&args("--section scaling,capacity")).unwrap() else { panic!() };
        assert_eq!(s.sections, ["scaling", "capacity"]);
        let Command::Suite(s) = parse(&args("--full")).unwrap() else { panic!() };
        assert!(s.sections.is_empty());
        let c = parse(&args("--json --case ring --kv-heads 1 --window 4095,0 --causal --world-size 4")).unwrap();
        let Command::Single { spec, .. } = c else { panic!("expected a single case") };
        assert_eq!((spec.kv_heads, spec.window, spec.mixing), (Some(1), Some([4095, 0]), Mixing::Window));
        assert!(spec.segments.is_empty() && spec.config().unwrap().window().is_some());
        assert_eq!(spec.attn_shape().unwrap().kv.heads, 1);
    }

    #[test]
    fn case_without_json_is_the_hilbert_report_or_an_error() {
        assert!(matches!(parse(&args("--case hilbert")).unwrap(), Command::Hilbert { reps: 5 }));
        assert!(matches!(parse(&args("--case hilbert --runs 2")).unwrap(), Command::Hilbert { reps: 2 }));
        assert!(matches!(parse(&args("--json --case hilbert")).unwrap(), Command::Single { .. }));
        assert!(matches!(parse(&args("--quick")).unwrap(), Command::Suite(_)));
        for case in ["dilated", "ring", "multihead"] {
            let e = parse(&args(&format!("--case {case} --seq-len 1024"))).unwrap_err().to_string();
            assert!(e.contains("--json") && e.contains(case), "{case}: {e}");
        }
    }

    #[test]
    fn bad_flags_are_errors_not_panics() {
        for a in ["--seq-len", "--seq-len x", "--bogus", "--json --dtype f8", "--budget -3", "--threads 0"] {
            assert!(parse(&args(a)).is_err(), "{a}");
        }
        let e = parse(&args("--json --case dilated --baseline old.json")).unwrap_err().to_string();
        assert!(e.contains("--baseline") && e.contains("--json"), "{e}");
        assert!(matches!(parse(&args("--quick --baseline old.json")).unwrap(), Command::Suite(_)));
        for a in ["--section nope", "--section features,bogus", "--json --section features", "--window 3"] {
            assert!(parse(&args(a)).is_err(), "{a}");
        }
        assert_eq!(parse_bytes("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_bytes("1.5 KiB").unwrap(), 1536);
    }
}
