//! One benchmark case (what runs, on which shape and config) and its measured result.

use attn_core::{AttnError, DType, DilatedConfig, Mixing, Pass, Result, Shape4};
use serde::{Deserialize, Serialize};

use crate::rss_check::RssCheck;

/// Which public API a case exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CaseKind {
    /// Dilated attention on one rank (`--case dilated`).
    Dilated,
    /// Ring attention over in-process ranks (`--case ring`).
    Ring,
    /// `MultiheadDilatedAttention`: projections + attention + LayerNorm + output.
    Multihead,
    /// Dilated attention on a Hilbert-ordered sequence.
    Hilbert,
}

impl CaseKind {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "dilated" => Ok(CaseKind::Dilated),
            "ring" => Ok(CaseKind::Ring),
            "multihead" => Ok(CaseKind::Multihead),
            "hilbert" => Ok(CaseKind::Hilbert),
            _ => Err(AttnError::InvalidArgument(format!("unknown case `{s}` (dilated|ring|multihead|hilbert)"))),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            CaseKind::Dilated => "dilated",
            CaseKind::Ring => "ring",
            CaseKind::Multihead => "multihead",
            CaseKind::Hilbert => "hilbert",
        }
    }
}

/// Everything that defines a case; the key `results.json` and `--baseline` match on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaseSpec {
    pub kind: CaseKind,
    /// Implementation: `reference`, `cpu`, `cuda`, `torch`, or `ring-<strategy>`.
    pub implementation: String,
    pub batch: usize,
    pub seq_len: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub segments: Vec<usize>,
    pub dilations: Vec<usize>,
    pub mixing: String,
    pub causal: bool,
    pub dtype: String,
    pub backward: bool,
    pub threads: usize,
    pub world_size: usize,
    pub strategy: Option<String>,
    pub layout: Option<String>,
}

impl CaseSpec {
    /// A single-rank dilated case with the report's default head layout.
    pub fn dilated(implementation: &str, seq_len: usize, segments: &[usize], dilations: &[usize]) -> Self {
        CaseSpec {
            kind: CaseKind::Dilated,
            implementation: implementation.to_string(),
            batch: 1,
            seq_len,
            heads: 8,
            head_dim: 64,
            segments: segments.to_vec(),
            dilations: dilations.to_vec(),
            mixing: Mixing::HeadGroups.as_str().to_string(),
            causal: false,
            dtype: "f32".into(),
            backward: false,
            threads: 1,
            world_size: 1,
            strategy: None,
            layout: None,
        }
    }

    /// A short stable label, e.g. `ring-pass_kv/P4 seq=16384 f32 fwd`.
    pub fn label(&self) -> String {
        let world = if self.kind == CaseKind::Ring {
            format!("/P{}/{}", self.world_size, self.layout.as_deref().unwrap_or("contiguous"))
        } else {
            String::new()
        };
        format!(
            "{} {}{} seq={} b{} h{} d{} {} {}{}",
            self.kind.as_str(),
            self.implementation,
            world,
            self.seq_len,
            self.batch,
            self.heads,
            self.head_dim,
            self.dtype,
            if self.backward { "fwd+bwd" } else { "fwd" },
            if self.causal { " causal" } else { "" },
        )
    }

    /// The validated attention config.
    pub fn config(&self) -> Result<DilatedConfig> {
        let cfg = DilatedConfig::builder()
            .segments(&self.segments)
            .dilations(&self.dilations)
            .mixing(Mixing::parse(&self.mixing)?)
            .causal(self.causal)
            .build()?;
        cfg.validate_heads(self.heads)?;
        Ok(cfg)
    }

    /// The validated `[batch, seq, heads, head_dim]` shape.
    pub fn shape(&self) -> Result<Shape4> {
        Shape4::new(self.batch, self.seq_len, self.heads, self.head_dim)
    }

    /// The pass a measurement times the end of: forward, or forward + backward.
    pub fn pass(&self) -> Pass {
        if self.backward { Pass::Backward } else { Pass::Forward }
    }

    pub fn dtype(&self) -> Result<DType> {
        DType::parse(&self.dtype).ok_or_else(|| AttnError::InvalidArgument(format!("unknown dtype `{}`", self.dtype)))
    }

    /// Tokens processed per call.
    pub fn tokens(&self) -> u64 {
        (self.batch * self.seq_len) as u64
    }

    /// Floating-point operations of the attention itself: for every head, pattern and
    /// segment with `m` selected positions, `4 m^2 d` (QK^T and PV, two flops per
    /// multiply-add), halved when causal; forward+backward counts 3.5x (as the
    /// PyTorch peer script does). This is `attn_kernels::model_flops` (forward, plus
    /// backward when asked); it equals the peer script's count when `w` divides `n`.
    pub fn attention_flops(&self) -> Result<f64> {
        let (cfg, shape) = (self.config()?, self.shape()?);
        let fwd = attn_kernels::model_flops(&cfg, shape, Pass::Forward);
        Ok(if self.backward { fwd + attn_kernels::model_flops(&cfg, shape, Pass::Backward) } else { fwd })
    }

