//! The "Sequence-parallel strategies" part of `report.md`: the measured rows of the
//! `strategies` section (time, bytes and messages per rank against the plan's formula,
//! peak memory per rank) and dense attention's bytes, messages and workspace bound per
//! rank from the formulas alone, with what `Strategy::Auto` runs in each problem.

use std::collections::BTreeMap;
use std::fmt::Write;

use attn_core::{DType, Pass};
use attn_ring::plan::choose::Candidate;
use attn_ring::{Layout, PatternStrategy, Plan, Strategy, expected_traffic};

use crate::case::{CaseSpec, Measurement};
use crate::format::{int, mb};
use crate::plots::{Chart, Series};
use crate::strategies::{FORMULA_SEQS, SECTION, WORLDS, dense, strategies};

/// What a plan runs: a head strategy, or the row plan's per-pattern strategies.
pub fn runs(plan: &Plan) -> String {
    if let Some(split) = plan.head_split() {
        return Candidate::Heads(*split).strategy().label();
    }
    let name = |s: &PatternStrategy| match s {
        PatternStrategy::Local => "local",
        PatternStrategy::Ring => "ring",
        PatternStrategy::AllGather => "allgather",
    };
    let mut names: Vec<&str> = plan.strategies.iter().map(name).collect();
    names.dedup();
    names.join("+")
}

/// The strategy's name, `auto` with what it runs.
fn label(plan: &Plan) -> String {
    match plan.problem.strategy {
        Strategy::Auto => format!("auto ({})", runs(plan)),
        // A head strategy with nothing to exchange runs the row plan (segment-local).
        s if s.ulysses_degree(plan.problem.world).is_some() && plan.head_split().is_none() => {
            format!("{} ({})", s.label(), runs(plan))
        }
        s => s.label(),
    }
}

/// (most bytes, most messages, largest workspace bound) of any rank, forward in f32.
fn formula(plan: &Plan) -> (u64, u64, u64) {
    let t = expected_traffic(plan, DType::F32, Pass::Forward);
    let ws = (0..plan.problem.world).map(|r| plan.workspace_bytes(DType::F32, r, Pass::Forward)).max().unwrap_or(0);
    (t.iter().map(|t| t.bytes).max().unwrap_or(0), t.iter().map(|t| t.messages).max().unwrap_or(0), ws)
}

fn plan_of(spec: &CaseSpec) -> Option<Plan> {
    Plan::new(crate::ring_runner::problem(spec).ok()?).ok()
}

/// How far the peak fell from the one-rank peak `one`: the factor, and that factor over P.
fn fall(one: Option<u64>, m: &Measurement) -> String {
    match one {
        Some(one) if m.peak_bytes_per_rank > 0 => {
            let f = one as f64 / m.peak_bytes_per_rank as f64;
            format!("{f:.2}x ({:.2}·P)", f / m.spec.world_size as f64)
        }
        _ => String::new(),
    }
}

/// One measured row: P, strategy, time, bytes sent (and the formula's), messages, peak
/// and its fall from the one-rank peak `one`.
fn measured_row(o: &mut String, m: &Measurement, one: Option<u64>) {
    let Some(plan) = plan_of(&m.spec) else { return };
    let (bytes, messages, ws) = formula(&plan);
    let head = format!("| {} | {} |", m.spec.world_size, label(&plan));
    if !m.ok() {
        let _ = writeln!(o, "{head} {} | | | | | | | |", m.status);
        return;
    }
    let max = |v: &[u64]| v.iter().copied().max().unwrap_or(0);
    let _ = writeln!(
        o,
        "{head} {:.1} | {:.2} | {:.2} | {} | {} | {:.1} | {} | {:.1} |",
        m.median_ms,
        mb(max(&m.data_bytes_sent)),
        mb(bytes),
        max(&m.data_messages),
        messages,
        mb(m.peak_bytes_per_rank),
        fall(one, m),
        mb(ws)
    );
}

