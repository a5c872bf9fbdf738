//! The "Attention features" part of `report.md`: grouped-query attention against K/V
//! repeated by the caller, packed against padded sequences, a causal window against
//! dense causal attention, and ring bytes per rank against their counts and the window
//! bound (`ring_bytes`). Built from the `features` measurements alone; a row whose case
//! did not run shows its status.

use std::fmt::Write;

use attn_core::Pass;
use attn_ring::{Plan, expected_bytes};

use crate::case::{CaseKind, CaseSpec, Measurement, VarLenLayout};
use crate::features::SECTION;
use crate::format::{int, mb};
use crate::ring_bytes::{self, RankBytes};
use crate::varlen_pairs::varlen_pairs;

/// The section's measurements.
fn rows(ms: &[Measurement]) -> Vec<&Measurement> {
    ms.iter().filter(|m| m.section == SECTION).collect()
}

fn is_gqa(s: &CaseSpec) -> bool {
    s.kind == CaseKind::Dilated && s.kv_heads.is_some_and(|k| k < s.heads) && s.varlen.is_none()
}

fn is_dense_causal(s: &CaseSpec) -> bool {
    s.kind == CaseKind::Dilated && s.window.is_none() && s.causal && s.segments == [s.seq_len] && s.dilations == [1]
}

fn is_window(s: &CaseSpec) -> bool {
    s.kind == CaseKind::Dilated && s.window.is_some() && s.varlen.is_none()
}

/// `a / b` as `1.23x`, or `n/a` when either did not run.
pub(crate) fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if a > 0.0 && b > 0.0 => format!("{:.2}x", a / b),
        _ => "n/a".into(),
    }
}

pub(crate) fn ok_ms(m: Option<&&Measurement>) -> Option<f64> {
    m.filter(|m| m.ok()).map(|m| m.median_ms)
}

fn ok_tok(m: Option<&&Measurement>) -> Option<f64> {
    m.filter(|m| m.ok()).map(|m| m.tokens_per_s)
}

/// Bytes of q, k, v and out at the sizes the caller holds them.
fn tensor_bytes(s: &CaseSpec) -> Option<u64> {
    let (shape, e) = (s.attn_shape().ok()?, s.dtype.size());
    Some(((2 * shape.q.numel() + 2 * shape.kv.numel()) * e) as u64)
}

/// Time, runs and peak cells of a timed row, or its status.
fn timed(m: &Measurement) -> String {
    if m.ok() {
        format!("{:.1} | {} | {:.1}", m.median_ms, m.runs, mb(m.peak_bytes))
    } else {
        format!("{} | | ", m.status)
    }
}

