//! The report's plots (PNG and SVG, with `plotters`): memory vs sequence per world
//! size (log-log), memory reduction vs world size, throughput vs sequence per
//! implementation, memory per token, and the ring-size sweep.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use attn_ring::Layout;

use crate::case::SEGMENTS;
use crate::case::{CaseKind, Measurement};

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// A line chart with optional log axes.
#[derive(Debug, Clone)]
pub struct Chart {
    pub file_stem: String,
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log_x: bool,
    pub log_y: bool,
    /// Legend in the lower right corner instead of the upper left.
    pub legend_lower_right: bool,
    pub series: Vec<Series>,
}

fn range(vals: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (lo, hi) = vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
    if !lo.is_finite() {
        return (1.0, 10.0);
    }
    if log { (lo / 1.5, hi * 1.5) } else { (0.0f64.min(lo), if hi > lo { hi * 1.1 } else { lo + 1.0 }) }
}

/// Tick label for log axes: only 1, 2 and 5 times a power of ten are labelled
/// (short SI form), so labels never run into each other.
fn tick(x: f64) -> String {
    if !(x.is_finite() && x > 0.0) {
        return String::new();
    }
    let e = 10f64.powf(x.log10().floor());
    let m = (x / e).round();
    if !(m == 1.0 || m == 2.0 || m == 5.0) || ((x / e) - m).abs() > 0.01 {
        return String::new();
    }
    match x {
        x if x >= 1e6 => format!("{}M", x / 1e6),
        x if x >= 1e3 => format!("{}K", x / 1e3),
        x if x >= 1.0 => format!("{x}"),
        x => format!("{x:.2}"),
    }
}

fn linear_tick(x: f64) -> String {
    if x.abs() >= 1e3 { format!("{:.0}K", x / 1e3) } else { format!("{x:.1}") }
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, c: &Chart) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let pts = || c.series.iter().flat_map(|s| s.points.iter().copied());
    let (x0, x1) = range(pts().map(|p| p.0), c.log_x);
    let (y0, y1) = range(pts().map(|p| p.1), c.log_y);
    let mut b = ChartBuilder::on(&root);
    b.caption(&c.title, ("sans-serif", 22)).margin(12).x_label_area_size(42).y_label_area_size(70);
    // Four coordinate combinations have four types; one macro body draws them all.
    macro_rules! body {
        ($chart:expr) => {{
            let mut chart = $chart.map_err(err)?;
            let (fx, fy): (fn(f64) -> String, fn(f64) -> String) =
                (if c.log_x { tick } else { linear_tick }, if c.log_y { tick } else { linear_tick });
            chart
                .configure_mesh()
                .x_desc(&c.x_label)
                .y_desc(&c.y_label)
                .x_label_formatter(&|x| fx(*x))
                .y_label_formatter(&|y| fy(*y))
                .draw()
                .map_err(err)?;
            for (i, s) in c.series.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                chart
                    .draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))
                    .map_err(err)?
                    .label(&s.name)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
                chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(err)?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(if c.legend_lower_right {
                    SeriesLabelPosition::LowerRight
                } else {
                    SeriesLabelPosition::UpperLeft
                })
                .draw()
                .map_err(err)?;
        }};
    }
    match (c.log_x, c.log_y) {
        (true, true) => body!(b.build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())),
        (true, false) => body!(b.build_cartesian_2d((x0..x1).log_scale(), y0..y1)),
        (false, true) => body!(b.build_cartesian_2d(x0..x1, (y0..y1).log_scale())),
        (false, false) => body!(b.build_cartesian_2d(x0..x1, y0..y1)),
    }
    root.present().map_err(err)
}

/// Render `chart` as `<dir>/<stem>.png` and `.svg`; returns the file names written.
pub fn render(dir: &Path, chart: &Chart) -> Result<Vec<String>, String> {
    if chart.series.iter().all(|s| s.points.is_empty()) {
        return Ok(Vec::new());
    }
    let png = format!("{}.png", chart.file_stem);
    let svg = format!("{}.svg", chart.file_stem);
    draw(BitMapBackend::new(&dir.join(&png), (900, 600)).into_drawing_area(), chart)?;
    draw(SVGBackend::new(&dir.join(&svg), (900, 600)).into_drawing_area(), chart)?;
    Ok(vec![png, svg])
}