/// Render the section (nothing when it has no measurement).
pub fn render(o: &mut String, ms: &[Measurement]) {
    let rows: Vec<&Measurement> = ms.iter().filter(|m| m.section == SECTION).collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "\n## Sequence-parallel strategies\n\n\
         In-process ranks (one thread each over `ThreadComm`), batch 1, 8 heads, head_dim 64, f32, forward, contiguous \
         layout. Sent and messages: the most any rank sent in the call (data messages with their headers), beside the \
         plan's formula (`expected_traffic`); peak: the counting allocator's largest per-rank peak over the first call \
         (the rank's own q, k, v, out and lse included), and how far it fell from the one-rank peak; bound: the plan's per-rank workspace bound \
         (`Plan::workspace_bytes`, beyond the caller's tensors). `auto (x)`: what `Strategy::Auto` ran."
    );
    // One table per problem (sequence length and segments), in run order.
    let mut groups: Vec<(usize, &[usize])> = Vec::new();
    for m in &rows {
        if !groups.contains(&(m.spec.seq_len, &m.spec.segments[..])) {
            groups.push((m.spec.seq_len, &m.spec.segments));
        }
    }
    for &(n, segments) in &groups {
        let of = rows.iter().filter(|m| m.spec.seq_len == n && m.spec.segments == segments);
        let what = match of.clone().next() {
            Some(m) if segments != [n] => format!("segments {segments:?}, rates {:?}", m.spec.dilations),
            _ => "dense attention".to_string(),
        };
        let _ = writeln!(
            o,
            "\n### {what}, seq {}\n\n\
             | P | Strategy | Time (ms) | MB sent/rank | Formula MB | Messages/rank | Formula messages | Peak MB/rank | Fall from P = 1 | Bound MB/rank |\n\
             |---|---|---|---|---|---|---|---|---|---|",
            int(n)
        );
        let one = of.clone().find(|m| m.spec.world_size == 1 && m.ok()).map(|m| m.peak_bytes_per_rank);
        for m in of {
            measured_row(o, m, one);
        }
    }
    let _ = writeln!(
        o,
        "\n### Dense attention from the formulas\n\n\
         One segment of n at rate 1, the same heads and sizes, nothing run: the most bytes and messages any rank sends \
         and the largest per-rank workspace bound.\n\n\
         | Seq | P | Strategy | MB sent/rank | Messages/rank | Bound MB/rank |\n|---|---|---|---|---|---|"
    );
    for n in FORMULA_SEQS {
        for p in WORLDS {
            for s in strategies(p) {
                let spec = crate::case::ring_case(&dense(n), p, s, Layout::Contiguous);
                let Some(plan) = plan_of(&spec) else { continue };
                let (bytes, messages, ws) = formula(&plan);
                let _ = writeln!(
                    o,
                    "| {} | {p} | {} | {:.1} | {messages} | {:.1} |",
                    int(n),
                    label(&plan),
                    mb(bytes),
                    mb(ws)
                );
            }
        }
    }
}

/// Bytes sent per rank against P, one line per strategy: the measured problems of the
/// section, and dense attention at the longest formula length (nothing run). Points of
/// zero bytes (a rank that sends nothing) are left out of the log axes.
pub fn bytes_chart(ms: &[Measurement]) -> Chart {
    let mut lines: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for m in ms.iter().filter(|m| m.section == SECTION && m.ok() && m.spec.world_size > 1) {
        let Some(plan) = plan_of(&m.spec) else { continue };
        let what = if m.spec.segments == [m.spec.seq_len] { "dense" } else { "patterns" };
        let name = format!("{what} {}, {} (measured)", int(m.spec.seq_len), plan.problem.strategy.label());
        let sent = m.data_bytes_sent.iter().copied().max().unwrap_or(0);
        lines.entry(name).or_default().push((m.spec.world_size as f64, sent as f64 / 1048576.0));
    }
    let n = FORMULA_SEQS[FORMULA_SEQS.len() - 1];
    for p in WORLDS {
        for s in strategies(p) {
            let Some(plan) = plan_of(&crate::case::ring_case(&dense(n), p, s, Layout::Contiguous)) else { continue };
            let name = format!("dense {}, {} (formula)", int(n), s.label());
            lines.entry(name).or_default().push((p as f64, formula(&plan).0 as f64 / 1048576.0));
        }
    }
    let series = lines
        .into_iter()
        .map(|(name, mut points)| {
            points.retain(|p| p.1 > 0.0);
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series { name, points }
        })
        .filter(|s| !s.points.is_empty())
        .collect();
    Chart {
        file_stem: "strategy_bytes_vs_p".into(),
        title: "Bytes sent per rank vs world size, by strategy".into(),
        x_label: "world size P (ranks)".into(),
        y_label: "MB sent per rank (forward, f32)".into(),
        log_x: true,
        log_y: true,
        legend_lower_right: true,
        series,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::{DILATIONS, Implementation, SEGMENTS, ring_case};

    fn measured(p: usize, s: Strategy, peak: u64, sent: u64) -> Measurement {
        let base = CaseSpec::dilated(Implementation::Cpu, 8192, &SEGMENTS, &DILATIONS);
        let mut m = Measurement::not_run(ring_case(&base, p, s, Layout::Contiguous), "ok".into(), "t");
        m.section = SECTION.into();
        m.peak_bytes_per_rank = peak;
        m.data_bytes_sent = vec![sent; p];
        m
    }

    #[test]
    fn rows_state_the_fall_from_the_one_rank_peak() {
        let ms = [measured(1, Strategy::Ring, 800 << 20, 0), measured(4, Strategy::Ulysses, 250 << 20, 3 << 20)];
        let mut o = String::new();
        render(&mut o, &ms);
        assert!(o.contains("| 1.00x (1.00·P) |"), "{o}");
        assert!(o.contains("| 3.20x (0.80·P) |"), "{o}");
    }

    #[test]
    fn the_bytes_chart_has_a_line_per_strategy_without_zero_points() {
        let ms =
            [measured(1, Strategy::Ring, 1, 0), measured(2, Strategy::Ring, 1, 0), measured(4, Strategy::Ring, 1, 5)];
        let chart = bytes_chart(&ms);
        let measured: Vec<&Series> = chart.series.iter().filter(|s| s.name.ends_with("(measured)")).collect();
        assert_eq!(measured.len(), 1);
        assert_eq!(measured[0].points, [(4.0, 5.0 / 1048576.0)]);
        for s in ["ring", "allgather", "ulysses", "auto"] {
            assert!(chart.series.iter().any(|l| l.name == format!("dense 262,144, {s} (formula)")), "{s}");
        }
    }
}
