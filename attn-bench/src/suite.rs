//! Run a whole suite: measure every planned case (progress bar per case), the PyTorch
//! peer, the capacity table and its confirmation runs, then write the output folder.

use crate::gemm_rate::GEMM_N;
use std::path::{Path, PathBuf};
use std::time::Instant;

use attn_core::{AttnError, DType, Mixing, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use crate::backends;
use crate::baseline;
use crate::capacity::{self, CapacityRow, Confirmation};
use crate::case::{CaseKind, CaseSpec, Implementation, Measurement};
use crate::case::{DILATIONS, SEGMENTS};
use crate::cli::{SuiteOptions, SuiteSize};
use crate::features;
use crate::gemm_rate;
use crate::hilbert_orders::HilbertOrders;
use crate::machine::{self, Machine};
use crate::measure::{self, Repetitions};
use crate::plots;
use crate::report;
use crate::results::{MEMORY_METHOD, RunResults};
use crate::rss_check;
use crate::suite_plan;
use crate::torch_peer;

fn style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix:>9} [{bar:20}] {pos}/{len} {elapsed:>4} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
}

fn finish(bar: &ProgressBar, m: &Measurement) {
    let msg = if m.status.starts_with("ok") && m.runs > 0 && m.peak_bytes_per_rank == 0 {
        format!("{}  {:.1} ms  {:.1} GFLOP/s  ({})", m.spec.label(), m.median_ms, m.gflop_per_s, m.status)
    } else if m.ok() {
        format!(
            "{}  {:.1} ms  {:.1} MB/rank  {:.1} GFLOP/s",
            m.spec.label(),
            m.median_ms,
            mib(m.peak_bytes_per_rank),
            m.gflop_per_s
        )
    } else {
        format!("{}  {}", m.spec.label(), m.status)
    };
    // Bars are hidden when stderr is not a terminal; keep one line per case there.
    if bar.is_hidden() {
        eprintln!("{msg}");
    }
    bar.finish_with_message(msg);
}

fn mib(b: u64) -> f64 {
    b as f64 / 1048576.0
}

/// Confirm each capacity row (`capacity::confirmation` says how): run the largest
/// case that fits this machine once, or take the suite's own measurement of a smaller
/// one; returns the new measurements.
fn confirm(
    rows: &mut [CapacityRow],
    base: &CaseSpec,
    size: SuiteSize,
    ctx: &Ctx<'_>,
    done: &[Measurement],
) -> Vec<Measurement> {
    let mut out = Vec::new();
    for row in rows.iter_mut() {
        let (spec, note, may_run) = match capacity::confirmation(row, base, size, done) {
            Confirmation::Skip(note) => {
                row.confirm_note = note;
                continue;
            }
            Confirmation::Reuse(spec, note) => (spec, note, false),
            Confirmation::Run(spec) => {
                let note = if spec.seq_len < row.max_seq_len {
                    "largest that fits this machine".to_string()
                } else {
                    "the capacity length".to_string()
                };
                (spec, note, true)
            }
        };
        if let Some(m) = done.iter().find(|m| m.ok() && m.spec == spec) {
            capacity::record(row, &spec, m, note);
        } else if may_run {
            let m = ctx.measure("capacity", &spec, Repetitions::MEMORY_CALL_ONLY);
            capacity::record(row, &spec, &m, note);
            out.push(m);
        }
    }
    out
}

struct Ctx<'a> {
    multi: &'a MultiProgress,
    git: String,
    total: usize,
    done: std::cell::Cell<usize>,
}

impl Ctx<'_> {
    fn measure(&self, section: &str, spec: &CaseSpec, reps: Repetitions) -> Measurement {
        self.done.set(self.done.get() + 1);
        let bar = self.multi.add(ProgressBar::new(1));
        bar.set_style(style());
        bar.set_prefix(format!("{}/{}", self.done.get(), self.total));
        // The GEMM yardstick is re-measured next to every case: on a shared machine the
        // rate available to a case changes from minute to minute.
        let gemm = gemm_rate::measure(GEMM_N, spec.threads, 3).best_gflop_per_s;
        let mut m = measure::measure(spec, reps, gemm, &self.git, &bar);
        m.section = section.to_string();
        if (section == features::SECTION || section == crate::blocks::SECTION) && spec.kind == CaseKind::Dilated {
            m.workspace_query_bytes = crate::feature_runner::workspace_query(spec);
        }
        finish(&bar, &m);
        m
    }
}

