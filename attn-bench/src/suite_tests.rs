//! Tests of the suite's output: a synthetic results set rendered through the real
//! report and plot writers into a temporary folder, and the `--torch` comparison path
//! driven by a fake interpreter that prints what `torch_dilated.py` prints.

use super::*;

use std::path::PathBuf;

use indicatif::ProgressDrawTarget;

use attn_ring::{Layout, Strategy};

use crate::case::{Implementation, SMALL_SEGMENTS, ring_case};
use crate::format::int;
use crate::gemm_rate::GemmRate;
use crate::memory::TEST_WINDOW_LOCK;

const GIT: &str = "0123456789abcdef0123456789abcdef01234567";
const PLOTS: [&str; 5] =
    ["memory_vs_seq", "memory_reduction", "throughput_vs_seq", "memory_per_token", "ring_size_sweep"];

/// A fresh empty folder under the system temp dir, removed when the guard drops.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("attn-bench-{name}-")).tempdir().unwrap()
}

/// An ok measurement of `spec` in `section`: `ms` per call, a per-rank peak of
/// `kb_per_token` KB per token of the whole sequence.
fn ok(section: &str, spec: CaseSpec, ms: f64, kb_per_token: f64) -> Measurement {
    let mut m = Measurement::not_run(spec, "ok".into(), GIT);
    let per_rank = m.spec.tokens() as f64;
    m.section = section.into();
    m.runs = 3;
    (m.median_ms, m.min_ms, m.max_ms) = (ms, ms * 0.9, ms * 1.1);
    m.gflop_per_s = m.spec.attention_flops().unwrap() / (ms / 1e3) / 1e9;
    m.tokens_per_s = m.spec.tokens() as f64 / (ms / 1e3);
    m.peak_bytes_per_rank = (kb_per_token * 1024.0 * per_rank) as u64;
    m.peak_bytes = m.peak_bytes_per_rank * m.spec.world_size as u64;
    m.rank_peak_bytes = vec![m.peak_bytes_per_rank; m.spec.world_size];
    m.bytes_sent = vec![if m.spec.world_size > 1 { 1 << 20 } else { 0 }; m.spec.world_size];
    m.gemm_gflop_per_s = 100.0;
    m
}

fn machine() -> Machine {
    Machine {
        cpu: "Test CPU".into(),
        cpu_kernels: "avx2".into(),
        logical_cores: 2,
        memory_bytes: 16 << 30,
        os: "linux test".into(),
        rustc: "rustc 1.99.0 (test 2030-01-01)".into(),
        git_commit: GIT.into(),
        git_dirty: false,
        timestamp_utc: "2030-01-01T00-00-00Z".into(),
        gpu: None,
    }
}

fn dilated(imp: Implementation, n: usize) -> CaseSpec {
    CaseSpec { threads: 2, ..CaseSpec::dilated(imp, n, &SEGMENTS, &DILATIONS) }
}

