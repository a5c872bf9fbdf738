//! The capacity table: the longest sequence whose per-rank memory fits a budget, for
//! world sizes 1, 2, 4, 8 (from the library's workspace-size queries), the longest that
//! fits this machine (in-process ranks share its memory), and which case confirms each
//! row by a measured run.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use crate::case::{CaseKind, CaseSpec, Measurement};
use crate::cli::SuiteSize;
use crate::format::{int, mb};

/// One row of "sequence length capabilities".
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CapacityRow {
    pub world_size: usize,
    pub budget_bytes: u64,
    /// Longest sequence (a multiple of the largest segment times the world size) that fits.
    pub max_seq_len: usize,
    /// Per-rank bytes at `max_seq_len` according to `source`.
    pub bytes_at_max: u64,
    /// Where the per-rank bytes came from: the library's workspace query, or the
    /// measured bytes per token of the largest measured case (when no query exists).
    pub source: String,
    /// Per-rank bytes this machine can give each of `world_size` in-process ranks:
    /// min(budget, usable memory / world size); `None` where memory could not be read.
    #[serde(default)]
    pub machine_limit_bytes: Option<u64>,
    /// Longest sequence whose per-rank bytes fit `machine_limit_bytes` (by the same
    /// query): the largest case of this row that fits this machine.
    #[serde(default)]
    pub machine_seq_len: Option<usize>,
    /// The confirmation run: its length and measured per-rank peak.
    pub confirmed_seq_len: Option<usize>,
    pub confirmed_peak_bytes: Option<u64>,
    /// The workspace query's per-rank bytes at the confirmed length (where it exists).
    #[serde(default)]
    pub confirmed_predicted_bytes: Option<u64>,
    /// Why the confirmed length is not `machine_seq_len`, or why nothing ran.
    #[serde(default)]
    pub confirm_note: String,
}

/// Of the memory the kernel reports available, what a confirmation run may use: an
/// eighth and 1 GiB more are kept free (allocator slack, the bench's own buffers,
/// other processes on a shared machine growing meanwhile).
pub fn usable_machine_bytes(available: u64) -> u64 {
    available.saturating_sub(available / 8).saturating_sub(1 << 30)
}

/// Per-rank bytes of `spec`, as the library reports it before running anything, with
/// where they came from. World 1 on the CPU backend: `CpuBackend::workspace_bytes` plus
/// the tensors. Ring cases: the largest over ranks of attn-ring's
/// `Plan::workspace_bytes` (an upper bound of what a rank allocates during the call)
/// plus that rank's tensors (`Plan::io_bytes`).
pub fn workspace_query(spec: &CaseSpec) -> Option<(u64, String)> {
    match spec.kind {
        CaseKind::Dilated if spec.world_size == 1 && spec.implementation == crate::case::Implementation::Cpu => {
            crate::cpu_runner::workspace_query(spec).map(|b| (b, "workspace query (CpuBackend)".into()))
        }
        CaseKind::Ring if spec.world_size >= 1 => ring_query(spec).map(|b| (b, "workspace query (attn-ring)".into())),
        _ => None,
    }
}

/// The largest per-rank workspace plus tensors of a ring case (`None` if the case is
/// not a valid ring problem, e.g. a rank would get no rows).
fn ring_query(spec: &CaseSpec) -> Option<u64> {
    let problem = crate::ring_runner::problem(spec).ok()?;
    let dtype = spec.dtype;
    let plan = attn_ring::Plan::new(problem).ok()?;
    (0..spec.world_size)
        .map(|r| plan.workspace_bytes(dtype, r, spec.pass()) + plan.io_bytes(dtype, r, spec.pass()))
        .max()
}

/// Per-rank bytes of `spec`: the library query if it exists, else the measured bytes
/// per token of the largest ok measurement with the same world size scaled linearly
/// (dilated attention's memory is linear in the sequence). `None` if neither exists.
pub fn per_rank_bytes(spec: &CaseSpec, measured: &[Measurement]) -> Option<(u64, String)> {
    if let Some(q) = workspace_query(spec) {
        return Some(q);
    }
    let m = measured
        .iter()
        .filter(|m| m.ok() && m.peak_bytes_per_rank > 0 && m.spec.world_size == spec.world_size)
        .filter(|m| m.spec.heads == spec.heads && m.spec.head_dim == spec.head_dim && m.spec.dtype == spec.dtype)
        .filter(|m| m.spec.implementation == spec.implementation && m.spec.backward == spec.backward)
        .max_by_key(|m| m.spec.seq_len)?;
    let per_token = m.peak_bytes_per_rank as f64 / m.spec.tokens() as f64;
    let bytes = (per_token * spec.tokens() as f64) as u64;
    Some((bytes, format!("measured {:.2} KB/token at seq {} (no workspace query)", per_token / 1024.0, m.spec.seq_len)))
}