/// The PyTorch rows: every f32/bf16 head-group CPU case of the comparison, multihead
/// and variants sections run by `python` (`torch_peer::run`), each with the GEMM rate
/// `gemm(threads)` measured next to it; a failing run becomes an `error:` row.
fn torch_rows(
    python: &Path,
    measurements: &[Measurement],
    runs: usize,
    git: &str,
    multi: &MultiProgress,
    gemm: &dyn Fn(usize) -> f64,
) -> Vec<Measurement> {
    // (spec, section) of every case PyTorch can run too; one spec may sit in two sections.
    let cases = measurements
        .iter()
        .filter(|m| matches!(m.section.as_str(), "comparison" | "multihead" | "variants"))
        .filter(|m| {
            matches!(m.spec.kind, CaseKind::Dilated | CaseKind::Multihead)
                && m.spec.implementation == Implementation::Cpu
        })
        .filter(|m| m.spec.dtype != DType::F16 && m.spec.mixing == Mixing::HeadGroups);
    cases
        .map(|c| {
            let (spec, section) = (&c.spec, &c.section);
            let bar = multi.add(ProgressBar::new_spinner());
            bar.set_message(format!("torch {}", spec.label()));
            let mut m = torch_peer::run(python, spec, runs, git).unwrap_or_else(|e| {
                let mut s = spec.clone();
                s.implementation = Implementation::Torch;
                Measurement::not_run(s, format!("error: {e}"), git)
            });
            m.gemm_gflop_per_s = gemm(spec.threads);
            m.section = section.clone();
            finish(&bar, &m);
            m
        })
        .collect()
}

/// The output directory: `--out` or `<repo>/target/attn-bench/<timestamp>`.
fn out_dir(opts: &SuiteOptions, machine: &Machine) -> PathBuf {
    opts.out.clone().unwrap_or_else(|| torch_peer::repo_root().join("target/attn-bench").join(&machine.timestamp_utc))
}

/// Run the suite described by `opts` and write its folder.
pub fn run(opts: &SuiteOptions) -> Result<()> {
    let started = Instant::now();
    let machine = Machine::probe();
    let dir = out_dir(opts, &machine);
    std::fs::create_dir_all(&dir).map_err(|e| AttnError::InvalidArgument(format!("{}: {e}", dir.display())))?;
    let old = opts.baseline.as_deref().map(RunResults::load).transpose()?;
    let cuda = backends::cuda_status();
    eprintln!("attn-bench: CUDA {cuda}");
    eprintln!("attn-bench: measuring the f32 GEMM rate on {} threads ...", opts.threads);
    let gemm = gemm_rate::measure(GEMM_N, opts.threads, 7);
    eprintln!(
        "attn-bench: GEMM {:.1} GFLOP/s (median, n={GEMM_N}); writing {}",
        gemm.median_gflop_per_s,
        dir.display()
    );
    let reps = Repetitions::of(opts.size);
    let wanted = |section: &str| opts.sections.is_empty() || opts.sections.iter().any(|s| s == section);
    let mut plan = suite_plan::plan(opts.size, opts.threads);
    plan.retain(|p| wanted(p.section));
    let multi = MultiProgress::new();
    let ctx = Ctx {
        multi: &multi,
        git: machine.git_commit.clone(),
        // The capacity confirmations: all four world sizes in --full, none otherwise.
        total: plan.len() + if wanted("capacity") && opts.size == SuiteSize::Full { 4 } else { 0 },
        done: std::cell::Cell::new(0),
    };
    let mut measurements: Vec<Measurement> =
        plan.iter().map(|p| ctx.measure(p.section, &p.spec, p.timing.repetitions(reps))).collect();
    if let Some(python) = &opts.torch {
        let gemm_now = |threads| gemm_rate::measure(GEMM_N, threads, 3).best_gflop_per_s;
        let rows = torch_rows(python, &measurements, reps.min_runs.max(3), &machine.git_commit, &multi, &gemm_now);
        measurements.extend(rows);
    }
    let cap_base =
        CaseSpec { threads: opts.threads, ..CaseSpec::dilated(Implementation::Cpu, 8192, &SEGMENTS, &DILATIONS) };
    let usable = machine::available_memory_bytes().map(capacity::usable_machine_bytes);
    let mut capacity = Vec::new();
    if wanted("capacity") {
        capacity = capacity::table(&cap_base, &measurements, &[1, 2, 4, 8], opts.budget_bytes, usable);
        let confirmations = confirm(&mut capacity, &cap_base, opts.size, &ctx, &measurements);
        measurements.extend(confirmations);
    }
    let suite = match opts.size {
        SuiteSize::Quick => "quick",
        SuiteSize::Default => "default",
        SuiteSize::Full => "full",
    };
    let hilbert_orders = wanted("hilbert").then(|| {
        eprintln!("attn-bench: Hilbert order generation and permutation ...");
        HilbertOrders::measure(if opts.size == SuiteSize::Full { 5 } else { 3 })
    });
    let results = RunResults {
        suite: suite.into(),
        threads: opts.threads,
        machine,
        gemm,
        memory_method: MEMORY_METHOD.into(),
        budget_bytes: opts.budget_bytes,
        measurements,
        capacity,
        took_s: started.elapsed().as_secs_f64(),
        hilbert_orders: hilbert_orders.flatten(),
        cuda,
        rss_check_rule: rss_check::RULE.into(),
        sections: opts.sections.clone(),
    };
    results.save(&dir.join("results.json"))?;
    let comparisons = old.as_ref().map(|o| baseline::compare(o, &results.measurements, opts.threshold_pct));
    if let Some(rows) = &comparisons {
        println!("{}", baseline::table(rows, opts.threshold_pct));
    }
    write_report(&dir, &results, comparisons.as_deref(), opts.threshold_pct)?;
    let mut table = String::new();
    if results.includes("capacity") {
        capacity::render(&mut table, &results.capacity, results.budget_bytes);
    }
    if results.includes(features::SECTION) {
        crate::features_report::render(&mut table, &results.measurements);
    }
    if results.includes(crate::blocks::SECTION) {
        crate::blocks_report::render(&mut table, &results.measurements);
    }
    println!("{}", table.trim());
    println!("attn-bench: wrote {} in {:.0} s", dir.display(), started.elapsed().as_secs_f64());
    if comparisons.is_some_and(|c| c.iter().any(|r| r.regression)) {
        return Err(AttnError::InvalidArgument(format!("regressions beyond {}% (see report.md)", opts.threshold_pct)));
    }
    failures(&results.measurements, opts.allow_errors)
}

