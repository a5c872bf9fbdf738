//! `report.md`: the tables of the seed reports (per sequence length, per world size,
//! memory reduction, ring-size sweep, implementation comparison, capacity), built
//! only from measurements, plus the plots and what was skipped and why.

use std::collections::BTreeSet;
use std::fmt::Write;

use crate::baseline::{self, Comparison};
use crate::case::SEGMENTS;
use attn_core::{DType, Mixing};

use crate::case::{CaseKind, Implementation, Measurement};
use crate::format::{int, mb};
use crate::results::RunResults;
use crate::rss_report;

/// The measurements each part of the report uses.
#[derive(Debug)]
pub struct Selection<'a> {
    /// Ok single-rank CpuBackend scaling measurements.
    pub single: Vec<&'a Measurement>,
    /// Ok ring scaling measurements (default strategy, every world size including 1).
    pub ring: Vec<&'a Measurement>,
    /// Ok fwd f32 measurements for the throughput plot.
    pub throughput: Vec<&'a Measurement>,
    /// The ring-size sweep (one sequence length, all world sizes).
    pub sweep: Vec<&'a Measurement>,
}

impl<'a> Selection<'a> {
    pub fn of(r: &'a RunResults) -> Self {
        let ok = |s: &'static str| r.measurements.iter().filter(move |m| m.ok() && m.section == s);
        let single: Vec<&Measurement> = ok("scaling").filter(|m| m.spec.kind != CaseKind::Ring).collect();
        let ring: Vec<&Measurement> = ok("scaling").filter(|m| m.spec.kind == CaseKind::Ring).collect();
        // Throughput plot: every ok f32 forward of the scaling and comparison sections
        // (one rank, the ring at every P, the reference, the ring strategies, CUDA and
        // PyTorch where they ran); `plots` names a line by implementation and config.
        let throughput = r
            .measurements
            .iter()
            .filter(|m| m.status.starts_with("ok") && m.runs > 0)
            .filter(|m| m.section == "scaling" || m.section == "comparison")
            .filter(|m| m.spec.dtype == DType::F32 && !m.spec.backward && !m.spec.causal)
            .collect();
        let seqs: BTreeSet<usize> = ring.iter().map(|m| m.spec.seq_len).collect();
        let worlds_at = |n: usize| ring.iter().filter(|m| m.spec.seq_len == n).count();
        let sweep_seq = seqs.iter().copied().max_by_key(|&n| (worlds_at(n), n)).unwrap_or(0);
        let sweep = ring.iter().copied().filter(|m| m.spec.seq_len == sweep_seq).collect();
        Selection { single, ring, throughput, sweep }
    }
}

/// Peak RSS growth over the case, or the process peak in parentheses where the peak
/// could not be reset per case; a flagged cross-check is marked.
fn rss(m: &Measurement) -> String {
    let mark = if m.rss_check.flagged() { " (!)" } else { "" };
    match (rss_report::rss_growth(m), m.peak_rss_bytes) {
        (Some(g), _) => format!("{:.1}{mark}", mb(g)),
        (None, Some(b)) => format!("({:.1})", mb(b)),
        (None, None) => "n/a".into(),
    }
}

fn scaling_table(out: &mut String, rows: &[&Measurement], per_rank: bool, yardstick: f64) {
    let extra = if per_rank { " Seq/rank | MB sent/rank |" } else { "" };
    let _ = writeln!(
        out,
        "| Sequence length | Time (s) | Peak memory (MB) | Peak RSS growth (MB) | Throughput (tok/s) | KB/token | GFLOP/s | % of f32 GEMM |{extra}"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|{}", if per_rank { "---|---|" } else { "" });
    for m in rows {
        let _ = write!(
            out,
            "| {} | {:.3} | {:.2} | {} | {} | {:.2} | {:.1} | {:.1}% |",
            int(m.spec.seq_len),
            m.median_ms / 1e3,
            mb(m.peak_bytes_per_rank),
            rss(m),
            int(m.tokens_per_s as usize),
            m.kb_per_token(),
            m.gflop_per_s,
            100.0 * m.gflop_per_s / yardstick
        );
        if per_rank {
            let sent = m.bytes_sent.iter().copied().max().unwrap_or(0);
            let _ = write!(out, " {} | {:.2} |", int(m.spec.seq_len / m.spec.world_size), mb(sent));
        }
        out.push('\n');
    }
}

/// The yardstick of the "% of f32 GEMM" columns: the best f32 GEMM rate measured during
/// the run (at the start and next to every case), i.e. what this machine can deliver.
fn peak_gemm(r: &RunResults) -> f64 {
    r.measurements.iter().map(|m| m.gemm_gflop_per_s).filter(|g| g.is_finite()).fold(r.gemm.best_gflop_per_s, f64::max)
}

fn find<'a>(ms: &[&'a Measurement], world: usize, seq: usize) -> Option<&'a Measurement> {
    ms.iter().copied().find(|m| m.spec.world_size == world && m.spec.seq_len == seq)
}