/// A default-suite-shaped results set (scaling, ring sweep, comparison, multihead,
/// variants, capacity); `extra` is appended to its measurements.
fn synthetic(extra: Vec<Measurement>) -> RunResults {
    let mut ms = Vec::new();
    for e in 11..=16 {
        ms.push(ok("scaling", dilated(Implementation::Cpu, 1 << e), (1 << e) as f64 / 64.0, 8.0));
    }
    for n in [2048, 8192] {
        for p in [1, 2, 4, 8, 16] {
            ms.push(ok(
                "scaling",
                ring_case(&dilated(Implementation::Cpu, n), p, Strategy::Auto, Layout::Contiguous),
                n as f64 / 40.0,
                8.0 / p as f64 + 0.5,
            ));
        }
    }
    let small =
        |imp: Implementation| CaseSpec { threads: 2, ..CaseSpec::dilated(imp, 2048, &SMALL_SEGMENTS, &DILATIONS) };
    ms.push(ok("comparison", small(Implementation::Reference), 400.0, 30.0));
    ms.push(ok("comparison", small(Implementation::Cpu), 20.0, 9.0));
    ms.push(Measurement {
        section: "comparison".into(),
        ..Measurement::not_run(small(Implementation::Cuda), "skipped: CUDA not compiled in".into(), GIT)
    });
    ms.push(ok("comparison", ring_case(&small(Implementation::Cpu), 2, Strategy::Auto, Layout::Contiguous), 40.0, 5.0));
    ms.push(ok("comparison", dilated(Implementation::Cpu, 8192), 100.0, 8.5));
    ms.push(ok("comparison", CaseSpec { dtype: DType::BF16, ..dilated(Implementation::Cpu, 8192) }, 20.0, 4.5));
    for s in [Strategy::Auto, Strategy::Ring, Strategy::AllGather] {
        ms.push(ok("comparison", ring_case(&dilated(Implementation::Cpu, 8192), 4, s, Layout::Contiguous), 300.0, 3.0));
    }
    ms.push(ok("multihead", CaseSpec { kind: CaseKind::Multihead, ..dilated(Implementation::Cpu, 8192) }, 180.0, 20.0));
    // bf16 at 16K: faster than the f32 GEMM yardstick allows, so above 100%.
    ms.push(ok("variants", CaseSpec { dtype: DType::BF16, ..dilated(Implementation::Cpu, 16384) }, 10.0, 4.0));
    ms.extend(extra);
    let base = dilated(Implementation::Cpu, 8192);
    let mut capacity = capacity::table(&base, &ms, &[1, 2, 4, 8], 8 << 30, Some(12 << 30));
    let confirmed = ok("capacity", capacity::case_at(&base, 1, 65536), 900.0, 8.1);
    capacity::record(&mut capacity[0], &confirmed.spec, &confirmed, "synthetic".into());
    capacity[1].confirm_note = "not run: synthetic".into();
    ms.push(confirmed);
    RunResults {
        suite: "default".into(),
        threads: 2,
        machine: machine(),
        gemm: GemmRate { n: GEMM_N, threads: 2, median_gflop_per_s: 90.0, best_gflop_per_s: 100.0 },
        memory_method: MEMORY_METHOD.into(),
        budget_bytes: 8 << 30,
        measurements: ms,
        capacity,
        took_s: 12.0,
        hilbert_orders: None,
        cuda: "not compiled in".into(),
        rss_check_rule: rss_check::RULE.into(),
        sections: Vec::new(),
    }
}

/// The table rows (lines starting with `|`) right after the first line containing `heading`.
fn table_after<'a>(md: &'a str, heading: &str) -> Vec<&'a str> {
    let start = md.find(heading).unwrap_or_else(|| panic!("no `{heading}` in\n{md}"));
    md[start..].lines().skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|')).collect()
}