/// The suite's verdict on its cases: an error naming every case whose status is
/// `error: ...` (label, section and status), unless `allow_errors` (`--allow-errors`).
/// Cases that ran, and cases skipped with a reason, pass.
fn failures(measurements: &[Measurement], allow_errors: bool) -> Result<()> {
    let failed: Vec<String> = measurements
        .iter()
        .filter(|m| m.status.starts_with("error:"))
        .map(|m| format!("{} [{}]: {}", m.spec.label(), m.section, m.status))
        .collect();
    if failed.is_empty() {
        return Ok(());
    }
    if allow_errors {
        eprintln!("attn-bench: {} cases failed (allowed by --allow-errors): {}", failed.len(), failed.join("; "));
        return Ok(());
    }
    Err(AttnError::InvalidArgument(format!(
        "{} of {} cases failed (their rows are in report.md; --allow-errors passes anyway): {}",
        failed.len(),
        measurements.len(),
        failed.join("; ")
    )))
}

/// Write the plots and `report.md` of `results` into `dir`.
fn write_report(
    dir: &Path,
    results: &RunResults,
    comparisons: Option<&[baseline::Comparison]>,
    threshold_pct: f64,
) -> Result<()> {
    let sel = report::Selection::of(results);
    let mut plot_files = Vec::new();
    // The plots draw the scaling and comparison measurements.
    let charts = if results.includes("scaling") || results.includes("comparison") {
        plots::standard(&sel.single, &sel.ring, &sel.throughput, &sel.sweep)
    } else {
        Vec::new()
    };
    let strategies = results.includes(crate::strategies::SECTION);
    let charts =
        charts.into_iter().chain(strategies.then(|| crate::strategies_report::bytes_chart(&results.measurements)));
    for chart in charts {
        match plots::render(dir, &chart) {
            Ok(files) => plot_files.extend(files),
            Err(e) => eprintln!("attn-bench: plot {} failed: {e}", chart.file_stem),
        }
    }
    let md = report::render(results, &sel, &plot_files, comparisons, threshold_pct);
    std::fs::write(dir.join("report.md"), md).map_err(|e| AttnError::InvalidArgument(format!("report.md: {e}")))
}

/// `--rerender results.json`: rebuild `report.md` and the plots next to an existing
/// `results.json` without measuring anything (e.g. after a report-format change).
pub fn rerender(results_json: &Path) -> Result<()> {
    let results = RunResults::load(results_json)?;
    let dir = results_json.parent().unwrap_or(Path::new("."));
    write_report(dir, &results, None, 10.0)?;
    println!("attn-bench: re-rendered {}", dir.join("report.md").display());
    Ok(())
}

#[cfg(test)]
#[path = "suite_tests.rs"]
mod tests;