fn gqa(o: &mut String, ms: &[&Measurement]) {
    let grouped: Vec<&&Measurement> = ms.iter().filter(|m| is_gqa(&m.spec) && !m.spec.repeat_kv).collect();
    if grouped.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "\n### Grouped-query attention against repeated K/V\n\n\
         Query heads on fewer key/value heads, forward on `CpuBackend`, against the same problem with K/V repeated to \
         every query head by the caller in each call (`repeat_interleave` before a multi-head kernel: that row's time \
         and memory include the repeat). Peak: the counting allocator over the first call, inputs included. Tensors: q, \
         k, v and out at the sizes the caller holds them (k and v at their own head count); the target is a grouped \
         peak of at most 1.1x them (no repeated K/V inside the kernel). Library figure: tensors, LSE, the repeated \
         K/V where the caller repeats, and `CpuBackend::workspace_bytes`.\n\n\
         | Case | Seq | Time (ms) | Timed runs | Peak (MB) | q+k+v+out (MB) | Peak / q+k+v+out | Library figure (MB) |\n\
         |---|---|---|---|---|---|---|---|"
    );
    for g in grouped {
        let s = &g.spec;
        let rep = ms.iter().find(|m| m.spec.repeat_kv && CaseSpec { repeat_kv: false, ..m.spec.clone() } == *s);
        let tensors = tensor_bytes(s).unwrap_or(0);
        for (m, name) in [
            (Some(g), format!("{} heads on {} K/V head(s)", s.heads, s.kv_heads())),
            (rep, format!("K/V repeated to {} heads by the caller", s.heads)),
        ] {
            let Some(m) = m else { continue };
            let share =
                if m.ok() && tensors > 0 { format!("{:.3}", m.peak_bytes as f64 / tensors as f64) } else { "".into() };
            let lib = m.workspace_query_bytes.map_or("n/m".into(), |b| format!("{:.1}", mb(b)));
            let _ =
                writeln!(o, "| {name} | {} | {} | {:.1} | {share} | {lib} |", int(s.seq_len), timed(m), mb(tensors));
        }
        let peak = |m: Option<&&Measurement>| m.filter(|m| m.ok()).map(|m| m.peak_bytes as f64);
        let share = g.ok().then(|| g.peak_bytes as f64 / tensors as f64);
        let verdict = match share {
            Some(x) if x <= 1.1 => format!("{x:.3}, target <= 1.1 met"),
            Some(x) => format!("{x:.3}, target <= 1.1 missed"),
            None => "not measured".into(),
        };
        let (lse, lib) = match (s.attn_shape(), g.workspace_query_bytes) {
            (Ok(shape), Some(lib)) => {
                let lse = (shape.q.lse_len() * 4) as u64;
                (lse, lib.saturating_sub(tensors + lse))
            }
            _ => (0, 0),
        };
        let _ = writeln!(
            o,
            "\nGrouped peak / tensors: {verdict}; above the tensors: the LSE ({:.1} MB) and the kernel's workspace \
             ({:.1} MB by its query), {:.1} MB measured in all. Repeated / grouped: time {}, peak {}.",
            mb(lse),
            mb(lib),
            if g.ok() { mb(g.peak_bytes.saturating_sub(tensors)) } else { f64::NAN },
            ratio(ok_ms(rep), ok_ms(Some(g))),
            ratio(peak(rep), peak(Some(g))),
        );
    }
}

/// A packed row's attention: dense where one rate-1 segment covers every sequence.
fn varlen_attention(s: &CaseSpec, longest: usize) -> String {
    match (s.segments.as_slice(), s.dilations.as_slice()) {
        ([w], [1]) if *w >= longest => format!("dense (segment {w})"),
        (w, r) => format!("segments {w:?}, dilations {r:?}"),
    }
}

fn varlen(o: &mut String, ms: &[&Measurement]) {
    let packed: Vec<&&Measurement> =
        ms.iter().filter(|m| m.spec.varlen.as_ref().is_some_and(|v| v.layout == VarLenLayout::Packed)).collect();
    let Some((first, v)) = packed.first().and_then(|m| Some((m, m.spec.varlen.as_ref()?))) else { return };
    let s = &first.spec;
    let total: usize = v.lengths.iter().sum();
    let longest = v.lengths.iter().copied().max().unwrap_or(0);
    let positions = v.lengths.len() * longest;
    let _ = writeln!(
        o,
        "\n### Packed against padded sequences\n\n\
         {} sequences of lengths drawn uniformly from 1..={} with seed {}: {:?}, {} real tokens. Packed: one `[1, {}, {}, \
         {}]` row with `cu_seqlens`; padded: `[{}, {}, {}, {}]` ({} positions, {:.1}% padding) with a key padding mask. \
         {}{}. Tokens/s counts real tokens only, in both layouts. Positions / real tokens is {:.2}, but the kernels \
         leave padded keys out of every piece, so a segment holding only padding costs nothing: the padded row pays \
         for its padding only where it shares a segment with real tokens. Under dense attention every padded query \
         shares its one segment with all the real keys of its row.\n\n\
         | Attention | Pass | Layout | Time (ms) | Timed runs | Peak (MB) | Real tokens/s |\n|---|---|---|---|---|---|---|",
        v.lengths.len(),
        v.max_len,
        v.seed,
        v.lengths,
        int(total),
        total,
        s.heads,
        s.head_dim,
        v.lengths.len(),
        longest,
        s.heads,
        s.head_dim,
        int(positions),
        100.0 * (positions - total) as f64 / positions.max(1) as f64,
        if s.causal { "Causal, " } else { "" },
        s.dtype.as_str(),
        positions as f64 / total.max(1) as f64,
    );
    // One summary line per attention config, in the order the rows ran.
    let mut summaries: Vec<(String, Vec<String>, &CaseSpec)> = Vec::new();
    for p in &packed {
        let padded = padded_of(ms, p);
        let pass = if p.spec.backward { "fwd+bwd" } else { "fwd" };
        let attention = varlen_attention(&p.spec, longest);
        for (m, layout) in [(Some(**p), "packed (`cu_seqlens`)"), (padded, "padded + key padding mask")] {
            let Some(m) = m else { continue };
            let tok = if m.ok() { int(m.tokens_per_s as usize) } else { String::new() };
            let _ = writeln!(o, "| {attention} | {pass} | {layout} | {} | {tok} |", timed(m));
        }
        let r = format!("{pass} {}", ratio(ok_tok(Some(p)), padded.filter(|m| m.ok()).map(|m| m.tokens_per_s)));
        match summaries.iter_mut().find(|(a, _, _)| *a == attention) {
            Some((_, ratios, _)) => ratios.push(r),
            None => summaries.push((attention, vec![r], &p.spec)),
        }
    }
    let _ = writeln!(
        o,
        "\nPacked / padded real tokens/s (target >= 1.5x), and the attended (query, key) pairs padded / packed: the \
         speed-up of packing for a kernel whose time follows the attended pairs.\n"
    );
    for (attention, ratios, spec) in summaries {
        let pairs = spec.config().ok().and_then(|cfg| varlen_pairs(&cfg, spec.heads, &v.lengths));
        let pairs = pairs.map_or("not counted".into(), |c| {
            format!("{:.3} ({} / {})", c.ratio(), int(c.padded as usize), int(c.packed as usize))
        });
        let _ = writeln!(o, "- {attention}: {}; pairs {pairs}.", ratios.join(", "));
    }
}