    /// Extra flops of the multihead projections: 4 linear maps of `e x e`, 2 flops per MAC.
    pub fn projection_flops(&self) -> f64 {
        if self.kind != CaseKind::Multihead {
            return 0.0;
        }
        let e = (self.heads * self.head_dim) as f64;
        let f = 4.0 * 2.0 * self.tokens() as f64 * e * e;
        if self.backward { f * 3.0 } else { f }
    }
}

/// What one case measured (or why it did not run).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Measurement {
    pub spec: CaseSpec,
    /// Report section: `scaling`, `comparison`, `variants`, `multihead`, `capacity`.
    #[serde(default)]
    pub section: String,
    /// `ok`, `skipped: <why>` or `error: <message>`.
    pub status: String,
    pub runs: usize,
    pub median_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    pub gflop_per_s: f64,
    pub tokens_per_s: f64,
    /// Peak heap bytes of the case (inputs + outputs + workspace), counting allocator.
    pub peak_bytes: u64,
    /// Largest per-rank peak (ring cases; equals `peak_bytes` for one rank).
    pub peak_bytes_per_rank: u64,
    /// Per-rank peaks (ring cases), in allocator-slot order.
    pub rank_peak_bytes: Vec<u64>,
    /// Bytes each rank sent (ring cases, as reported by attn-ring).
    pub bytes_sent: Vec<u64>,
    /// Process peak RSS over the case (cross-check); `None` where unavailable.
    pub peak_rss_bytes: Option<u64>,
    pub rss_windowed: bool,
    /// Process RSS when the case's memory window opened (the base of the RSS growth).
    #[serde(default)]
    pub rss_base_bytes: Option<u64>,
    /// Allocator peak against RSS growth (`crate::rss_check::RULE`).
    #[serde(default)]
    pub rss_check: RssCheck,
    /// Device memory in use at the end of the first call above the level before the
    /// inputs were uploaded (CUDA cases; `cuMemGetInfo`, device-wide).
    #[serde(default)]
    pub device_bytes: Option<u64>,
    /// The machine's measured f32 GEMM rate on the same thread count.
    pub gemm_gflop_per_s: f64,
    /// The library's workspace-size query for this case, where it exists.
    pub workspace_query_bytes: Option<u64>,
    pub git_commit: String,
}

impl Measurement {
    /// A placeholder for a case that could not run.
    pub fn not_run(spec: CaseSpec, status: String, git_commit: &str) -> Self {
        Measurement {
            spec,
            section: String::new(),
            status,
            runs: 0,
            median_ms: 0.0,
            min_ms: 0.0,
            max_ms: 0.0,
            gflop_per_s: 0.0,
            tokens_per_s: 0.0,
            peak_bytes: 0,
            peak_bytes_per_rank: 0,
            rank_peak_bytes: Vec::new(),
            bytes_sent: Vec::new(),
            peak_rss_bytes: None,
            rss_windowed: false,
            rss_base_bytes: None,
            rss_check: RssCheck::NotChecked,
            device_bytes: None,
            gemm_gflop_per_s: 0.0,
            workspace_query_bytes: None,
            git_commit: git_commit.to_string(),
        }
    }
    pub fn ok(&self) -> bool {
        self.status == "ok"
    }
    /// Kilobytes of peak memory per token (per rank for ring cases).
    pub fn kb_per_token(&self) -> f64 {
        self.peak_bytes_per_rank as f64 / 1024.0 / self.spec.tokens() as f64
    }
    /// Achieved fraction of the measured GEMM rate.
    pub fn gemm_fraction(&self) -> f64 {
        self.gflop_per_s / self.gemm_gflop_per_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_match_the_peer_scripts_formula() {
        // Peer script: sum over groups g_i * (n / w) * 4 * m^2 * d with m = |range(i % r, w, r)|.
        let spec = CaseSpec::dilated("x", 8192, &[2048, 4096, 8192], &[1, 2, 4]);
        let (n, d) = (8192.0, 64.0);
        let want: f64 = [(3.0, 2048.0, 2048.0), (3.0, 4096.0, 2048.0), (2.0, 8192.0, 2048.0)]
            .iter()
            .map(|&(g, w, m)| g * (n / w) * 4.0 * m * m * d)
            .sum();
        assert_eq!(spec.attention_flops().unwrap(), want);
        let mut causal = spec.clone();
        causal.causal = true;
        assert_eq!(causal.attention_flops().unwrap(), want / 2.0);
    }

    #[test]
    fn bad_specs_are_typed_errors() {
        let mut spec = CaseSpec::dilated("x", 64, &[16, 32], &[1]);
        assert!(matches!(spec.config(), Err(AttnError::PatternCountMismatch { .. })));
        spec.dilations = vec![1, 2];
        spec.heads = 1;
        assert!(matches!(spec.config(), Err(AttnError::TooFewHeads { .. })));
        spec.seq_len = 0;
        assert!(spec.shape().is_err());
        assert!(CaseKind::parse("nope").is_err());
    }
}
