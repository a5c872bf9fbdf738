//! The "Sequence-parallel strategies" part of `report.md`: the measured rows of the
//! `strategies` section (time, bytes and messages per rank against the plan's formula,
//! peak memory per rank) and dense attention's bytes, messages and workspace bound per
//! rank from the formulas alone, with what `Strategy::Auto` runs in each problem.

use std::fmt::Write;

use attn_core::{DType, Pass};
use attn_ring::plan::choose::Candidate;
use attn_ring::{Layout, PatternStrategy, Plan, Strategy, expected_traffic};

use crate::case::{CaseSpec, Measurement};
use crate::format::{int, mb};
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

/// One measured row: P, strategy, time, bytes sent (and the formula's), messages, peak.
fn measured_row(o: &mut String, m: &Measurement) {
    let Some(plan) = plan_of(&m.spec) else { return };
    let (bytes, messages, ws) = formula(&plan);
    let head = format!("| {} | {} |", m.spec.world_size, label(&plan));
    if !m.ok() {
        let _ = writeln!(o, "{head} {} | | | | | | |", m.status);
        return;
    }
    let max = |v: &[u64]| v.iter().copied().max().unwrap_or(0);
    let _ = writeln!(
        o,
        "{head} {:.1} | {:.2} | {:.2} | {} | {} | {:.1} | {:.1} |",
        m.median_ms,
        mb(max(&m.data_bytes_sent)),
        mb(bytes),
        max(&m.data_messages),
        messages,
        mb(m.peak_bytes_per_rank),
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
         (the rank's own q, k, v, out and lse included); bound: the plan's per-rank workspace bound \
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
             | P | Strategy | Time (ms) | MB sent/rank | Formula MB | Messages/rank | Formula messages | Peak MB/rank | Bound MB/rank |\n\
             |---|---|---|---|---|---|---|---|---|",
            int(n)
        );
        for m in of {
            measured_row(o, m);
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