/// The padded measurement of a packed one's sequences and config.
fn padded_of<'a>(ms: &[&'a Measurement], packed: &Measurement) -> Option<&'a Measurement> {
    let v = packed.spec.varlen.as_ref()?;
    let want = CaseSpec::varlen(&packed.spec, (v.seed, v.max_len), &v.lengths, VarLenLayout::Padded);
    ms.iter().copied().find(|m| m.spec == want)
}

fn window(o: &mut String, ms: &[&Measurement]) {
    let windows: Vec<&&Measurement> = ms.iter().filter(|m| is_window(&m.spec)).collect();
    if windows.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "\n### Causal window against dense causal attention\n\n\
         Forward on `CpuBackend`, {} heads, head_dim {}, {}; dense causal is one segment of the whole sequence at \
         rate 1. Timed runs follow the first (memory) call; a case whose first call takes over half the time budget \
         gets one. GFLOP/s: 4 d per (query, key) pair a window admits, halved n^2 for dense causal.\n\n\
         | Case | Seq | Time (ms) | Timed runs | Peak (MB) | GFLOP/s |\n|---|---|---|---|---|---|",
        windows[0].spec.heads,
        windows[0].spec.head_dim,
        windows[0].spec.dtype.as_str()
    );
    let mut ratios = Vec::new();
    for w in windows {
        let [left, right] = w.spec.window.unwrap_or([0, 0]);
        let dense = ms.iter().find(|m| {
            is_dense_causal(&m.spec)
                && (m.spec.seq_len, m.spec.heads, m.spec.head_dim, m.spec.dtype, m.spec.backward)
                    == (w.spec.seq_len, w.spec.heads, w.spec.head_dim, w.spec.dtype, w.spec.backward)
        });
        let causal = if w.spec.causal { " causal" } else { "" };
        for (m, name) in [(Some(w), format!("window ({left}, {right}){causal}")), (dense, "dense causal".to_string())] {
            let Some(m) = m else { continue };
            let rate = if m.ok() { format!("{:.1}", m.gflop_per_s) } else { String::new() };
            let _ = writeln!(o, "| {name} | {} | {} | {rate} |", int(m.spec.seq_len), timed(m));
        }
        ratios.push(format!("seq {} {}", int(w.spec.seq_len), ratio(ok_ms(dense), ok_ms(Some(w)))));
    }
    let _ = writeln!(o, "\nDense causal / window time: {}.", ratios.join(", "));
}

