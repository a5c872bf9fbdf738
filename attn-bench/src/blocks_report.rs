//! The "Block-sparse attention" part of `report.md`: forward and forward+backward time of
//! each block mask against the all-kept mask of the same pass, and the ring bytes of the
//! local window masks against `attn_ring::expected_bytes` and the bound `f + 1/nb` on
//! their share of the all-kept mask's bytes. Built from the `blocks` measurements alone;
//! a row whose case did not run shows its status.

use std::fmt::Write;

use attn_core::Pass;
use attn_ring::{Plan, expected_bytes};

use crate::block_sparse::{self, BlockSparse, SparseKind};
use crate::blocks::{KEPT_PERCENT, SECTION, all_kept, mask};
use crate::case::{CaseKind, Measurement};
use crate::features_report::{ok_ms, ratio};
use crate::format::int;

/// The section's measurements.
fn rows(ms: &[Measurement]) -> Vec<&Measurement> {
    ms.iter().filter(|m| m.section == SECTION).collect()
}

/// The single-rank row of mask `b` in `pass` (either kind of row when `kind` matches).
fn find<'m>(ms: &[&'m Measurement], kind: CaseKind, b: BlockSparse, backward: bool) -> Option<&'m Measurement> {
    ms.iter().find(|m| m.spec.kind == kind && m.spec.backward == backward && m.spec.block_sparse == Some(b)).copied()
}

