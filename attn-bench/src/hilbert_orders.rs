//! Hilbert order figures: generation time (1024x1024 grid, 128x128x64 volume) and
//! permutation throughput as a fraction of a plain copy, from `attn_hilbert::bench`.

use std::fmt::Write;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_and_section() {
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
}