/// What a ring row's spec predicts: the counts, the window bound and `expected_bytes`.
struct Predicted {
    counted: RankBytes,
    bound: Option<Vec<u64>>,
    expected: Option<Vec<u64>>,
}

fn predicted(s: &CaseSpec) -> Option<Predicted> {
    let problem = crate::ring_runner::problem(s).ok()?;
    let dtype = s.dtype;
    let expected = Plan::new(problem.clone()).ok().map(|p| expected_bytes(&p, dtype, Pass::Forward));
    Some(Predicted {
        counted: ring_bytes::counted(&problem, dtype),
        bound: ring_bytes::window_bound(&problem, dtype),
        expected,
    })
}

fn ring_case_name(s: &CaseSpec) -> String {
    match s.window {
        Some([l, r]) => {
            format!("window ({l}, {r}){}, {} K/V heads", if s.causal { " causal" } else { "" }, s.kv_heads())
        }
        None => format!(
            "segments {:?} rates {:?}{}, {} of {} heads",
            s.segments,
            s.dilations,
            if s.causal { " causal" } else { "" },
            s.kv_heads(),
            s.heads
        ),
    }
}

fn ring(o: &mut String, ms: &[&Measurement]) {
    let ring: Vec<&&Measurement> = ms.iter().filter(|m| m.spec.kind == CaseKind::Ring).collect();
    let Some(first) = ring.first() else { return };
    let s = &first.spec;
    let _ = writeln!(
        o,
        "\n### Ring bytes per rank\n\n\
         {} in-process ranks, strategy {}, seq {}, batch {}, head_dim {}, {}, one forward call each. Data bytes: \
         `RingStats::data_bytes_sent` (what `attn_ring::expected_bytes` predicts), 9 header bytes per message \
         included; sent rows: the data bytes less the headers, i.e. the k and v rows sent. Counted: `ring_bytes`, the \
         rows sharing a segment with and within reach of another rank's queries, once per (pattern, K/V head). Window \
         bound: (left + right) rows (right = 0 when causal) per contiguous chunk a rank holds (1 contiguous, 2 \
         zigzag) x K/V heads x batch x 2 (k, v) x head_dim x element size, whatever the sequence length, on what a rank \
         receives (a rank may send more when chunks are shorter than the window: each later chunk within reach reads \
         its rows).\n\n\
         | Case | Layout | Rank | Data bytes | expected_bytes | Rows sent (B) | Counted sent (B) | Counted received (B) | Window bound (B) |\n\
         |---|---|---|---|---|---|---|---|---|",
        s.world_size,
        s.strategy.unwrap_or_default().as_str(),
        int(s.seq_len),
        s.batch,
        s.head_dim,
        s.dtype.as_str()
    );
    let (mut all_equal, mut all_within) = (true, true);
    for m in &ring {
        let s = &m.spec;
        let (name, layout) = (ring_case_name(s), s.layout.unwrap_or_default().as_str());
        let pred = predicted(s);
        if !m.ok() || m.data_bytes_sent.len() != s.world_size {
            let _ = writeln!(o, "| {name} | {layout} | | {} | | | | | |", m.status);
            all_equal = false;
            continue;
        }
        for r in 0..s.world_size {
            let sent = m.data_bytes_sent[r] - 9 * m.data_messages.get(r).copied().unwrap_or(0);
            let cell = |v: Option<u64>| v.map_or("n/a".to_string(), |b| int(b as usize));
            let counted_sent = pred.as_ref().map(|p| p.counted.sent[r]);
            let bound = pred.as_ref().and_then(|p| p.bound.as_ref()).map(|b| b[r]);
            all_equal &= counted_sent == Some(sent);
            if let Some(b) = bound {
                all_within &= pred.as_ref().is_some_and(|p| p.counted.received[r] <= b);
            }
            let _ = writeln!(
                o,
                "| {name} | {layout} | {r} | {} | {} | {} | {} | {} | {} |",
                int(m.data_bytes_sent[r] as usize),
                cell(pred.as_ref().and_then(|p| p.expected.as_ref()).map(|e| e[r])),
                int(sent as usize),
                cell(counted_sent),
                cell(pred.as_ref().map(|p| p.counted.received[r])),
                bound.map_or("-".to_string(), |b| int(b as usize)),
            );
        }
    }
    let _ = writeln!(
        o,
        "\nSent rows {} the counts on every rank; what each rank receives under a window {} the bound.",
        if all_equal { "equal" } else { "do not all equal" },
        if all_within { "stays within" } else { "does not always stay within" }
    );
    // Grouped against full key/value heads: the same problem's bytes, pair by pair.
    for g in ring.iter().filter(|m| m.spec.window.is_none() && m.spec.kv_heads() < m.spec.heads) {
        let full = ring.iter().find(|m| {
            CaseSpec { kv_heads: g.spec.kv_heads, ..m.spec.clone() } == g.spec && m.spec.kv_heads() == m.spec.heads
        });
        let total = |m: &Measurement| -> Option<f64> {
            m.ok().then(|| m.data_bytes_sent.iter().zip(&m.data_messages).map(|(b, n)| b - 9 * n).sum::<u64>() as f64)
        };
        let counted = |m: &Measurement| predicted(&m.spec).map(|p| p.counted.sent.iter().sum::<u64>() as f64);
        if let Some(f) = full {
            let _ = writeln!(
                o,
                "\n{} K/V heads against {} ({}): {} fewer k/v bytes measured, {} counted.",
                g.spec.kv_heads(),
                f.spec.kv_heads(),
                g.spec.layout.unwrap_or_default().as_str(),
                ratio(total(f), total(g)),
                ratio(counted(f), counted(g)),
            );
        }
    }
}

