//! Measure one case: memory on a first (warm-up) call, then the median of timed calls.

use std::time::{Duration, Instant};

use indicatif::ProgressBar;

use crate::backends;
use crate::case::{CaseKind, CaseSpec, Measurement};
use crate::cli::SuiteSize;
use crate::memory::{self, MemoryWindow};
use crate::rss_check::RssCheck;
use crate::rss_report;
use crate::runner::RunStats;

/// How many timed calls a case gets.
#[derive(Debug, Clone, Copy)]
pub struct Repetitions {
    pub min_runs: usize,
    pub max_runs: usize,
    /// Stop adding timed calls once this much time went into them (after `min_runs`).
    pub budget: Duration,
    /// Timed calls of a case whose first call took over half the budget.
    pub long_case_runs: usize,
}

impl Repetitions {
    pub const QUICK: Repetitions =
        Repetitions { min_runs: 2, max_runs: 5, budget: Duration::from_millis(1500), long_case_runs: 1 };
    /// The default suite: at least 3 timed calls, more while they take under 2 s in all.
    pub const DEFAULT: Repetitions =
        Repetitions { min_runs: 3, max_runs: 10, budget: Duration::from_secs(2), long_case_runs: 1 };
    pub const FULL: Repetitions =
        Repetitions { min_runs: 3, max_runs: 10, budget: Duration::from_secs(6), long_case_runs: 1 };
    /// No timed call after the memory call: its time (cold pages included) is the
    /// case's time. For the capacity confirmation, where memory is the point and one
    /// call at a million tokens takes half a minute or more.
    pub const MEMORY_CALL_ONLY: Repetitions =
        Repetitions { min_runs: 0, max_runs: 0, budget: Duration::ZERO, long_case_runs: 0 };

    /// The repetitions of a suite of `size`.
    pub fn of(size: SuiteSize) -> Repetitions {
        match size {
            SuiteSize::Quick => Repetitions::QUICK,
            SuiteSize::Default => Repetitions::DEFAULT,
            SuiteSize::Full => Repetitions::FULL,
        }
    }

    /// Exactly `n` timed calls (`--runs N`).
    pub fn exactly(n: usize) -> Repetitions {
        Repetitions { min_runs: n, max_runs: n, budget: Duration::ZERO, long_case_runs: n }
    }

    /// These repetitions with at least `n` timed calls however long a call takes: for
    /// rows whose ratio to each other is checked against a target.
    pub fn at_least(self, n: usize) -> Repetitions {
        Repetitions {
            min_runs: self.min_runs.max(n),
            max_runs: self.max_runs.max(n),
            long_case_runs: self.long_case_runs.max(n),
            ..self
        }
    }
}

fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        sorted[n / 2]
    } else {
        0.5 * (sorted[n / 2 - 1] + sorted[n / 2])
    }
}

/// Run `spec` and measure it. Errors end up in `Measurement::status`, never panics.
pub fn measure(spec: &CaseSpec, reps: Repetitions, gemm_gflop_per_s: f64, git: &str, bar: &ProgressBar) -> Measurement {
    bar.set_length(reps.max_runs as u64 + 1);
    bar.set_position(0);
    bar.set_message(spec.label());
    let pool = match rayon::ThreadPoolBuilder::new().num_threads(spec.threads.max(1)).build() {
        Ok(p) => p,
        Err(e) => return Measurement::not_run(spec.clone(), format!("error: thread pool: {e}"), git),
    };
    let result = pool.install(|| run_case(spec, reps, bar));
    match result {
        Ok(done) => {
            let flops = spec.attention_flops().unwrap_or(0.0) + spec.projection_flops();
            let med = median(&done.times_ms);
            let secs = med / 1e3;
            let rank_peaks = done.rank_peaks;
            let mut m = Measurement {
                spec: spec.clone(),
                section: String::new(),
                status: "ok".into(),
                runs: done.times_ms.len(),
                median_ms: med,
                min_ms: done.times_ms.first().copied().unwrap_or(f64::NAN),
                max_ms: done.times_ms.last().copied().unwrap_or(f64::NAN),
                gflop_per_s: flops / secs / 1e9,
                tokens_per_s: spec.tokens() as f64 / secs,
                peak_bytes: done.memory.peak_bytes,
                peak_bytes_per_rank: rank_peaks.iter().copied().max().unwrap_or(done.memory.peak_bytes),
                rank_peak_bytes: rank_peaks,
                bytes_sent: done.stats.bytes_sent,
                data_bytes_sent: done.stats.data_bytes_sent,
                data_messages: done.stats.data_messages,
                peak_rss_bytes: done.memory.peak_rss_bytes,
                rss_windowed: done.memory.rss_windowed,
                rss_base_bytes: done.memory.rss_base_bytes,
                rss_check: RssCheck::NotChecked,
                device_bytes: done.stats.device_bytes,
                gemm_gflop_per_s,
                workspace_query_bytes: None,
                git_commit: git.to_string(),
            };
            m.rss_check = RssCheck::of(m.peak_bytes, rss_report::rss_growth(&m));
            m
        }
        Err(e) if backends::is_unavailable(&e) => Measurement::not_run(spec.clone(), format!("skipped: {e}"), git),
        Err(e) => Measurement::not_run(spec.clone(), format!("error: {e}"), git),
    }
}