/// (mean reduction factor, mean efficiency) at world size `p` over the sequences measured at both.
fn reduction_at(scaling: &[&Measurement], p: usize) -> Option<(f64, f64)> {
    let f: Vec<f64> = scaling
        .iter()
        .filter(|m| m.spec.world_size == p)
        .filter_map(|m| {
            find(scaling, 1, m.spec.seq_len).map(|o| o.peak_bytes_per_rank as f64 / m.peak_bytes_per_rank as f64)
        })
        .collect();
    (!f.is_empty()).then(|| {
        let mean = f.iter().sum::<f64>() / f.len() as f64;
        (mean, mean / p as f64)
    })
}

fn comparison_tables(out: &mut String, r: &RunResults, section: &str) {
    let yardstick = peak_gemm(r);
    let ms: Vec<&Measurement> = r.measurements.iter().filter(|m| m.section == section).collect();
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for m in &ms {
        let key = (m.spec.seq_len, m.spec.segments.clone());
        if !groups.contains(&key) {
            groups.push(key);
        }
    }
    for (seq, segs) in groups {
        let rows: Vec<&Measurement> =
            ms.iter().copied().filter(|m| m.spec.seq_len == seq && m.spec.segments == segs).collect();
        let kind = rows[0].spec.kind.as_str();
        let base = |imp: Implementation| {
            rows.iter().copied().find(|m| m.spec.implementation == imp && m.status.starts_with("ok"))
        };
        let (refm, torch) = (base(Implementation::Reference), base(Implementation::Torch));
        let _ = writeln!(
            out,
            "\n**{kind}, seq {}, segments {segs:?}, dilations {:?}**\n",
            int(seq),
            rows[0].spec.dilations
        );
        let _ = writeln!(
            out,
            "| Implementation | Time (ms) | GFLOP/s | % of f32 GEMM | Throughput (tok/s) | Peak MB/rank | vs reference | vs PyTorch |"
        );
        let _ = writeln!(out, "|---|---|---|---|---|---|---|---|");
        for m in &rows {
            let mut name = match (m.spec.layout, m.spec.kind) {
                (Some(l), CaseKind::Ring) => {
                    format!("{} P={} {}", m.spec.implementation, m.spec.world_size, l.as_str())
                }
                _ => m.spec.implementation.to_string(),
            };
            if m.spec.dtype != DType::F32 {
                name = format!("{name} {}", m.spec.dtype.as_str());
            }
            if !m.status.starts_with("ok") {
                let _ = writeln!(out, "| {name} | {} | | | | | | |", m.status);
                continue;
            }
            let speed =
                |b: Option<&Measurement>| b.map_or("-".into(), |b| format!("{:.2}x", b.median_ms / m.median_ms));
            let mem = match m.device_bytes {
                Some(d) => format!("{:.1} GPU ({:.1} host)", mb(d), mb(m.peak_bytes_per_rank)),
                None if m.peak_bytes_per_rank > 0 => format!("{:.1}", mb(m.peak_bytes_per_rank)),
                None => "n/m".into(),
            };
            let _ = writeln!(
                out,
                "| {name} | {:.2} | {:.1} | {:.1}% | {} | {mem} | {} | {} |",
                m.median_ms,
                m.gflop_per_s,
                100.0 * m.gflop_per_s / yardstick,
                int(m.tokens_per_s as usize),
                speed(refm),
                speed(torch)
            );
        }
    }
}

