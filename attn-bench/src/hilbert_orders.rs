//! Hilbert order figures: generation time (1024x1024 grid, 128x128x64 volume) and
//! permutation throughput as a fraction of a plain copy, from `attn_hilbert::bench`;
//! the locality table of each order; and the report of `--case hilbert` (no `--json`).

use std::fmt::Write;

use attn_core::{AttnError, Result};
use attn_hilbert::{Grid, OrderKind, TokenOrder, locality};
use serde::{Deserialize, Serialize};

/// The issue-6 figures, in milliseconds and fractions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HilbertOrders {
    pub generate_1024x1024_ms: f64,
    pub generate_128x128x64_ms: f64,
    /// Bytes of the permuted tensor (`[1, 128*128, 512]` f32).
    pub tensor_bytes: usize,
    pub copy_ms: f64,
    pub apply_ms: f64,
    pub unapply_ms: f64,
    pub in_place_ms: f64,
}

impl HilbertOrders {
    /// Measure with `reps` repetitions (best of each); `None` with the reason printed on failure.
    pub fn measure(reps: usize) -> Option<Self> {
        match attn_hilbert::bench::standard_report(reps) {
            Ok(r) => Some(HilbertOrders {
                generate_1024x1024_ms: r.generate_2d_s * 1e3,
                generate_128x128x64_ms: r.generate_3d_s * 1e3,
                tensor_bytes: r.permute.bytes,
                copy_ms: r.permute.copy_s * 1e3,
                apply_ms: r.permute.apply_s * 1e3,
                unapply_ms: r.permute.unapply_s * 1e3,
                in_place_ms: r.permute.in_place_s * 1e3,
            }),
            Err(e) => {
                eprintln!("attn-bench: hilbert orders not measured: {e}");
                None
            }
        }
    }

    /// Permutation throughput as a fraction of a plain copy (1.0 = copy speed).
    pub fn fraction_of_copy(&self, ms: f64) -> f64 {
        if ms > 0.0 { self.copy_ms / ms } else { 0.0 }
    }

    /// The JSON object printed by `--json --case hilbert` (next to the attention timing).
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "generate_1024x1024_ms": self.generate_1024x1024_ms,
            "generate_128x128x64_ms": self.generate_128x128x64_ms,
            "tensor_bytes": self.tensor_bytes,
            "apply_fraction_of_copy": self.fraction_of_copy(self.apply_ms),
            "unapply_fraction_of_copy": self.fraction_of_copy(self.unapply_ms),
            "in_place_fraction_of_copy": self.fraction_of_copy(self.in_place_ms),
        })
    }

    /// The report section.
    pub fn render(&self, o: &mut String) {
        let _ = writeln!(
            o,
            "\n## Hilbert orders\n\nUncached generation (order, inverse and validation): 1024x1024 grid {:.1} ms, \
             128x128x64 volume {:.1} ms. Permuting a [1, 16384, 512] f32 tensor ({:.0} MiB) by the 128x128 Hilbert order, \
             as a fraction of a plain copy of the same tensor ({:.2} ms):\n\n| Operation | Time (ms) | Fraction of copy |\n|---|---|---|",
            self.generate_1024x1024_ms,
            self.generate_128x128x64_ms,
            self.tensor_bytes as f64 / (1u64 << 20) as f64,
            self.copy_ms
        );
        for (name, ms) in [
            ("apply (out of place)", self.apply_ms),
            ("unapply (out of place)", self.unapply_ms),
            ("in place", self.in_place_ms),
        ] {
            let _ = writeln!(o, "| {name} | {ms:.2} | {:.2} |", self.fraction_of_copy(ms));
        }
    }
}