#[test]
fn report_json_and_plots_hold_every_table_the_issue_lists() {
    // Renders bitmaps (megabytes): kept out of the measuring tests' memory windows.
    let _guard = TEST_WINDOW_LOCK.lock();
    let dir_tmp = temp_dir("report");
    let dir = dir_tmp.path();
    let results = synthetic(Vec::new());
    results.save(&dir.join("results.json")).unwrap();
    write_report(dir, &results, None, 10.0).unwrap();
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();

    // Per sequence length: time, peak MB, tokens/s, KB/token, % of the f32 GEMM.
    let single = table_after(&md, "## Single rank: CpuBackend");
    for col in ["Time (s)", "Peak memory (MB)", "Throughput (tok/s)", "KB/token", "GFLOP/s", "% of f32 GEMM"] {
        assert!(single[0].contains(col), "{col}: {}", single[0]);
    }
    assert_eq!(single.len(), 2 + 6, "header, rule and 2K..64K:\n{}", single.join("\n"));
    assert!(single[2].starts_with("| 2,048 |") && single[7].starts_with("| 65,536 |"));
    // 8 KB/token, 64 tokens/ms.
    assert!(single[7].contains("| 8.00 |") && single[7].contains("| 64,000 |"), "{}", single[7]);
    // Per world size, with sequence per rank.
    for p in [1, 2, 4, 8, 16] {
        let rows = table_after(&md, &format!("world size {p}: one thread per rank"));
        assert!(rows[0].contains("Seq/rank") && rows[0].contains("KB/token"), "{}", rows[0]);
        assert!(
            rows.iter().any(|r| r.starts_with("| 8,192 |") && r.contains(&format!("| {} |", int(8192 / p)))),
            "P={p}"
        );
    }
    // Memory reduction factor and efficiency: 8.5 KB/token on one rank, 8/p + 0.5 on p.
    let red = table_after(&md, "## Memory reduction");
    assert!(red[0].contains("Reduction factor") && red[0].contains("Efficiency"));
    let f4 = 8.5 / 2.5;
    assert!(
        red.iter().any(|r| r.starts_with("| 8,192 | 4 |")
            && r.contains(&format!("{f4:.2}x"))
            && r.contains(&format!("{:.1}%", 100.0 * f4 / 4.0))),
        "{red:?}"
    );
    let sweep = table_after(&md, "## Ring-size sweep (seq 8,192)");
    assert_eq!(sweep.len(), 2 + 5, "{sweep:?}");
    // Implementation comparison with speedups against the reference.
    let cmp = table_after(&md, "**dilated, seq 2,048, segments [512, 1024, 2048]");
    assert!(cmp[0].contains("vs reference") && cmp[0].contains("vs PyTorch") && cmp[0].contains("% of f32 GEMM"));
    assert!(cmp.iter().any(|r| r.starts_with("| cpu |") && r.contains("| 20.00x |")), "{cmp:?}");
    assert!(cmp.iter().any(|r| r.starts_with("| cuda | skipped")), "{cmp:?}");
    assert!(cmp.iter().any(|r| r.starts_with("| ring-auto P=2 contiguous |") && r.contains("| 10.00x |")), "{cmp:?}");
    assert!(md.contains("## Multihead"));
    // bf16 against the f32 GEMM: above 100%, and labelled as such.
    let variants = table_after(&md, "## Variants");
    assert!(variants[0].contains("% of f32 GEMM"), "{}", variants[0]);
    let bf16 = variants.iter().find(|r| r.contains("bf16")).unwrap();
    let pct: f64 = bf16.split('|').nth(4).unwrap().trim().trim_end_matches('%').parse().unwrap();
    assert!(pct > 100.0, "{bf16}");
    assert!(md.contains("bf16 and f16 rows are divided by this f32 rate"));
    // Capacity: one row per world size, the machine column, measured against predicted.
    let cap = table_after(&md, "## Sequence length capabilities (per-rank budget 8.0 GiB)");
    assert_eq!(cap.len(), 2 + 4, "{cap:?}");
    for col in ["Max sequence", "This machine", "Measured MB/rank", "Query MB/rank", "Measured/query"] {
        assert!(cap[0].contains(col), "{col}: {}", cap[0]);
    }
    assert!(
        cap[2].starts_with("| 1 | 1,0") && cap[2].contains("| 65,536 |") && cap[2].contains("synthetic"),
        "{}",
        cap[2]
    );
    assert!(cap[3].starts_with("| 2 |") && cap[3].contains("not run: synthetic"), "{}", cap[3]);
    // P = 8 gets 1.5 GiB of this (synthetic) machine's 12 GiB per rank.
    assert!(cap[5].starts_with("| 8 |") && cap[5].contains("(1.5 GiB)"), "{}", cap[5]);
    assert!(md.contains(&format!("commit `{GIT}`")) && md.contains("rustc 1.99.0"));

    // The five plots, as PNG and SVG, linked from the report.
    for stem in PLOTS {
        for ext in ["png", "svg"] {
            let f = dir.join(format!("{stem}.{ext}"));
            let len = std::fs::metadata(&f).map_or(0, |m| m.len());
            assert!(len > 1000, "{} is {len} bytes", f.display());
        }
        assert!(md.contains(&format!("![{stem}.png]({stem}.png)")), "{stem}");
    }
    let png = std::fs::read(dir.join("memory_vs_seq.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(std::fs::read_to_string(dir.join("ring_size_sweep.svg")).unwrap().contains("<svg"));

    // results.json: the machine, rustc, git commit and every measurement with its config.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["machine"]["rustc"], "rustc 1.99.0 (test 2030-01-01)");
    assert_eq!(json["machine"]["git_commit"], GIT);
    let ms = json["measurements"].as_array().unwrap();
    assert_eq!(ms.len(), results.measurements.len());
    for m in ms {
        let spec = &m["spec"];
        for key in [
            "kind",
            "implementation",
            "seq_len",
            "heads",
            "head_dim",
            "segments",
            "dilations",
            "dtype",
            "world_size",
            "threads",
        ] {
            assert!(!spec[key].is_null(), "{key} missing in {spec}");
        }
        assert_eq!(m["git_commit"], GIT);
    }
    assert_eq!(json["capacity"].as_array().unwrap().len(), 4);
    assert_eq!(RunResults::load(&dir.join("results.json")).unwrap().measurements.len(), ms.len());
}

/// A fake interpreter: logs its arguments (the script path first) and prints a
/// warning and then the JSON line `torch_dilated.py` prints, or fails when asked.
fn fake_python(dir: &Path, fail: bool) -> PathBuf {
    let body = if fail {
        "echo 'ModuleNotFoundError: No module named torch' >&2\nexit 1\n".to_string()
    } else {
        "echo 'UserWarning: something torch says'\n\
         echo '{\"impl\": \"torch\", \"torch\": \"9.9.9+fake\", \"device\": \"cpu\", \"threads\": 2, \
         \"median_ms\": 50.0, \"gflop_per_s\": 12.5, \"tokens_per_s\": 163840.0}'\n"
            .to_string()
    };
    let path = dir.join(if fail { "broken-python" } else { "fake-python" });
    let log = dir.join("argv.log");
    std::fs::write(&path, format!("#!/bin/sh\necho \"$@\" >> '{}'\n{body}", log.display())).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    path
}

#[cfg(unix)]
#[test]
fn torch_flag_adds_pytorch_rows_and_speedups_to_the_comparison() {
    let _guard = TEST_WINDOW_LOCK.lock();
    let dir_tmp = temp_dir("torch");
    let dir = dir_tmp.path();
    let python = fake_python(dir, false);
    let results = synthetic(Vec::new());
    let multi = MultiProgress::with_draw_target(ProgressDrawTarget::hidden());
    let rows = torch_rows(&python, &results.measurements, 3, GIT, &multi, &|threads| 50.0 * threads as f64);
    // cpu 2048 (small segments), cpu 8192 f32 and bf16, multihead 8192, bf16 variant:
    // every cpu head-group case of those sections; never the reference, ring or f16.
    assert_eq!(rows.len(), 5, "{:#?}", rows.iter().map(|m| m.spec.label()).collect::<Vec<_>>());
    for m in &rows {
        assert!(m.status.starts_with("ok (9.9.9+fake"), "{}", m.status);
        assert_eq!((m.spec.implementation.as_str(), m.median_ms, m.runs), ("torch", 50.0, 3));
        assert_eq!(m.gemm_gflop_per_s, 100.0);
    }
    assert_eq!(rows.iter().filter(|m| m.section == "multihead").count(), 1);
    let log = std::fs::read_to_string(dir.join("argv.log")).unwrap();
    assert!(log.lines().all(|l| l.contains("torch_dilated.py") || l.contains("torch_multihead.py")), "{log}");
    assert!(
        log.contains("--seq-len 8192") && log.contains("--segments 2048,4096,8192") && log.contains("--dtype bf16"),
        "{log}"
    );

    // Rendered: the torch row and the cpu row's speedup against it (50 ms / 100 ms).
    let with_torch = synthetic(rows);
    write_report(dir, &with_torch, None, 10.0).unwrap();
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    let cmp = table_after(&md, "**dilated, seq 8,192, segments [2048, 4096, 8192]");
    assert!(cmp.iter().any(|r| r.starts_with("| torch |") && r.contains("| n/m |")), "{cmp:?}");
    assert!(cmp.iter().any(|r| r.starts_with("| cpu |") && r.ends_with("| 0.50x |")), "{cmp:?}");
    assert!(cmp.iter().any(|r| r.starts_with("| cpu bf16 |") && r.ends_with("| 2.50x |")), "{cmp:?}");

    // A broken interpreter: error rows saying why, not a failed suite.
    let broken = fake_python(dir, true);
    let rows = torch_rows(&broken, &results.measurements, 3, GIT, &multi, &|_| 1.0);
    assert_eq!(rows.len(), 5);
    assert!(
        rows.iter().all(|m| m.status.starts_with("error:") && m.status.contains("No module named torch")),
        "{}",
        rows[0].status
    );
}

/// Synthetic measurements of every `--quick` features case: grouped heads 1.02x their
/// tensors and 1.2x faster than repeated K/V, padded at half the packed tokens/s, dense
/// causal 5x the window's time, ring rows sending exactly their counted rows.
fn feature_measurements() -> Vec<Measurement> {
    crate::features::cases(SuiteSize::Quick)
        .into_iter()
        .map(|(spec, _)| {
            let ms = match &spec {
                s if s.repeat_kv => 120.0,
                s if s.varlen.as_ref().is_some_and(|v| v.layout == crate::case::VarLenLayout::Padded) => 200.0,
                s if s.window.is_none() && s.segments == [s.seq_len] => 500.0,
                _ => 100.0,
            };
            let mut m = ok(crate::features::SECTION, spec, ms, 1.0);
            if m.spec.kind == CaseKind::Ring {
                let problem = crate::ring_runner::problem(&m.spec).unwrap();
                let counted = crate::ring_bytes::counted(&problem, attn_core::DType::F32);
                m.data_messages = vec![3; m.spec.world_size];
                m.data_bytes_sent = counted.sent.iter().map(|b| b + 27).collect();
            } else if m.spec.kv_heads.is_some() {
                let s = m.spec.attn_shape().unwrap();
                let tensors = 4 * (2 * s.q.numel() + 2 * s.kv.numel()) as u64;
                m.peak_bytes = tensors * if m.spec.repeat_kv { 160 } else { 102 } / 100;
                m.workspace_query_bytes = Some(tensors + 4 * s.q.lse_len() as u64 + (3 << 20));
            }
            m
        })
        .collect()
}

#[test]
fn the_features_section_pairs_its_rows_and_reports_ratios_and_bytes() {
    let _guard = TEST_WINDOW_LOCK.lock();
    let dir_tmp = temp_dir("features");
    let dir = dir_tmp.path();
    let mut results = synthetic(feature_measurements());
    write_report(dir, &results, None, 10.0).unwrap();
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(md.contains("## Attention features") && md.contains("## Single rank"), "{md}");
    let gqa = table_after(&md, "### Grouped-query attention against repeated K/V");
    assert_eq!(gqa.len(), 2 + 2, "{gqa:?}");
    assert!(gqa[2].starts_with("| 8 heads on 1 K/V head(s) | 16,384 | 100.0 | 3 |") && gqa[2].contains("| 1.020 |"));
    assert!(gqa[3].starts_with("| K/V repeated to 8 heads by the caller |") && gqa[3].contains("| 1.600 |"));
    assert!(md.contains("Grouped peak / tensors: 1.020, target <= 1.1 met"), "{md}");
    assert!(md.contains("the kernel's workspace (3.0 MB by its query)") && md.contains("time 1.20x, peak 1.57x"));
    let lengths = crate::features::draw_lengths(crate::features::LENGTHS_SEED, 8, 4096);
    assert!(md.contains(&format!("1..=4096 with seed 2026: {lengths:?}")), "{md}");
    // Two attention configs, dilated and dense, a packed and a padded row each.
    let varlen = table_after(&md, "### Packed against padded sequences");
    assert_eq!(varlen.len(), 2 + 4, "{varlen:?}");
    assert!(varlen[2].starts_with("| segments [2048, 4096, 8192], dilations [1, 2, 4] | fwd | packed"), "{varlen:?}");
    assert!(varlen[5].starts_with("| dense (segment 4096) | fwd | padded + key padding mask |"), "{varlen:?}");
    assert!(md.contains("Packed / padded real tokens/s (target >= 1.5x), and the attended"), "{md}");
    let packed: Vec<&Measurement> = results.measurements.iter().filter(|m| m.spec.varlen.is_some()).collect();
    let pairs = |m: &Measurement| {
        crate::varlen_pairs::varlen_pairs(&m.spec.config().unwrap(), m.spec.heads, &lengths).unwrap().ratio()
    };
    let (dilated, dense) = (pairs(packed[0]), pairs(packed.last().unwrap()));
    // Padding costs little where segments end before the longest sequence, its full share under dense attention.
    assert!(dilated > 1.0 && dilated < 1.35 && dense > 1.35, "{dilated} {dense}");
    for (attention, ratio) in
        [("segments [2048, 4096, 8192], dilations [1, 2, 4]", dilated), ("dense (segment 4096)", dense)]
    {
        assert!(md.contains(&format!("- {attention}: fwd 2.00x; pairs {ratio:.3} (")), "{md}");
    }
    let window = table_after(&md, "### Causal window against dense causal attention");
    assert!(window[2].starts_with("| window (4095, 0) causal | 16,384 |") && window[3].starts_with("| dense causal |"));
    assert!(md.contains("Dense causal / window time: seq 16,384 5.00x."));
    // 8 ring cases of 4 ranks; the window rows show their bound, the dilated rows none.
    let ring = table_after(&md, "### Ring bytes per rank");
    assert_eq!(ring.len(), 2 + 32, "{ring:?}");
    assert!(
        ring.iter().filter(|r| r.starts_with("| window (4095, 0) causal, 8 K/V heads | contiguous |")).count() == 4
    );
    let bound = int(4095 * 8 * 2 * 64 * 4);
    assert!(ring.iter().any(|r| r.starts_with("| window (4095, 0) causal, 8 K/V heads | contiguous | 1 |")
        && r.ends_with(&format!("| {bound} |"))));
    assert!(ring.iter().any(|r| r.contains("1 of 8 heads | zigzag | 3 |") && r.ends_with("| - |")), "{ring:?}");
    assert!(
        md.contains(
            "Sent rows equal the counts on every rank; what each rank receives under a window stays within the bound."
        ),
        "{}",
        ring.join("\n")
    );
    assert!(md.contains("1 K/V heads against 8 (contiguous):"), "{md}");
    // Key findings.
    for line in [
        "- Grouped-query attention 8:1 at seq 16,384: peak 1.020x",
        "- Packed sequences under segments [2048, 4096, 8192], dilations [1, 2, 4], fwd: 2.00x",
        "- Packed sequences under dense (segment 4096), fwd: 2.00x",
        "- Causal window (4095, 0) at seq 16,384: 5.00x faster",
    ] {
        assert!(md.contains(line), "{line}");
    }

    // `--section features`: that section (and the run's header and cross-checks) alone.
    results.sections = vec!["features".into()];
    results.suite = "quick".into();
    results.measurements.retain(|m| m.section == crate::features::SECTION);
    results.capacity.clear();
    let dir2_tmp = temp_dir("features-only");
    let dir2 = dir2_tmp.path();
    write_report(dir2, &results, None, 10.0).unwrap();
    let md = std::fs::read_to_string(dir2.join("report.md")).unwrap();
    assert!(md.contains("## Attention features") && md.contains("--quick --section features`"), "{md}");
    for absent in ["## Single rank", "## Implementation comparison", "## Multihead", "## Sequence length", "## Plots"] {
        assert!(!md.contains(absent), "{absent} in\n{md}");
    }
    assert!(std::fs::read_dir(dir2).unwrap().all(|f| !f.unwrap().path().to_string_lossy().ends_with(".png")));
}

/// A results.json written before the feature fields existed still loads (and renders).
#[test]
fn results_without_the_feature_fields_still_load() {
    let _guard = TEST_WINDOW_LOCK.lock();
    let dir_tmp = temp_dir("old-results");
    let dir = dir_tmp.path();
    let path = dir.join("results.json");
    synthetic(Vec::new()).save(&path).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("sections");
    for m in json["measurements"].as_array_mut().unwrap() {
        let m = m.as_object_mut().unwrap();
        m.remove("data_bytes_sent");
        m.remove("data_messages");
        let spec = m.get_mut("spec").unwrap().as_object_mut().unwrap();
        for key in ["kv_heads", "repeat_kv", "window", "varlen"] {
            assert!(spec.remove(key).is_some(), "{key} not written");
        }
    }
    std::fs::write(&path, json.to_string()).unwrap();
    let old = RunResults::load(&path).unwrap();
    assert!(old.sections.is_empty() && old.includes("features") && old.includes("scaling"));
    assert!(old.measurements.iter().all(|m| !m.spec.uses_features() && m.data_bytes_sent.is_empty()));
    rerender(&path).unwrap();
    assert!(std::fs::read_to_string(dir.join("report.md")).unwrap().contains("## Single rank"));
}

/// A case whose status is `error: ...` fails the suite with its label and status (the
/// quick CI smoke run would otherwise pass with every case failed); skipped cases do not,
/// and `--allow-errors` passes it.
#[test]
fn a_failed_case_fails_the_suite_naming_it() {
    let good = ok("comparison", dilated(Implementation::Cpu, 8192), 100.0, 1.0);
    let mut skipped = Measurement::not_run(dilated(Implementation::Cuda, 8192), "skipped: no GPU".into(), GIT);
    skipped.section = "comparison".into();
    assert!(failures(&[good.clone(), skipped.clone()], false).is_ok());
    let mut bad = Measurement::not_run(dilated(Implementation::Cpu, 16384), "error: out of memory".into(), GIT);
    bad.section = "scaling".into();
    let all = [good, skipped, bad.clone()];
    let e = failures(&all, false).unwrap_err().to_string();
    assert!(e.contains(&bad.spec.label()) && e.contains("out of memory") && e.contains("1 of 3"), "{e}");
    assert!(failures(&all, true).is_ok());
    let parsed = crate::cli::parse(&["--quick".into(), "--allow-errors".into()]).unwrap();
    assert!(matches!(parsed, crate::cli::Command::Suite(o) if o.allow_errors));
    let parsed = crate::cli::parse(&["--quick".into()]).unwrap();
    assert!(matches!(parsed, crate::cli::Command::Suite(o) if !o.allow_errors));
}

/// Synthetic `--quick` block-sparse rows: forward at `f` of 100 ms, forward+backward at
/// `f` of 300 ms; ring rows sending exactly `expected_bytes` but for `off_by` bytes on
/// rank 0 of the 10% window.
fn block_measurements(off_by: u64) -> Vec<Measurement> {
    use attn_core::Pass;
    crate::blocks::cases(SuiteSize::Quick)
        .into_iter()
        .map(|(spec, _)| {
            let b = spec.block_sparse.unwrap();
            let ms = b.kept_percent as f64 * if spec.backward { 3.0 } else { 1.0 };
            let mut m = ok(crate::blocks::SECTION, spec, ms, 1.0);
            if m.spec.kind == CaseKind::Ring {
                let plan = attn_ring::Plan::new(crate::ring_runner::problem(&m.spec).unwrap()).unwrap();
                m.data_bytes_sent = attn_ring::expected_bytes(&plan, DType::F32, Pass::Forward);
                if b.kind == crate::block_sparse::SparseKind::LocalWindow && b.kept_percent == 10 {
                    m.data_bytes_sent[0] += off_by;
                }
            }
            m
        })
        .collect()
}

#[test]
fn the_blocks_section_reports_time_ratios_and_ring_bytes_against_the_formula_and_bound() {
    let _guard = TEST_WINDOW_LOCK.lock();
    let dir_tmp = temp_dir("blocks");
    let render = |off_by| {
        let results = synthetic(block_measurements(off_by));
        write_report(dir_tmp.path(), &results, None, 10.0).unwrap();
        std::fs::read_to_string(dir_tmp.path().join("report.md")).unwrap()
    };
    let md = render(0);
    let times = table_after(&md, "### Block-sparse attention");
    assert_eq!(times.len(), 2 + 10, "{times:?}");
    // 4096 positions: 32 blocks; random 10% keeps round(3.2) = 3 a row, the window of 3
    // blocks keeps 3 (2 at the edges): (32 * 3 - 2) / 1024 tiles.
    assert!(times.contains(&"| random | 10% | 0.094 | 10.0 | 0.10x | 30.0 | 0.10x |"), "{times:?}");
    assert!(times.contains(&"| random | 100% | 1.000 | 100.0 | 1.00x | 300.0 | 1.00x |"), "{times:?}");
    assert!(times.contains(&"| local_window | 10% | 0.092 | 10.0 | 0.10x | 30.0 | 0.10x |"), "{times:?}");
    assert!(md.contains("- Block-sparse forward at seq 4,096: 10% of the blocks kept takes 0.10x and 5% 0.05x"));
    let ring = table_after(&md, "### Ring bytes under local window masks");
    assert_eq!(ring.len(), 2 + 6, "{ring:?}");
    assert!(ring[2].starts_with("| all kept | 1.000 |") && ring[2].ends_with("| yes | 1.000 | 1.031 | yes |"));
    // Bytes follow the window's width (W / nb of the all-kept bytes), within f + 1/nb with
    // f the window's width; the kept tiles are fewer (the corners cut off at the ends).
    let within = |ring: &[&str]| -> Vec<String> {
        ring[2..].iter().map(|r| r.rsplit('|').nth(1).unwrap().trim().to_string()).collect()
    };
    assert_eq!(within(&ring), ["yes"; 6], "{ring:?}");
    assert!(
        ring.contains(&"| local_window 50% | 0.500 | 0.461 | 25,165,878 | 25,165,878 | yes | 0.500 | 0.531 | yes |")
    );
    assert!(ring[2..].iter().all(|r| r.contains("| yes | ")), "{ring:?}");
    // One byte more on one rank than the formula: that row says so.
    let md = render(1);
    let ring = table_after(&md, "### Ring bytes under local window masks");
    let row = ring.iter().find(|r| r.starts_with("| local_window 10% |")).unwrap();
    assert!(row.contains("| no |"), "{row}");
    // 16 MiB more on one rank: past the bound, and the row's last column says so.
    let md = render(1 << 24);
    let ring = table_after(&md, "### Ring bytes under local window masks");
    assert_eq!(within(&ring), ["yes", "yes", "no", "yes", "yes", "yes"], "{ring:?}");
}
