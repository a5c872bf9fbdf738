//! `--baseline results.json`: time and memory ratios against an earlier run, with
//! regressions beyond a threshold flagged. Time is judged GEMM-normalised (time times
//! the GEMM rate measured next to the case), which cancels most of the slow-down a
//! busy shared machine puts on both; the raw ratio is shown too.

use crate::case::Measurement;
use crate::results::RunResults;

/// One case present (and ok) in both runs.
#[derive(Debug, Clone)]
pub struct Comparison {
    pub label: String,
    /// new median time / old median time (> 1 is slower).
    pub time_ratio: f64,
    /// `time_ratio` times new GEMM rate / old GEMM rate: the slow-down relative to
    /// what the machine delivered at the time (the ratio regressions are judged on).
    pub normalized_time_ratio: f64,
    /// new peak bytes per rank / old (> 1 is more memory).
    pub memory_ratio: f64,
    pub regression: bool,
}

/// Compare every ok measurement of `new` with the same case (equal `CaseSpec`) in `old`.
pub fn compare(old: &RunResults, new: &[Measurement], threshold_pct: f64) -> Vec<Comparison> {
    let limit = 1.0 + threshold_pct / 100.0;
    new.iter()
        .filter(|m| m.ok())
        .filter_map(|m| {
            let o = old.measurements.iter().find(|o| o.ok() && o.spec == m.spec)?;
            let time_ratio = m.median_ms / o.median_ms;
            let gemm = m.gemm_gflop_per_s / o.gemm_gflop_per_s;
            let normalized_time_ratio = if gemm.is_finite() && gemm > 0.0 { time_ratio * gemm } else { time_ratio };
            let memory_ratio = if o.peak_bytes_per_rank > 0 {
                m.peak_bytes_per_rank as f64 / o.peak_bytes_per_rank as f64
            } else {
                1.0
            };
            Some(Comparison {
                label: m.spec.label(),
                time_ratio,
                normalized_time_ratio,
                memory_ratio,
                regression: normalized_time_ratio > limit || memory_ratio > limit,
            })
        })
        .collect()
}

/// Markdown table of the comparisons.
pub fn table(rows: &[Comparison], threshold_pct: f64) -> String {
    let mut s = format!(
        "| Case | Time new/old | GEMM-normalised time new/old | Memory new/old | Verdict (threshold {threshold_pct}%) |\n|---|---|---|---|---|\n"
    );
    for r in rows {
        let verdict = if r.regression { "**REGRESSION**" } else { "ok" };
        s += &format!(
            "| {} | {:.3} | {:.3} | {:.3} | {verdict} |\n",
            r.label, r.time_ratio, r.normalized_time_ratio, r.memory_ratio
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::CaseSpec;
    use crate::case::Implementation;

    fn meas(ms: f64, bytes: u64) -> Measurement {
        let mut m = Measurement::not_run(CaseSpec::dilated(Implementation::Cpu, 64, &[16], &[1]), "ok".into(), "g");
        m.median_ms = ms;
        m.peak_bytes_per_rank = bytes;
        m.gemm_gflop_per_s = 100.0;
        m
    }

    #[test]
    fn flags_time_and_memory_regressions_only_beyond_threshold() {
        let old = RunResults {
            suite: "quick".into(),
            threads: 1,
            machine: crate::machine::Machine::probe(),
            gemm: crate::gemm_rate::GemmRate { n: 1, threads: 1, median_gflop_per_s: 1.0, best_gflop_per_s: 1.0 },
            memory_method: String::new(),
            budget_bytes: 1,
            measurements: vec![meas(10.0, 100)],
            capacity: vec![],
            took_s: 0.0,
            hilbert_orders: None,
            cuda: String::new(),
            rss_check_rule: String::new(),
            sections: Vec::new(),
        };
        assert!(!compare(&old, &[meas(10.9, 100)], 10.0)[0].regression);
        assert!(compare(&old, &[meas(11.5, 100)], 10.0)[0].regression);
        assert!(compare(&old, &[meas(10.0, 120)], 10.0)[0].regression);
        // Twice as slow on a machine whose GEMM rate also halved: not a regression.
        let mut busy = meas(20.0, 100);
        busy.gemm_gflop_per_s = 50.0;
        let c = &compare(&old, &[busy], 10.0)[0];
        assert!(!c.regression && (c.normalized_time_ratio - 1.0).abs() < 1e-12 && c.time_ratio == 2.0);
        let mut other = meas(50.0, 100);
        other.spec.seq_len = 128;
        assert!(compare(&old, &[other], 10.0).is_empty());
    }
}