/// The whole report.
pub fn render(
    r: &RunResults,
    sel: &Selection<'_>,
    plots: &[String],
    baseline: Option<&[Comparison]>,
    threshold: f64,
) -> String {
    let mut o = String::new();
    let m = &r.machine;
    let _ = writeln!(o, "# attn benchmark report ({} suite)\n", r.suite);
    let _ = writeln!(
        o,
        "- **Machine**: {} ({} logical cores, {:.1} GiB){}{}\n- **Build**: {}, commit `{}`{}\n- **Run**: {} UTC, {} threads, took {:.0} s\n- **Measured f32 GEMM rate** (gemm crate, {n}x{n}x{n}) at the start: {:.1} GFLOP/s median, {:.1} best; \
         \"% of f32 GEMM\" divides by the best GEMM rate seen during the run ({:.1} GFLOP/s; \
         re-measured next to every case, see results.json); bf16 and f16 rows are divided by this f32 rate \
         too (no bf16 GEMM is measured), so they can exceed 100%",
        m.cpu,
        m.logical_cores,
        m.memory_bytes as f64 / (1u64 << 30) as f64,
        m.gpu.as_ref().map_or(String::new(), |g| format!(", GPU {g}")),
        if m.cpu_kernels.is_empty() { String::new() } else { format!("; CPU kernels `{}`", m.cpu_kernels) },
        m.rustc,
        m.git_commit,
        if m.git_dirty { " (with uncommitted changes)" } else { "" },
        m.timestamp_utc,
        r.threads,
        r.took_s,
        r.gemm.median_gflop_per_s,
        r.gemm.best_gflop_per_s,
        peak_gemm(r),
        n = r.gemm.n
    );
    let _ = writeln!(o, "- **Memory method**: {}", r.memory_method);
    let _ = writeln!(o, "- **CUDA**: {}\n", if r.cuda.is_empty() { "not recorded" } else { &r.cuda });
    let _ = writeln!(
        o,
        "Timings on a shared machine vary by 20-40% between runs; compare ratios within one report. \
         Scaling config: batch 1, 8 heads, head_dim 64, f32, forward, head-group mixing, segments {SEGMENTS:?}, dilations [1, 2, 4] \
         (segments longer than the sequence cover it whole).\n"
    );
    let _ = writeln!(o, "## Key findings\n");
    for p in [2, 4, 8, 16] {
        if let Some((f, e)) = reduction_at(&sel.ring, p) {
            let _ = writeln!(
                o,
                "- Memory per rank with {p} ranks: {f:.2}x smaller on average ({:.0}% of the ideal {p}x)",
                100.0 * e
            );
        }
    }
    if let Some(best) = sel.single.iter().max_by(|a, b| a.gflop_per_s.total_cmp(&b.gflop_per_s)) {
        let _ = writeln!(
            o,
            "- Best single-rank rate: {:.1} GFLOP/s ({:.0}% of the measured GEMM rate) at seq {}",
            best.gflop_per_s,
            100.0 * best.gflop_per_s / peak_gemm(r),
            int(best.spec.seq_len)
        );
    }
    for line in crate::features_report::findings(&r.measurements)
        .into_iter()
        .chain(crate::blocks_report::findings(&r.measurements))
    {
        let _ = writeln!(o, "- {line}");
    }
    for c in &r.capacity {
        let _ = writeln!(o, "- {}", crate::capacity::finding(c));
    }
    if r.includes("scaling") {
        scaling_sections(&mut o, r, sel);
    }
    if r.includes("comparison") {
        let _ = writeln!(
            o,
            "\n## Implementation comparison\n\nSpeedups are time ratios against the named implementation in the same table (PyTorch: `attn-bench/torch/torch_dilated.py`; n/m: not measured). \
             \"% of f32 GEMM\" divides every row, bf16 and f16 included, by the f32 GEMM rate."
        );
        comparison_tables(&mut o, r, "comparison");
    }
    if r.includes("multihead") {
        let _ =
            writeln!(o, "\n## Multihead (`MultiheadDilatedAttention`: projections + attention + LayerNorm + output)");
        comparison_tables(&mut o, r, "multihead");
    }
    variants_table(&mut o, r);
    if r.includes(crate::features::SECTION) {
        crate::features_report::render(&mut o, &r.measurements);
    }
    if r.includes(crate::blocks::SECTION) {
        let _ = writeln!(o, "\n## Block masks");
        crate::blocks_report::render(&mut o, &r.measurements);
    }
    if r.includes(crate::strategies::SECTION) {
        crate::strategies_report::render(&mut o, &r.measurements);
    }
    if r.includes("capacity") {
        crate::capacity::render(&mut o, &r.capacity, r.budget_bytes);
    }
    if let Some(h) = &r.hilbert_orders {
        h.render(&mut o);
    }
    if let Some(rows) = baseline {
        let _ = writeln!(o, "\n## Against the baseline\n\n{}", baseline::table(rows, threshold));
    }
    rss_report::render(&mut o, &r.measurements);
    if !plots.is_empty() {
        let _ = writeln!(o, "\n## Plots\n");
    }
    for p in plots.iter().filter(|p| p.ends_with(".png")) {
        let _ = writeln!(o, "![{p}]({p})\n");
    }
    let skipped: Vec<&Measurement> = r.measurements.iter().filter(|m| !m.status.starts_with("ok")).collect();
    if !skipped.is_empty() {
        let _ = writeln!(o, "## Not measured\n");
        let mut seen = BTreeSet::new();
        for m in skipped {
            if seen.insert(m.status.clone()) {
                let n = r.measurements.iter().filter(|x| x.status == m.status).count();
                let _ = writeln!(o, "- {n} case(s), e.g. `{}`: {}", m.spec.label(), m.status);
            }
        }
    }
    let size = match r.suite.as_str() {
        "quick" => " --quick",
        "full" => " --full",
        _ => "",
    };
    let sections = if r.sections.is_empty() { String::new() } else { format!(" --section {}", r.sections.join(",")) };
    let _ = writeln!(
        o,
        "\nReproduce: `cargo xtask bench{size}{sections}` (all measurements with their configs are in `results.json`)."
    );
    o
}

