//! `results.json`: every measurement with its config, the machine, rustc and git commit.

use std::path::Path;

use attn_core::{AttnError, Result};
use serde::{Deserialize, Serialize};

use crate::capacity::CapacityRow;
use crate::case::Measurement;
use crate::gemm_rate::GemmRate;
use crate::hilbert_orders::HilbertOrders;
use crate::machine::Machine;

/// How memory was measured; written into every results file and report.
pub const MEMORY_METHOD: &str = "Peak heap bytes from a counting global allocator in the bench binary: \
the highest number of bytes live during a case minus those live before its inputs were allocated \
(inputs + outputs + workspace). Per rank (in-process ring ranks are threads): every allocation records \
its thread, frees are charged back to it, and a rank's figure is its thread's peak of allocated-not-freed \
bytes. Cross-check: growth of the process peak RSS over the same window (VmHWM, reset per case through \
/proc/self/clear_refs, minus VmRSS at the window's start, after malloc_trim), compared with the allocator \
peak by the rule of the memory cross-check section (`rss_check` per measurement). CUDA cases also report \
the device memory held at the end of their first call (cuMemGetInfo).";

/// One whole run of the suite.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResults {
    pub suite: String,
    pub threads: usize,
    pub machine: Machine,
    pub gemm: GemmRate,
    pub memory_method: String,
    pub budget_bytes: u64,
    pub measurements: Vec<Measurement>,
    pub capacity: Vec<CapacityRow>,
    /// Wall-clock seconds the suite took.
    #[serde(default)]
    pub took_s: f64,
    /// Hilbert order generation and permutation figures.
    #[serde(default)]
    pub hilbert_orders: Option<HilbertOrders>,
    /// Whether CUDA cases ran, and why not when they did not.
    #[serde(default)]
    pub cuda: String,
    /// The rule of the allocator-vs-RSS cross-check (`rss_check` of each measurement).
    #[serde(default)]
    pub rss_check_rule: String,
    /// The report sections measured (`--section`); empty: every section.
    #[serde(default)]
    pub sections: Vec<String>,
}

impl RunResults {
    /// Whether this run measured report section `section`.
    pub fn includes(&self, section: &str) -> bool {
        self.sections.is_empty() || self.sections.iter().any(|s| s == section)
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let s = serde_json::to_string_pretty(self).map_err(|e| AttnError::Format(e.to_string()))?;
        std::fs::write(path, s).map_err(|e| AttnError::InvalidArgument(format!("{}: {e}", path.display())))
    }

    pub fn load(path: &Path) -> Result<Self> {
        let s = std::fs::read_to_string(path)
            .map_err(|e| AttnError::InvalidArgument(format!("{}: {e}", path.display())))?;
        serde_json::from_str(&s).map_err(|e| AttnError::Format(format!("{}: {e}", path.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example report's `results.json` loads into the typed cases and writes back
    /// the same JSON value: an earlier file stays a valid `--baseline`.
    #[test]
    fn the_example_results_round_trip_unchanged() {
        let path = crate::torch_peer::repo_root().join("docs/example-report/results.json");
        let text = std::fs::read_to_string(&path).unwrap();
        let original: serde_json::Value = serde_json::from_str(&text).unwrap();
        let typed: RunResults = serde_json::from_str(&text).unwrap();
        assert!(typed.measurements.len() > 90, "{}", typed.measurements.len());
        let written = serde_json::to_value(&typed).unwrap();
        let cases = |v: &serde_json::Value| {
            v["measurements"].as_array().unwrap().iter().map(|m| m["spec"].clone()).collect::<Vec<_>>()
        };
        assert_eq!(cases(&written), cases(&original));
        // A name no type knows is a typed error naming it.
        let bad = text.replacen("\"dtype\": \"f32\"", "\"dtype\": \"f8\"", 1);
        assert_ne!(bad, text);
        let e = serde_json::from_str::<RunResults>(&bad).unwrap_err().to_string();
        assert!(e.contains("unknown dtype `f8`"), "{e}");
    }
}