/// The section (nothing when no `features` case was measured).
pub fn render(o: &mut String, measurements: &[Measurement]) {
    let ms = rows(measurements);
    if ms.is_empty() {
        return;
    }
    let _ = writeln!(o, "\n## Attention features");
    gqa(o, &ms);
    varlen(o, &ms);
    window(o, &ms);
    ring(o, &ms);
}

/// One line per row kind for the report's key findings.
pub fn findings(measurements: &[Measurement]) -> Vec<String> {
    let ms = rows(measurements);
    let mut out = Vec::new();
    if let Some(g) = ms.iter().find(|m| is_gqa(&m.spec) && !m.spec.repeat_kv && m.ok()) {
        let rep = ms.iter().find(|m| m.spec.repeat_kv && CaseSpec { repeat_kv: false, ..m.spec.clone() } == g.spec);
        let share = g.peak_bytes as f64 / tensor_bytes(&g.spec).unwrap_or(1) as f64;
        out.push(format!(
            "Grouped-query attention {}:{} at seq {}: peak {share:.3}x its q, k, v and out; K/V repeated by the caller \
             takes {} the time and {} the memory",
            g.spec.heads,
            g.spec.kv_heads(),
            int(g.spec.seq_len),
            ratio(ok_ms(rep), Some(g.median_ms)),
            ratio(rep.filter(|m| m.ok()).map(|m| m.peak_bytes as f64), Some(g.peak_bytes as f64)),
        ));
    }
    for p in ms.iter().filter(|m| m.ok() && m.spec.varlen.as_ref().is_some_and(|v| v.layout == VarLenLayout::Packed)) {
        let padded = padded_of(&ms, p);
        let longest = p.spec.varlen.as_ref().and_then(|v| v.lengths.iter().copied().max()).unwrap_or(0);
        out.push(format!(
            "Packed sequences under {}, {}: {} the real tokens/s of the same sequences padded",
            varlen_attention(&p.spec, longest),
            if p.spec.backward { "fwd+bwd" } else { "fwd" },
            ratio(Some(p.tokens_per_s), padded.filter(|m| m.ok()).map(|m| m.tokens_per_s))
        ));
    }
    if let Some(w) = ms.iter().find(|m| is_window(&m.spec) && m.ok()) {
        let dense = ms.iter().find(|m| is_dense_causal(&m.spec) && m.spec.seq_len == w.spec.seq_len);
        let [l, r] = w.spec.window.unwrap_or([0, 0]);
        out.push(format!(
            "Causal window ({l}, {r}) at seq {}: {} faster than dense causal",
            int(w.spec.seq_len),
            ratio(ok_ms(dense), Some(w.median_ms))
        ));
    }
    out
}