/// The base case of the table at a world size and sequence length.
pub fn case_at(base: &CaseSpec, world_size: usize, seq_len: usize) -> CaseSpec {
    let mut s = base.clone();
    s.seq_len = seq_len;
    if world_size > 1 {
        s = crate::case::ring_case(&s, world_size, crate::suite_plan::DEFAULT_STRATEGY, attn_ring::Layout::Contiguous);
    }
    s
}

/// Longest `seq` (multiple of the largest segment times `world`, doubling then
/// bisecting) whose per-rank bytes fit `limit`, with those bytes and their source.
fn longest_fitting(
    base: &CaseSpec,
    measured: &[Measurement],
    world: usize,
    limit: u64,
) -> Option<(usize, u64, String)> {
    let unit = base.segments.iter().copied().max().unwrap_or(1) * world;
    let fits = |k: usize| per_rank_bytes(&case_at(base, world, k * unit), measured).filter(|(b, _)| *b <= limit);
    fits(1)?;
    let mut hi = 1usize;
    while hi < (1 << 24) && fits(hi * 2).is_some() {
        hi *= 2;
    }
    let (mut lo, mut top) = (hi, hi * 2);
    while top - lo > 1 {
        let mid = (lo + top) / 2;
        if fits(mid).is_some() { lo = mid } else { top = mid }
    }
    let (bytes, source) = fits(lo)?;
    Some((lo * unit, bytes, source))
}

/// The capacity table: per world size, the longest sequence fitting `budget` per rank,
/// and the longest fitting min(`budget`, `usable` / P) per rank, since in-process
/// ranks share this machine's `usable` bytes (`None`: unknown, no machine column).
/// Rows whose bytes cannot be determined are left out.
pub fn table(
    base: &CaseSpec,
    measured: &[Measurement],
    worlds: &[usize],
    budget: u64,
    usable: Option<u64>,
) -> Vec<CapacityRow> {
    worlds
        .iter()
        .filter_map(|&p| {
            let (max_seq_len, bytes_at_max, source) = longest_fitting(base, measured, p, budget)?;
            let machine_limit_bytes = usable.map(|u| budget.min(u / p as u64));
            let machine_seq_len =
                machine_limit_bytes.and_then(|l| longest_fitting(base, measured, p, l)).map(|(n, _, _)| n);
            Some(CapacityRow {
                world_size: p,
                budget_bytes: budget,
                max_seq_len,
                bytes_at_max,
                source,
                machine_limit_bytes,
                machine_seq_len,
                confirmed_seq_len: None,
                confirmed_peak_bytes: None,
                confirmed_predicted_bytes: None,
                confirm_note: String::new(),
            })
        })
        .collect()
}

/// How a row gets confirmed.
#[derive(Debug, Clone, PartialEq)]
pub enum Confirmation {
    /// Run this case: the largest of the row that fits this machine.
    Run(CaseSpec),
    /// Take this case from the suite's own measurements (smaller; the note says why).
    Reuse(CaseSpec, String),
    /// Nothing confirms the row (the note says why).
    Skip(String),
}

/// Which case confirms `row` in a `size` suite. `--full` runs every row at its machine
/// length (about 1M tokens and half a minute on one rank at the 8 GiB default, many
/// minutes for a ring at millions of tokens); the default suite and `--quick` take the
/// suite's largest measured case of the same config.
pub fn confirmation(row: &CapacityRow, base: &CaseSpec, size: SuiteSize, measured: &[Measurement]) -> Confirmation {
    let p = row.world_size;
    let runs = size == SuiteSize::Full;
    let target = row.machine_seq_len;
    if let (true, Some(n)) = (runs, target) {
        return Confirmation::Run(case_at(base, p, n));
    }
    let largest = measured
        .iter()
        .filter(|m| m.ok() && target.is_none_or(|n| m.spec.seq_len <= n))
        .filter(|m| m.spec == case_at(base, p, m.spec.seq_len))
        .max_by_key(|m| m.spec.seq_len);
    let why = match (target, size) {
        (None, _) => "this machine's available memory is unknown".to_string(),
        (Some(n), SuiteSize::Quick) => format!("--quick confirms a smaller suite case; --full runs {}", int(n)),
        (Some(n), _) => {
            format!("suite's largest case; a run at {} takes too long for the default suite (--full runs it)", int(n))
        }
    };
    match largest {
        Some(m) => Confirmation::Reuse(m.spec.clone(), why),
        None => Confirmation::Skip(format!("not run: {why}")),
    }
}