/// The scaling tables: one rank, the ring at every world size, memory reduction, the sweep.
fn scaling_sections(o: &mut String, r: &RunResults, sel: &Selection<'_>) {
    let _ = writeln!(o, "\n## Single rank: CpuBackend ({} threads)\n", r.threads);
    scaling_table(o, &sel.single, false, peak_gemm(r));
    let worlds: BTreeSet<usize> = sel.ring.iter().map(|m| m.spec.world_size).collect();
    for &p in &worlds {
        let rows: Vec<&Measurement> = sel.ring.iter().copied().filter(|m| m.spec.world_size == p).collect();
        let _ = writeln!(
            o,
            "\n## Ring (strategy auto, contiguous), world size {p}: one thread per rank, memory per rank\n\nPeak RSS growth is the whole process's (all {p} ranks), the cross-check of their summed allocator peak.\n"
        );
        scaling_table(o, &rows, true, peak_gemm(r));
    }
    let _ = writeln!(
        o,
        "\n## Memory reduction\n\nPer-rank peak of the ring on P ranks against the same code on one rank.\n\n| Sequence length | World size | 1 rank (MB) | Per rank (MB) | Reduction factor | Efficiency |\n|---|---|---|---|---|---|"
    );
    for m in sel.ring.iter().filter(|m| m.spec.world_size > 1) {
        if let Some(one) = find(&sel.ring, 1, m.spec.seq_len) {
            let f = one.peak_bytes_per_rank as f64 / m.peak_bytes_per_rank as f64;
            let _ = writeln!(
                o,
                "| {} | {} | {:.2} | {:.2} | {f:.2}x | {:.1}% |",
                int(m.spec.seq_len),
                m.spec.world_size,
                mb(one.peak_bytes_per_rank),
                mb(m.peak_bytes_per_rank),
                100.0 * f / m.spec.world_size as f64
            );
        }
    }
    let mut sweep = sel.sweep.clone();
    sweep.sort_by_key(|m| m.spec.world_size);
    if let Some(first) = sweep.first() {
        let _ = writeln!(
            o,
            "\n## Ring-size sweep (seq {})\n\n| Ranks | Seq/rank | Time (ms) | Per-rank peak (MB) | Reduction | Efficiency | MB sent/rank | tok/s |\n|---|---|---|---|---|---|---|---|",
            int(first.spec.seq_len)
        );
        let base = find(&sweep, 1, first.spec.seq_len);
        for m in &sweep {
            let f = base.map_or(f64::NAN, |b| b.peak_bytes_per_rank as f64 / m.peak_bytes_per_rank as f64);
            let sent = m.bytes_sent.iter().copied().max().unwrap_or(0);
            let _ = writeln!(
                o,
                "| {} | {} | {:.1} | {:.2} | {f:.2}x | {:.1}% | {:.2} | {} |",
                m.spec.world_size,
                int(m.spec.seq_len / m.spec.world_size),
                m.median_ms,
                mb(m.peak_bytes_per_rank),
                100.0 * f / m.spec.world_size as f64,
                mb(sent),
                int(m.tokens_per_s as usize)
            );
        }
        let _ = writeln!(
            o,
            "\nIn-process ranks share this machine's cores, so time does not fall with more ranks here; memory per rank does."
        );
    }
}

/// The variants table (dtype, causal, backward, mixing, Hilbert order), when measured.
fn variants_table(o: &mut String, r: &RunResults) {
    let variants: Vec<&Measurement> = r.measurements.iter().filter(|m| m.section == "variants").collect();
    if !variants.is_empty() {
        let _ = writeln!(
            o,
            "\n## Variants (dtype, causal, backward, mixing, Hilbert order)\n\n| Case | Time (ms) | GFLOP/s | % of f32 GEMM | Peak MB/rank | Status |\n|---|---|---|---|---|---|"
        );
        for m in variants {
            let mixing = if m.spec.mixing == Mixing::LongNet { " longnet" } else { "" };
            let layout = m.spec.layout.map_or(String::new(), |l| format!(" {}", l.as_str()));
            let _ = writeln!(
                o,
                "| {}{mixing}{layout} | {:.1} | {:.1} | {:.1}% | {} | {} |",
                m.spec.label(),
                m.median_ms,
                m.gflop_per_s,
                100.0 * m.gflop_per_s / peak_gemm(r),
                if m.peak_bytes_per_rank > 0 { format!("{:.1}", mb(m.peak_bytes_per_rank)) } else { "n/m".into() },
                m.status
            );
        }
    }
}