/// `a / b`, `None` when either is missing or zero.
pub fn share_of(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if a > 0.0 && b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// The time cell of a row: median ms, or its status.
fn time_cell(m: Option<&Measurement>) -> String {
    match m {
        Some(m) if m.ok() => format!("{:.1}", m.median_ms),
        Some(m) => m.status.clone(),
        None => "not measured".into(),
    }
}

fn times(o: &mut String, ms: &[&Measurement]) {
    let Some(first) = ms.iter().find(|m| m.spec.kind == CaseKind::Dilated) else { return };
    let s = &first.spec;
    let _ = writeln!(
        o,
        "\n### Block-sparse attention\n\n\
         `CpuBackend`, {} threads, {} heads, head_dim {}, {}, seq {}, one pattern over the whole sequence at rate 1, \
         block size {}. Random: `round(f * nb)` key blocks of each query block drawn at random, the diagonal among \
         them; local_window: `BlockPattern::LocalWindow` of `round(f * nb)` blocks (the Python library's \
         `local_window_size = f * n`; edge rows keep fewer). Kept tiles: the share of (query block, key block) pairs \
         kept. Ratios: time against the all-kept mask of the same pass in this run.\n\n\
         | Mask | f | Kept tiles | Forward (ms) | Forward / all kept | Fwd+bwd (ms) | Fwd+bwd / all kept |\n\
         |---|---|---|---|---|---|---|",
        s.threads,
        s.heads,
        s.head_dim,
        s.dtype.as_str(),
        int(s.seq_len),
        s.block_sparse.map_or(0, |b| b.block_size),
    );
    let n = s.seq_len;
    let base = |backward| ok_ms(find(ms, CaseKind::Dilated, all_kept(), backward).as_ref());
    for kind in [SparseKind::Random, SparseKind::LocalWindow] {
        for p in KEPT_PERCENT {
            let b = mask(kind, p);
            let (f, fb) = (find(ms, CaseKind::Dilated, b, false), find(ms, CaseKind::Dilated, b, true));
            if f.is_none() && fb.is_none() {
                continue;
            }
            let tiles = block_sparse::kept_tile_share(&b, n).map_or("n/a".into(), |t| format!("{t:.3}"));
            let _ = writeln!(
                o,
                "| {} | {p}% | {tiles} | {} | {} | {} | {} |",
                kind.as_str(),
                time_cell(f),
                ratio(ok_ms(f.as_ref()), base(false)),
                time_cell(fb),
                ratio(ok_ms(fb.as_ref()), base(true)),
            );
        }
    }
}

/// Measured bytes of a ring row summed over ranks, and whether every rank sent exactly
/// what `expected_bytes` says (with the formula's sum).
fn ring_bytes(m: &Measurement) -> Option<(u64, u64, bool)> {
    if !m.ok() || m.data_bytes_sent.len() != m.spec.world_size {
        return None;
    }
    let problem = crate::ring_runner::problem(&m.spec).ok()?;
    let expected = expected_bytes(&Plan::new(problem).ok()?, m.spec.dtype, Pass::Forward);
    Some((m.data_bytes_sent.iter().sum(), expected.iter().sum(), expected == m.data_bytes_sent))
}

fn ring(o: &mut String, ms: &[&Measurement]) {
    let ring: Vec<&Measurement> = ms.iter().filter(|m| m.spec.kind == CaseKind::Ring).copied().collect();
    let Some(first) = ring.first() else { return };
    let s = &first.spec;
    let nb = s.seq_len.div_ceil(s.block_sparse.map_or(1, |b| b.block_size));
    let _ = writeln!(
        o,
        "\n### Ring bytes under local window masks\n\n\
         {} in-process ranks, strategy {}, layout {}, seq {}, one forward call each: the bytes every rank sends \
         (`RingStats::data_bytes_sent`, headers included) summed over ranks, against `attn_ring::expected_bytes` \
         (per rank), and their share of the all-kept mask's bytes against the bound f + 1/nb (f: the window's \
         width `round(f * nb)` over nb = {nb}; the kept tiles are fewer, the sequence's ends cutting off the \
         window's corners).\n\n\
         | Mask | f (window) | Kept tiles | Bytes sent | expected_bytes | Every rank equal | / all kept | Bound f + 1/nb | Within |\n\
         |---|---|---|---|---|---|---|---|---|",
        s.world_size,
        s.strategy.unwrap_or_default().as_str(),
        s.layout.unwrap_or_default().as_str(),
        int(s.seq_len),
    );
    let full = find(&ring, CaseKind::Ring, all_kept(), false).and_then(ring_bytes);
    for m in &ring {
        let Some(b) = m.spec.block_sparse else { continue };
        let name =
            if b == all_kept() { "all kept".to_string() } else { format!("{} {}%", b.kind.as_str(), b.kept_percent) };
        let Some((sent, expected, equal)) = ring_bytes(m) else {
            let _ = writeln!(o, "| {name} | | | {} | | | | | |", m.status);
            continue;
        };
        let f = block_sparse::kept_blocks(b.kept_percent, nb) as f64 / nb as f64;
        let tiles = block_sparse::kept_tile_share(&b, m.spec.seq_len).unwrap_or(f64::NAN);
        let bound = block_sparse::ring_bytes_bound(f, nb);
        let share = share_of(Some(sent as f64), full.map(|(s, _, _)| s as f64));
        let _ = writeln!(
            o,
            "| {name} | {f:.3} | {tiles:.3} | {} | {} | {} | {} | {bound:.3} | {} |",
            int(sent as usize),
            int(expected as usize),
            if equal { "yes" } else { "no" },
            share.map_or("n/a".into(), |r| format!("{r:.3}")),
            match share {
                Some(r) if r <= bound => "yes",
                Some(_) => "no",
                None => "n/a",
            },
        );
    }
}

/// The section (nothing when no `blocks` case was measured).
pub fn render(o: &mut String, measurements: &[Measurement]) {
    let ms = rows(measurements);
    if ms.is_empty() {
        return;
    }
    times(o, &ms);
    ring(o, &ms);
}

/// The key findings: the random masks' forward at 10% and 5% against the all-kept time.
pub fn findings(measurements: &[Measurement]) -> Vec<String> {
    let ms = rows(measurements);
    let fwd = |b| find(&ms, CaseKind::Dilated, b, false).filter(|m| m.ok());
    let sparse = |p| fwd(mask(SparseKind::Random, p));
    match (sparse(10), sparse(5)) {
        (Some(f10), Some(f5)) => {
            let full = ok_ms(fwd(all_kept()).as_ref());
            vec![format!(
                "Block-sparse forward at seq {}: 10% of the blocks kept takes {} and 5% {} of the all-kept time",
                int(f10.spec.seq_len),
                ratio(Some(f10.median_ms), full),
                ratio(Some(f5.median_ms), full),
            )]
        }
        _ => Vec::new(),
    }
}