/// Record a confirmation measurement `m` of `spec` in `row`.
pub fn record(row: &mut CapacityRow, spec: &CaseSpec, m: &Measurement, note: String) {
    if m.ok() {
        row.confirmed_predicted_bytes = per_rank_bytes(spec, &[]).map(|(b, _)| b);
        row.confirmed_seq_len = Some(spec.seq_len);
        row.confirmed_peak_bytes = Some(m.peak_bytes_per_rank);
        row.confirm_note = note;
    } else {
        row.confirm_note = format!("{} at {}: {}", spec.label(), int(spec.seq_len), m.status);
    }
}

/// The "Sequence length capabilities" section of the report (markdown).
pub fn render(o: &mut String, rows: &[CapacityRow], budget: u64) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let _ = writeln!(
        o,
        "\n## Sequence length capabilities (per-rank budget {:.1} GiB)\n\n\
         Max sequence: the longest that fits the budget on every rank, by the library's workspace-size query. \
         This machine: the longest whose ranks fit min(budget, usable memory / P), since in-process ranks share \
         this machine's memory (usable: MemAvailable less an eighth and 1 GiB). Confirmed: a measured run \
         (counting allocator, per-rank peak) against the query at the same length.\n\n\
         | World size | Max sequence | Per-rank MB at max | Source | This machine (per-rank limit) | Confirmed seq | Measured MB/rank | Query MB/rank | Measured/query | Note |\n\
         |---|---|---|---|---|---|---|---|---|---|",
        gib(budget)
    );
    for c in rows {
        let machine = match (c.machine_seq_len, c.machine_limit_bytes) {
            (Some(n), Some(l)) => format!("{} ({:.1} GiB)", int(n), gib(l)),
            (None, Some(l)) => format!("none fits ({:.1} GiB)", gib(l)),
            _ => "unknown".into(),
        };
        let (seq, meas, query, ratio) = match (c.confirmed_seq_len, c.confirmed_peak_bytes) {
            (Some(s), Some(b)) => (
                int(s),
                format!("{:.1}", mb(b)),
                c.confirmed_predicted_bytes.map_or("-".into(), |p| format!("{:.1}", mb(p))),
                c.confirmed_predicted_bytes.map_or("-".into(), |p| format!("{:.3}", b as f64 / p as f64)),
            ),
            _ => ("not run".into(), "-".into(), "-".into(), "-".into()),
        };
        let _ = writeln!(
            o,
            "| {} | {} | {:.1} | {} | {machine} | {seq} | {meas} | {query} | {ratio} | {} |",
            c.world_size,
            int(c.max_seq_len),
            mb(c.bytes_at_max),
            c.source,
            c.confirm_note
        );
    }
    if rows.is_empty() {
        let _ = writeln!(o, "| - | - | - | no single-rank or ring measurement to size from | - | - | - | - | - | - |");
    }
}

