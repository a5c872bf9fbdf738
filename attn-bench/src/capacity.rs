//! The capacity table: the longest sequence whose per-rank memory fits a budget, for
//! world sizes 1, 2, 4, 8, and the largest such case that fits this machine, run.

use serde::{Deserialize, Serialize};

use crate::case::{CaseKind, CaseSpec, Measurement};

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
    /// A run of the largest fitting case this machine could hold: its measured peak.
    pub confirmed_seq_len: Option<usize>,
    pub confirmed_peak_bytes: Option<u64>,
    /// The workspace query's per-rank bytes at the confirmed length (where it exists).
    #[serde(default)]
    pub confirmed_predicted_bytes: Option<u64>,
}

/// Per-rank bytes for a case, as the library reports it before running anything, with
/// where they came from. World 1 on the CPU backend: `CpuBackend::workspace_bytes` plus
/// the tensors. Ring cases: the largest over ranks of attn-ring's
/// `Plan::workspace_bytes` (an upper bound of what a rank allocates during the call)
/// plus that rank's tensors (`Plan::io_bytes`).
pub fn workspace_query(spec: &CaseSpec) -> Option<(u64, String)> {
    match spec.kind {
        CaseKind::Dilated if spec.world_size == 1 && spec.implementation == "cpu" => {
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
    let dtype = spec.dtype().ok()?;
    let plan = attn_ring::Plan::new(problem).ok()?;
    (0..spec.world_size)
        .map(|r| plan.workspace_bytes(dtype, r, spec.backward) + plan.io_bytes(dtype, r, spec.backward))
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
        s = crate::suite_plan::ring_case(&s, world_size, crate::suite_plan::DEFAULT_STRATEGY, "contiguous");
    }
    s
}

/// Longest `seq` (multiple of `step * world`, doubling then bisecting) whose per-rank
/// bytes fit `budget`. Rows whose bytes cannot be determined are left out.
pub fn table(base: &CaseSpec, measured: &[Measurement], worlds: &[usize], budget: u64) -> Vec<CapacityRow> {
    let step = base.segments.iter().copied().max().unwrap_or(1);
    worlds
        .iter()
        .filter_map(|&p| {
            let unit = step * p;
            let fits = |k: usize| per_rank_bytes(&case_at(base, p, k * unit), measured).filter(|(b, _)| *b <= budget);
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
            Some(CapacityRow {
                world_size: p,
                budget_bytes: budget,
                max_seq_len: lo * unit,
                bytes_at_max: bytes,
                source,
                confirmed_seq_len: None,
                confirmed_peak_bytes: None,
                confirmed_predicted_bytes: None,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_from_measured_bytes_per_token_is_linear() {
        let mut m = Measurement::not_run(CaseSpec::dilated("ring-auto", 4096, &[512], &[1]), "ok".into(), "g");
        m.peak_bytes_per_rank = 4096 * 1000; // 1000 bytes per token
        let rows = table(&m.spec.clone(), &[m], &[1, 2], 1_000_000);
        // World 2 is a ring case: its query says even 1024 tokens need more than 1 MB per rank.
        assert_eq!(rows.len(), 1, "no world-2 row fits 1 MB");
        // 1e6 / 1000 = 1000 tokens fit; multiples of 512: 512.
        assert_eq!(rows[0].max_seq_len, 512);
        assert!(rows[0].bytes_at_max <= 1_000_000);
    }

    #[test]
    fn ring_rows_come_from_the_ring_workspace_query() {
        let base = CaseSpec::dilated("cpu", 8192, &[2048, 4096, 8192], &[1, 2, 4]);
        let budget = 256 << 20;
        // No measurements at all: every row comes from a query.
        let rows = table(&base, &[], &[1, 2, 4, 8], budget);
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
}