fn by_world(ms: &[&Measurement], y: impl Fn(&Measurement) -> f64) -> Vec<Series> {
    let mut map: BTreeMap<usize, Vec<(f64, f64)>> = BTreeMap::new();
    for m in ms {
        map.entry(m.spec.world_size).or_default().push((m.spec.seq_len as f64, y(m)));
    }
    map.into_iter()
        .map(|(p, mut pts)| {
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series { name: format!("ring, {p} rank{}", if p == 1 { "" } else { "s" }), points: pts }
        })
        .collect()
}

/// The throughput chart's line for a measurement: implementation, world size and
/// layout for the ring, and the segments where they differ from the scaling config.
fn throughput_line(m: &Measurement) -> String {
    let mut name = m.spec.implementation.to_string();
    if m.spec.kind == CaseKind::Ring {
        name = format!("{name} P={}", m.spec.world_size);
        if let Some(l) = m.spec.layout.filter(|l| *l != Layout::Contiguous) {
            name = format!("{name} {}", l.as_str());
        }
    }
    if m.spec.segments != SEGMENTS {
        let segs: Vec<String> = m.spec.segments.iter().map(usize::to_string).collect();
        name = format!("{name} (w {})", segs.join(","));
    }
    name
}

/// The five standard charts from the scaling measurements.
///
/// `single`: CpuBackend on one rank; `scaling`: the ring at every world size;
/// `throughput`: ok measurements per implementation; `sweep`: the ring-size sweep.
pub fn standard(
    single: &[&Measurement],
    scaling: &[&Measurement],
    throughput: &[&Measurement],
    sweep: &[&Measurement],
) -> Vec<Chart> {
    let mb = |m: &Measurement| m.peak_bytes_per_rank as f64 / 1048576.0;
    let cpu_line = |y: &dyn Fn(&Measurement) -> f64| {
        let mut pts: Vec<(f64, f64)> = single.iter().map(|m| (m.spec.seq_len as f64, y(m))).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        Series { name: "CpuBackend, 1 rank".into(), points: pts }
    };
    let mut mem_series = by_world(scaling, mb);
    mem_series.push(cpu_line(&mb));
    let mut kb_series = by_world(scaling, Measurement::kb_per_token);
    kb_series.push(cpu_line(&Measurement::kb_per_token));
    let mut charts = vec![Chart {
        file_stem: "memory_vs_seq".into(),
        title: "Peak memory per rank vs sequence length".into(),
        x_label: "sequence length (tokens)".into(),
        y_label: "peak MB per rank".into(),
        log_x: true,
        log_y: true,
        legend_lower_right: false,
        series: mem_series,
    }];
    // Reduction factor vs world size: one line per sequence length.
    let mut red: BTreeMap<usize, Vec<(f64, f64)>> = BTreeMap::new();
    for m in scaling {
        let one = scaling.iter().find(|o| o.spec.world_size == 1 && o.spec.seq_len == m.spec.seq_len);
        if let Some(one) = one.filter(|o| o.peak_bytes_per_rank > 0) {
            red.entry(m.spec.seq_len)
                .or_default()
                .push((m.spec.world_size as f64, one.peak_bytes_per_rank as f64 / m.peak_bytes_per_rank as f64));
        }
    }
    let mut series: Vec<Series> = red
        .into_iter()
        .map(|(n, mut p)| {
            p.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series { name: format!("seq {n}"), points: p }
        })
        .collect();
    let have_data = !series.is_empty();
    let max_p = scaling.iter().map(|m| m.spec.world_size).max().unwrap_or(1);
    let ideal = (0..).map(|i| 1usize << i).take_while(|&p| p <= max_p).map(|p| (p as f64, p as f64)).collect();
    if have_data {
        series.push(Series { name: "ideal (P)".into(), points: ideal });
    }
    charts.push(Chart {
        file_stem: "memory_reduction".into(),
        title: "Memory reduction factor vs world size".into(),
        x_label: "world size (ranks)".into(),
        y_label: "1-rank peak / per-rank peak".into(),
        log_x: true,
        log_y: true,
        legend_lower_right: false,
        series,
    });
    let mut by_impl: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for m in throughput {
        by_impl.entry(throughput_line(m)).or_default().push((m.spec.seq_len as f64, m.tokens_per_s));
    }
    charts.push(Chart {
        file_stem: "throughput_vs_seq".into(),
        title: "Throughput vs sequence length".into(),
        x_label: "sequence length (tokens)".into(),
        y_label: "tokens / s".into(),
        log_x: true,
        log_y: true,
        legend_lower_right: true,
        series: by_impl
            .into_iter()
            .map(|(name, mut p)| {
                // A case measured in two sections (scaling and comparison) is one point.
                p.sort_by(|a, b| a.0.total_cmp(&b.0));
                p.dedup_by(|a, b| a.0 == b.0);
                Series { name, points: p }
            })
            .collect(),
    });
    charts.push(Chart {
        file_stem: "memory_per_token".into(),
        title: "Peak memory per token (per rank)".into(),
        x_label: "sequence length (tokens)".into(),
        y_label: "KB per token".into(),
        log_x: true,
        log_y: false,
        legend_lower_right: false,
        series: kb_series,
    });
    let mut sw: Vec<&&Measurement> = sweep.iter().collect();
    sw.sort_by_key(|m| m.spec.world_size);
    let seq = sw.first().map_or(0, |m| m.spec.seq_len);
    charts.push(Chart {
        file_stem: "ring_size_sweep".into(),
        title: format!("Ring-size sweep at seq {seq}: per-rank peak MB and time"),
        x_label: "world size (ranks)".into(),
        y_label: "MB per rank / ms".into(),
        log_x: true,
        log_y: true,
        legend_lower_right: false,
        series: vec![
            Series {
                name: "peak MB per rank".into(),
                points: sw.iter().map(|m| (m.spec.world_size as f64, mb(m))).collect(),
            },
            Series {
                name: "time (ms)".into(),
                points: sw.iter().map(|m| (m.spec.world_size as f64, m.median_ms)).collect(),
            },
        ],
    });
    charts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::Implementation;
    use attn_ring::Strategy;

    #[test]
    fn log_ticks_label_only_one_two_five() {
        assert_eq!(tick(1000.0), "1K");
        assert_eq!(tick(20_000.0), "20K");
        assert_eq!(tick(5e6), "5M");
        assert_eq!(tick(3000.0), "");
        assert_eq!(tick(0.0), "");
    }

    #[test]
    fn throughput_lines_separate_implementations_layouts_and_configs() {
        // Allocates and frees megabytes: kept out of the measuring tests' windows, whose
        // process-wide live-byte figures another thread's frees would lower.
        let _guard = crate::memory::TEST_WINDOW_LOCK.lock();
        use crate::case::CaseSpec;
        let m = |spec: CaseSpec| Measurement::not_run(spec, "ok".into(), "t");
        let cpu = CaseSpec::dilated(Implementation::Cpu, 8192, &SEGMENTS, &[1, 2, 4]);
        assert_eq!(throughput_line(&m(cpu.clone())), "cpu");
        let zig = crate::case::ring_case(&cpu, 4, Strategy::Ring, Layout::Zigzag);
        assert_eq!(throughput_line(&m(zig)), "ring-ring P=4 zigzag");
        let small = CaseSpec::dilated(Implementation::Reference, 2048, &[512, 1024, 2048], &[1, 2, 4]);
        assert_eq!(throughput_line(&m(small)), "reference (w 512,1024,2048)");
        // The same case from two sections is one point of one line.
        let mut a = m(cpu.clone());
        a.tokens_per_s = 10.0;
        let mut b = m(cpu);
        b.tokens_per_s = 12.0;
        let charts = standard(&[], &[], &[&a, &b], &[]);
        let t = charts.iter().find(|c| c.file_stem == "throughput_vs_seq").unwrap();
        assert_eq!(t.series.len(), 1);
        assert_eq!(t.series[0].points, vec![(8192.0, 10.0)]);
    }

    #[test]
    fn renders_png_and_svg_with_log_axes() {
        // Allocates and frees megabytes: kept out of the measuring tests' windows, whose
        // process-wide live-byte figures another thread's frees would lower.
        let _guard = crate::memory::TEST_WINDOW_LOCK.lock();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let chart = Chart {
            file_stem: "t".into(),
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            log_x: true,
            log_y: true,
            legend_lower_right: false,
            series: vec![Series { name: "a".into(), points: vec![(2048.0, 10.0), (65536.0, 320.0)] }],
        };
        let files = render(dir, &chart).unwrap();
        assert_eq!(files, vec!["t.png".to_string(), "t.svg".to_string()]);
        for f in files {
            assert!(std::fs::metadata(dir.join(f)).unwrap().len() > 1000);
        }
        let empty = Chart { series: vec![], ..chart };
        assert!(render(dir, &empty).unwrap().is_empty());
    }
}