/// The report's key finding of one row. The longest sequence is computed (from the
/// row's source), not measured at that length: the line says so, and what a confirmation
/// run measured, if one ran.
pub fn finding(c: &CapacityRow) -> String {
    let mib = |b: u64| b as f64 / 1048576.0;
    let run = match (c.confirmed_seq_len, c.confirmed_peak_bytes) {
        (Some(l), Some(peak)) if l == c.max_seq_len => {
            format!("; a run at that length measured {:.1} MiB per rank", mib(peak))
        }
        (Some(l), Some(peak)) => {
            format!("; measured by a run at {} tokens only ({:.1} MiB per rank)", int(l), mib(peak))
        }
        _ => "; not measured by a run".to_string(),
    };
    format!(
        "Longest sequence in {:.0} GiB per rank with {} rank(s), computed (not measured) from the {}: {} tokens{run}",
        c.budget_bytes as f64 / (1u64 << 30) as f64,
        c.world_size,
        c.source,
        int(c.max_seq_len)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::Implementation;
    use attn_core::DType;

    #[test]
    fn the_finding_says_the_capacity_is_computed_and_what_a_run_measured() {
        let mut row = CapacityRow {
            world_size: 2,
            budget_bytes: 8 << 30,
            max_seq_len: 1 << 20,
            bytes_at_max: 7 << 30,
            source: "workspace query (CpuBackend)".into(),
            machine_limit_bytes: None,
            machine_seq_len: None,
            confirmed_seq_len: None,
            confirmed_peak_bytes: None,
            confirmed_predicted_bytes: None,
            confirm_note: String::new(),
        };
        let f = finding(&row);
        assert!(
            f.contains("computed (not measured) from the workspace query") && f.ends_with("not measured by a run"),
            "{f}"
        );
        (row.confirmed_seq_len, row.confirmed_peak_bytes) = (Some(1 << 18), Some(3 << 20));
        let f = finding(&row);
        assert!(f.contains("measured by a run at 262,144 tokens only (3.0 MiB per rank)"), "{f}");
        row.confirmed_seq_len = Some(1 << 20);
        assert!(finding(&row).ends_with("a run at that length measured 3.0 MiB per rank"), "{}", finding(&row));
    }

    #[test]
    fn capacity_from_measured_bytes_per_token_is_linear() {
        let mut m = Measurement::not_run(
            CaseSpec::dilated(crate::case::Implementation::Ring(attn_ring::Strategy::Auto), 4096, &[512], &[1]),
            "ok".into(),
            "g",
        );
        m.peak_bytes_per_rank = 4096 * 1000; // 1000 bytes per token
        let rows = table(&m.spec.clone(), &[m], &[1, 2], 1_000_000, None);
        // World 2 is a ring case: its query says even 1024 tokens need more than 1 MB per rank.
        assert_eq!(rows.len(), 1, "no world-2 row fits 1 MB");
        // 1e6 / 1000 = 1000 tokens fit; multiples of 512: 512.
        assert_eq!(rows[0].max_seq_len, 512);
        assert!(rows[0].bytes_at_max <= 1_000_000);
    }

    #[test]
    fn ring_rows_come_from_the_ring_workspace_query() {
        let base = CaseSpec::dilated(Implementation::Cpu, 8192, &[2048, 4096, 8192], &[1, 2, 4]);
        let budget = 256 << 20;
        // No measurements at all: every row comes from a query.
        let rows = table(&base, &[], &[1, 2, 4, 8], budget, None);
        assert_eq!(rows.iter().map(|r| r.world_size).collect::<Vec<_>>(), vec![1, 2, 4, 8]);
        for w in rows.windows(2) {
            assert!(w[1].max_seq_len > w[0].max_seq_len, "{} then {}", w[0].max_seq_len, w[1].max_seq_len);
        }
        for row in rows.iter().filter(|r| r.world_size > 1) {
            assert!(row.source.contains("attn-ring"), "{}", row.source);
            // Maximal: the next multiple of the step no longer fits, by the same query.
            let unit = 8192 * row.world_size;
            let spec = |n| case_at(&base, row.world_size, n);
            let (at, _) = per_rank_bytes(&spec(row.max_seq_len), &[]).unwrap();
            let (next, _) = per_rank_bytes(&spec(row.max_seq_len + unit), &[]).unwrap();
            assert!(at == row.bytes_at_max && at <= budget && next > budget, "{row:?}: next {next}");
            // Mostly the rank's own tensors: q, k, v, out (f32) and lse, n/p rows each.
            let io = (row.max_seq_len / row.world_size * 8 * (4 * 64 * 4 + 4)) as u64;
            assert!(at >= io && at < 2 * io, "{row:?}: tensors {io}");
        }
    }

    fn ok_measurement(spec: CaseSpec, peak: u64) -> Measurement {
        let mut m = Measurement::not_run(spec, "ok".into(), "g");
        m.peak_bytes_per_rank = peak;
        m
    }

    #[test]
    fn machine_length_divides_usable_memory_between_in_process_ranks() {
        assert_eq!(usable_machine_bytes(16 << 30), 13 << 30);
        assert_eq!(usable_machine_bytes(1 << 30), 0);
        let base = CaseSpec::dilated(Implementation::Cpu, 8192, &[2048, 4096, 8192], &[1, 2, 4]);
        let (budget, usable) = (1u64 << 30, 3u64 << 30);
        let rows = table(&base, &[], &[1, 2, 4, 8], budget, Some(usable));
        assert_eq!(rows.len(), 4);
        for row in &rows {
            let p = row.world_size as u64;
            let limit = budget.min(usable / p);
            assert_eq!(row.machine_limit_bytes, Some(limit), "{row:?}");
            let n = row.machine_seq_len.expect("a case fits");
            assert!(n <= row.max_seq_len, "{row:?}");
            // All P ranks together fit the usable memory, and the next step would not fit.
            let at = |n| per_rank_bytes(&case_at(&base, row.world_size, n), &[]).unwrap().0;
            assert!(at(n) <= limit && at(n) * p <= usable, "{row:?}");
            assert!(at(n + 8192 * row.world_size) > limit, "{row:?}");
        }
        // 1 GiB per rank fits P = 1 and 2 within 3 GiB; P = 4 and 8 get 768 and 384 MiB each.
        assert_eq!(rows[0].machine_seq_len, Some(rows[0].max_seq_len));
        assert!(rows[2].machine_seq_len < Some(rows[2].max_seq_len));
        assert!(rows[3].machine_seq_len < Some(rows[3].max_seq_len));
        let unknown = table(&base, &[], &[1], budget, None);
        assert_eq!((unknown[0].machine_limit_bytes, unknown[0].machine_seq_len), (None, None));
    }

    #[test]
    fn default_suite_runs_world_one_at_its_machine_length_and_reuses_ring_cases() {
        let base =
            CaseSpec { threads: 2, ..CaseSpec::dilated(Implementation::Cpu, 8192, &[2048, 4096, 8192], &[1, 2, 4]) };
        let rows = table(&base, &[], &[1, 2], 1 << 30, Some(64 << 30));
        let suite = [
            ok_measurement(case_at(&base, 1, 65536), 500 << 20),
            ok_measurement(case_at(&base, 2, 16384), 60 << 20),
            ok_measurement(case_at(&base, 2, 65536), 250 << 20),
            ok_measurement(CaseSpec { dtype: DType::BF16, ..case_at(&base, 2, 131072) }, 1),
        ];
        let one = rows[0].machine_seq_len.unwrap();
        assert!(one > 100_000, "{one}");
        assert_eq!(confirmation(&rows[0], &base, SuiteSize::Full, &suite), Confirmation::Run(case_at(&base, 1, one)));
        let Confirmation::Reuse(spec, why) = confirmation(&rows[0], &base, SuiteSize::Default, &suite) else {
            panic!("the one-rank row of the default suite reuses the suite's largest case");
        };
        assert_eq!(spec, case_at(&base, 1, 65536));
        assert!(why.contains("--full runs it") && why.contains(&int(one)), "{why}");
        assert_eq!(
            confirmation(&rows[1], &base, SuiteSize::Full, &suite),
            Confirmation::Run(case_at(&base, 2, rows[1].machine_seq_len.unwrap()))
        );
        let Confirmation::Reuse(spec, why) = confirmation(&rows[1], &base, SuiteSize::Default, &suite) else {
            panic!("ring rows of the default suite reuse the suite's largest case");
        };
        assert_eq!(spec, case_at(&base, 2, 65536), "same config only (not the bf16 case)");
        assert!(why.contains("--full"), "{why}");
        let Confirmation::Reuse(spec, why) = confirmation(&rows[0], &base, SuiteSize::Quick, &suite) else {
            panic!("--quick reuses a suite case");
        };
        assert_eq!(spec.seq_len, 65536);
        assert!(why.contains("--quick") && why.contains(&int(one)), "{why}");
        let Confirmation::Reuse(_, why) = confirmation(&rows[1], &base, SuiteSize::Quick, &suite) else {
            panic!("--quick reuses a suite ring case");
        };
        assert!(why.contains("--full runs"), "{why}");
        assert!(matches!(confirmation(&rows[1], &base, SuiteSize::Quick, &[]), Confirmation::Skip(_)));
        // The rendered row reports measured against predicted at the confirmed length.
        let mut row = rows[0].clone();
        let m = ok_measurement(case_at(&base, 1, 65536), 520 << 20);
        record(&mut row, &m.spec, &m, "smaller".into());
        let predicted = per_rank_bytes(&m.spec, &[]).unwrap().0;
        assert_eq!((row.confirmed_seq_len, row.confirmed_predicted_bytes), (Some(65536), Some(predicted)));
        let mut md = String::new();
        render(&mut md, &[row], 1 << 30);
        let line = md.lines().find(|l| l.starts_with("| 1 |")).unwrap();
        let ratio = format!("{:.3}", (520u64 << 20) as f64 / predicted as f64);
        assert!(line.contains("| 65,536 | 520.0 |") && line.contains(&ratio) && line.contains("smaller"), "{line}");
    }
}
