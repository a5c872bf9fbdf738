//! The memory cross-check's report section and the RSS growth it judges, per
//! measurement (the rule itself: `rss_check`).

use std::fmt::Write;

use crate::case::Measurement;
use crate::format::mb;
use crate::rss_check::{RULE, RssCheck};

/// Peak RSS growth of a measurement over its window, where the peak was reset per case.
pub fn rss_growth(m: &Measurement) -> Option<u64> {
    match (m.rss_windowed, m.peak_rss_bytes, m.rss_base_bytes) {
        (true, Some(peak), Some(base)) => Some(peak.saturating_sub(base)),
        _ => None,
    }
}

/// The report section: the rule, the counts and every flagged case.
pub fn render(out: &mut String, ms: &[Measurement]) {
    let run: Vec<&Measurement> = ms.iter().filter(|m| m.runs > 0 && m.peak_bytes > 0).collect();
    let count = |c: RssCheck| run.iter().filter(|m| m.rss_check == c).count();
    let _ = writeln!(
        out,
        "\n## Memory cross-check (allocator peak vs peak RSS growth)\n\n{RULE}\n\n{} case(s) agree, {} `heap_above_rss` (page reuse, not flagged), {} flagged `rss_far_above_heap`, {} not checked.",
        count(RssCheck::Agrees),
        count(RssCheck::HeapAboveRss),
        count(RssCheck::RssFarAboveHeap),
        count(RssCheck::NotChecked)
    );
    let flagged: Vec<&&Measurement> = run.iter().filter(|m| m.rss_check.flagged()).collect();
    if flagged.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\n| Case | Section | Allocator peak A (MB) | RSS growth R (MB) | R / A | Verdict |\n|---|---|---|---|---|---|"
    );
    for m in flagged {
        let r = rss_growth(m).unwrap_or(0);
        let layout = m.spec.layout.map_or(String::new(), |l| format!(" {}", l.as_str()));
        let _ = writeln!(
            out,
            "| {}{layout} | {} | {:.1} | {:.1} | {:.2} | {} |",
            m.spec.label(),
            m.section,
            mb(m.peak_bytes),
            mb(r),
            r as f64 / m.peak_bytes.max(1) as f64,
            m.rss_check.as_str()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::Implementation;

    #[test]
    fn growth_needs_a_windowed_peak_and_a_base() {
        let spec = crate::case::CaseSpec::dilated(Implementation::Cpu, 64, &[16, 32], &[1, 2]);
        let mut m = Measurement::not_run(spec, "ok".into(), "t");
        m.peak_rss_bytes = Some(300);
        m.rss_base_bytes = Some(100);
        assert_eq!(rss_growth(&m), None);
        m.rss_windowed = true;
        assert_eq!(rss_growth(&m), Some(200));
        m.rss_base_bytes = None;
        assert_eq!(rss_growth(&m), None);
    }
}