/// One row of the locality table: a grid and segment length, then per order (in
/// `OrderKind::ALL` order) its name, neighbour-in-segment fraction and mean segment diameter.
#[derive(Debug, Clone)]
pub struct LocalityRow {
    pub grid: String,
    pub segment: usize,
    pub orders: Vec<(&'static str, f64, f64)>,
}

/// Locality of every order on the grids of `attn-hilbert`'s locality tests and example.
pub fn locality_table() -> Result<Vec<LocalityRow>> {
    let (g2, g3) = (Grid::new_2d, Grid::new_3d);
    let cases = [
        (g2(64, 64)?, 64),
        (g2(64, 64)?, 256),
        (g2(96, 80)?, 64),
        (g2(96, 80)?, 256),
        (g2(17, 31)?, 64),
        (g2(17, 31)?, 256),
        (g3(9, 17, 31)?, 64),
        (g3(9, 17, 31)?, 512),
        (g3(64, 128, 128)?, 4096),
    ];
    cases
        .iter()
        .map(|&(grid, segment)| {
            let orders = OrderKind::ALL
                .iter()
                .map(|&kind| {
                    let m = locality(&TokenOrder::new(kind, grid)?, segment)?;
                    Ok((kind.as_str(), m.neighbour_in_segment, m.mean_segment_diameter))
                })
                .collect::<Result<_>>()?;
            Ok(LocalityRow { grid: grid.to_string(), segment, orders })
        })
        .collect()
}

/// The locality section: one row per grid and segment length, one column per order.
pub fn render_locality(rows: &[LocalityRow], o: &mut String) {
    let names: Vec<&str> = OrderKind::ALL.iter().map(|k| k.as_str()).collect();
    let _ = writeln!(
        o,
        "\n## Locality\n\nPer order: neighbour-in-segment fraction (higher is better) / mean segment \
         diameter in cells (lower is better).\n\n| Grid | Segment | {} |\n|---|---|{}",
        names.join(" | "),
        "---|".repeat(names.len())
    );
    for r in rows {
        let cells: Vec<String> = r.orders.iter().map(|(_, n, d)| format!("{n:.3} / {d:.1}")).collect();
        let _ = writeln!(o, "| {} | {} | {} |", r.grid, r.segment, cells.join(" | "));
    }
}

/// The markdown report of `attn-bench --case hilbert` (no `--json`): generation and
/// permutation figures (best of `reps`), then the locality table.
pub fn report(reps: usize) -> Result<String> {
    let h = HilbertOrders::measure(reps)
        .ok_or_else(|| AttnError::InvalidArgument("Hilbert orders could not be measured".into()))?;
    let mut o = String::from("# attn-bench --case hilbert\n");
    h.render(&mut o);
    render_locality(&locality_table()?, &mut o);
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_and_section() {
        // Allocates and frees megabytes: kept out of the measuring tests' windows, whose
        // process-wide live-byte figures another thread's frees would lower.
        let _guard = crate::memory::TEST_WINDOW_LOCK.lock();
        let h = HilbertOrders {
            generate_1024x1024_ms: 12.0,
            generate_128x128x64_ms: 13.0,
            tensor_bytes: 32 << 20,
            copy_ms: 4.0,
            apply_ms: 8.0,
            unapply_ms: 5.0,
            in_place_ms: 0.0,
        };
        assert_eq!(h.fraction_of_copy(8.0), 0.5);
        assert_eq!(h.fraction_of_copy(0.0), 0.0);
        assert_eq!(h.json()["apply_fraction_of_copy"], 0.5);
        let mut s = String::new();
        h.render(&mut s);
        assert!(s.contains("## Hilbert orders") && s.contains("| apply (out of place) | 8.00 | 0.50 |"), "{s}");
    }

    #[test]
    fn locality_table_has_every_order_and_hilbert_wins_on_17x31() {
        // Allocates and frees megabytes: kept out of the measuring tests' windows, whose
        // process-wide live-byte figures another thread's frees would lower.
        let _guard = crate::memory::TEST_WINDOW_LOCK.lock();
        let rows = locality_table().unwrap();
        assert_eq!(rows.len(), 9);
        let r = rows.iter().find(|r| r.grid == "17x31" && r.segment == 64).unwrap();
        let names: Vec<&str> = r.orders.iter().map(|o| o.0).collect();
        assert_eq!(names, ["row_major", "z_order", "hilbert"]);
        assert!(r.orders[2].1 > r.orders[0].1 && r.orders[2].1 > r.orders[1].1, "{r:?}");
        let mut s = String::new();
        render_locality(&rows, &mut s);
        assert!(s.contains("| Grid | Segment | row_major | z_order | hilbert |\n|---|---|---|---|---|\n"), "{s}");
        assert!(s.contains("| 64x128x128 | 4096 | "), "{s}");
    }
}