struct Done {
    times_ms: Vec<f64>,
    memory: memory::MemoryReading,
    rank_peaks: Vec<u64>,
    stats: RunStats,
}

fn run_case(spec: &CaseSpec, reps: Repetitions, bar: &ProgressBar) -> attn_core::Result<Done> {
    // Memory: window opened before the inputs exist, read after the first call.
    let window = MemoryWindow::start();
    let mut runner = backends::prepare(spec)?;
    let first = Instant::now();
    let stats = runner.run()?;
    let first = first.elapsed();
    let mem = window.read();
    bar.inc(1);
    // Per-rank peaks: the allocator slots of the rank threads (ring cases); a
    // single-rank case is its whole window.
    let rank_peaks = if spec.kind == CaseKind::Ring {
        stats.rank_slots.iter().map(|&s| mem.slot_peaks.get(s).copied().unwrap_or(0)).collect()
    } else {
        vec![mem.peak_bytes]
    };
    // A case whose first call already took half the budget gets `long_case_runs` timed
    // calls (a zero budget means "exactly `min_runs`", as `--runs N` asks).
    let min_runs = if !reps.budget.is_zero() && first * 2 > reps.budget { reps.long_case_runs } else { reps.min_runs };
    let mut times_ms = Vec::new();
    let started = Instant::now();
    while times_ms.len() < reps.max_runs && (times_ms.len() < min_runs || started.elapsed() < reps.budget) {
        let t = Instant::now();
        runner.run()?;
        times_ms.push(t.elapsed().as_secs_f64() * 1e3);
        bar.inc(1);
    }
    if reps.max_runs == 0 {
        times_ms.push(first.as_secs_f64() * 1e3);
    }
    times_ms.sort_by(f64::total_cmp);
    Ok(Done { times_ms, memory: mem, rank_peaks, stats })
}

/// How a planned case is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timing {
    /// The suite's repetitions.
    Suite,
    /// Its first call alone (no timed repetitions): cases whose point is what they
    /// send, not their time.
    FirstCallOnly,
    /// The suite's repetitions, with at least this many timed calls however long a call
    /// takes: rows whose ratio to each other is checked against a target.
    AtLeast(usize),
}

impl Timing {
    /// The repetitions of a case timed this way in a suite of `suite` repetitions.
    pub fn repetitions(self, suite: Repetitions) -> Repetitions {
        match self {
            Timing::Suite => suite,
            Timing::FirstCallOnly => Repetitions::MEMORY_CALL_ONLY,
            Timing::AtLeast(n) => suite.at_least(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::Implementation;
    use attn_core::Causality;
    use attn_ring::{Layout, Strategy};

    #[test]
    fn median_of_even_and_odd_lengths() {
        assert_eq!(median(&[1.0, 2.0, 10.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 4.0, 10.0]), 3.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn reference_case_measures_time_and_inputs() {
        let _guard = memory::TEST_WINDOW_LOCK.lock();
        let spec = CaseSpec::dilated(Implementation::Reference, 64, &[16, 32], &[1, 2]);
        let m = measure(&spec, Repetitions::QUICK, 1.0, "test", &ProgressBar::hidden());
        assert!(m.ok(), "{}", m.status);
        // q, k, v in f64 alone are 3 * 64*8*64*8 bytes.
        assert!(m.peak_bytes >= 3 * 64 * 8 * 64 * 8, "{}", m.peak_bytes);
        assert!(m.median_ms > 0.0 && m.runs >= 2);
        let once = measure(&spec, Repetitions::MEMORY_CALL_ONLY, 1.0, "test", &ProgressBar::hidden());
        assert!(once.ok() && once.runs == 1 && once.median_ms > 0.0, "{once:?}");
        assert!(once.peak_bytes >= 3 * 64 * 8 * 64 * 8, "{}", once.peak_bytes);
        // A first call over half the budget: one timed call, or as many as `at_least` asks.
        let tiny = Repetitions { budget: Duration::from_nanos(1), ..Repetitions::QUICK };
        assert_eq!(measure(&spec, tiny, 1.0, "test", &ProgressBar::hidden()).runs, 1);
        assert_eq!(measure(&spec, tiny.at_least(3), 1.0, "test", &ProgressBar::hidden()).runs, 3);
        let bad = CaseSpec::dilated(Implementation::Reference, 64, &[16, 32], &[1]);
        assert!(measure(&bad, Repetitions::QUICK, 1.0, "t", &ProgressBar::hidden()).status.starts_with("error:"));
    }

    #[test]
    fn cuda_case_runs_or_says_why_it_skipped() {
        let _guard = memory::TEST_WINDOW_LOCK.lock();
        let spec = CaseSpec::dilated(Implementation::Cuda, 256, &[64, 128], &[1, 2]);
        let m = measure(&spec, Repetitions::QUICK, 1.0, "test", &ProgressBar::hidden());
        assert!(m.ok() || m.status.starts_with("skipped:"), "{}", m.status);
        if cfg!(feature = "cuda") {
            assert!(m.ok() || m.status.contains("unavailable"), "{}", m.status);
            assert!(m.ok() == m.device_bytes.is_some(), "{:?}", m.device_bytes);
        } else {
            assert!(m.status.contains("not compiled"), "{}", m.status);
        }
        assert!(backends::cuda_status().contains("compiled"));
    }

    /// Feature cases measure through the same path: a grouped-heads case holds at least
    /// its q, k, v and out; ring rows report data bytes equal to `expected_bytes`, and
    /// their sent rows equal `ring_bytes`'s counts.
    #[test]
    fn feature_cases_report_memory_and_ring_data_bytes() {
        let _guard = memory::TEST_WINDOW_LOCK.lock();
        let mut gqa = CaseSpec::dilated(Implementation::Cpu, 512, &[64, 128], &[1, 2]);
        gqa.kv_heads = Some(2);
        let m = measure(&gqa, Repetitions::QUICK, 1.0, "test", &ProgressBar::hidden());
        assert!(m.ok(), "{}", m.status);
        let tensors = 4 * (2 * 512 * 8 * 64 + 2 * 512 * 2 * 64) as u64;
        assert!(m.peak_bytes >= tensors, "{} < {tensors}", m.peak_bytes);
        let window = CaseSpec::window(Implementation::Cpu, 512, (63, 0), Causality::Causal);
        // Segments of 512 span both ranks' 256 rows.
        let spanning =
            CaseSpec { kv_heads: Some(2), ..CaseSpec::dilated(Implementation::Cpu, 512, &[64, 512], &[1, 2]) };
        for base in [window, spanning] {
            for layout in [Layout::Contiguous, Layout::Zigzag] {
                let spec = crate::case::ring_case(&base, 2, Strategy::AllGather, layout);
                let m = measure(&spec, Repetitions::MEMORY_CALL_ONLY, 1.0, "test", &ProgressBar::hidden());
                assert!(m.ok(), "{}: {}", spec.label(), m.status);
                let problem = crate::ring_runner::problem(&spec).unwrap();
                let plan = attn_ring::Plan::new(problem.clone()).unwrap();
                let dtype = attn_core::DType::F32;
                assert_eq!(m.data_bytes_sent, attn_ring::expected_bytes(&plan, dtype, attn_core::Pass::Forward));
                let rows: Vec<u64> = m.data_bytes_sent.iter().zip(&m.data_messages).map(|(b, n)| b - 9 * n).collect();
                assert_eq!(rows, crate::ring_bytes::counted(&problem, dtype).sent, "{}", spec.label());
                assert!(rows.iter().any(|&b| b > 0), "{}: {rows:?}", spec.label());
            }
        }
        // Features the runners do not take are typed errors, not silently dropped.
        let mut bad = CaseSpec::dilated(Implementation::Reference, 64, &[16, 32], &[1, 2]);
        bad.kv_heads = Some(2);
        assert!(measure(&bad, Repetitions::QUICK, 1.0, "t", &ProgressBar::hidden()).status.starts_with("error:"));
    }

    #[test]
    fn ring_case_reports_one_peak_and_byte_count_per_rank() {
        let _guard = memory::TEST_WINDOW_LOCK.lock();
        let base = CaseSpec::dilated(Implementation::Cpu, 256, &[64, 128], &[1, 2]);
        for p in [1usize, 2, 3] {
            let spec = crate::case::ring_case(&base, p, Strategy::Auto, Layout::Contiguous);
            let m = measure(&spec, Repetitions::QUICK, 1.0, "test", &ProgressBar::hidden());
            assert!(m.ok(), "P={p}: {}", m.status);
            assert_eq!(m.rank_peak_bytes.len(), p);
            assert_eq!(m.bytes_sent.len(), p);
            // Each rank holds at least its own q, k, v and out rows (f32).
            let rows = 256 / p;
            for &b in &m.rank_peak_bytes {
                assert!(b as usize >= 4 * rows * 8 * 64 * 4, "P={p}: {:?}", m.rank_peak_bytes);
            }
            assert_eq!(m.peak_bytes_per_rank, *m.rank_peak_bytes.iter().max().unwrap_or(&0));
            if p > 1 {
                assert!(m.bytes_sent.iter().all(|&b| b > 0), "{:?}", m.bytes_sent);
            }
        }
    }
}
