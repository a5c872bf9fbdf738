//! One benchmark case (what runs, on which shape and config) and its measured result.

use attn_core::{AttnError, AttnShape, Causality, DType, DilatedConfig, Mixing, Pass, Result, Shape4};
use attn_ring::{Layout, Strategy};
use serde::{Deserialize, Serialize};

use crate::block_sparse::BlockSparse;
pub use crate::names::Implementation;
use crate::names::{named, named_opt};
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
    /// Implementation: `reference`, `cpu`, `cpu-workspace`, `cuda`, `torch`, or `ring-<strategy>`.
    #[serde(with = "named")]
    pub implementation: Implementation,
    pub batch: usize,
    pub seq_len: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub segments: Vec<usize>,
    pub dilations: Vec<usize>,
    #[serde(with = "named")]
    pub mixing: Mixing,
    pub causal: bool,
    #[serde(with = "named")]
    pub dtype: DType,
    pub backward: bool,
    pub threads: usize,
    pub world_size: usize,
    #[serde(with = "named_opt")]
    pub strategy: Option<Strategy>,
    #[serde(with = "named_opt")]
    pub layout: Option<Layout>,
    /// Key/value heads (grouped-query attention; they divide `heads`). `None`: `heads`.
    #[serde(default)]
    pub kv_heads: Option<usize>,
    /// The grouped K/V repeated to every query head inside each call before the
    /// attention runs (a caller's `repeat_interleave`): the baseline of grouped heads.
    #[serde(default)]
    pub repeat_kv: bool,
    /// A sliding window `[left, right]` instead of segments and dilations.
    #[serde(default)]
    pub window: Option<[usize; 2]>,
    /// Sequences of their own lengths, packed into one row or padded to the longest
    /// (`batch` and `seq_len` follow from them, see [`CaseSpec::varlen`]).
    #[serde(default)]
    pub varlen: Option<VarLen>,
    /// A random block mask (block-sparse attention); left out of the JSON when absent, so
    /// earlier files read and write back unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_sparse: Option<BlockSparse>,
}

/// How a batch of sequences of different lengths is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VarLenLayout {
    /// One `[1, total, heads, head_dim]` row with `cu_seqlens`.
    Packed,
    /// `[count, longest, heads, head_dim]` with a key padding mask.
    Padded,
}

/// Sequences of their own lengths, drawn uniformly from `1..=max_len` with `seed`
/// (both kept for the report).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VarLen {
    pub seed: u64,
    pub max_len: usize,
    pub lengths: Vec<usize>,
    pub layout: VarLenLayout,
}

impl VarLen {
    /// `[0, n_0, n_0 + n_1, ..., total]`.
    pub fn cu_seqlens(&self) -> Vec<usize> {
        std::iter::once(0)
            .chain(self.lengths.iter().scan(0, |total, &n| {
                *total += n;
                Some(*total)
            }))
            .collect()
    }
    /// `(batch, seq_len)` of the layout.
    pub fn batch_and_seq(&self) -> (usize, usize) {
        match self.layout {
            VarLenLayout::Packed => (1, self.lengths.iter().sum()),
            VarLenLayout::Padded => (self.lengths.len(), self.lengths.iter().copied().max().unwrap_or(0)),
        }
    }
    /// The key padding flags of the padded layout (`[count, longest]`, `true` = padding).
    pub fn padding_flags(&self) -> Vec<bool> {
        let (_, longest) = self.batch_and_seq();
        self.lengths.iter().flat_map(|&n| (0..longest).map(move |p| p >= n)).collect()
    }
}

impl CaseSpec {
    /// A single-rank dilated case with the report's default head layout.
    pub fn dilated(implementation: Implementation, seq_len: usize, segments: &[usize], dilations: &[usize]) -> Self {
        CaseSpec {
            kind: CaseKind::Dilated,
            implementation,
            batch: 1,
            seq_len,
            heads: 8,
            head_dim: 64,
            segments: segments.to_vec(),
            dilations: dilations.to_vec(),
            mixing: Mixing::HeadGroups,
            causal: false,
            dtype: DType::F32,
            backward: false,
            threads: 1,
            world_size: 1,
            strategy: None,
            layout: None,
            kv_heads: None,
            repeat_kv: false,
            window: None,
            varlen: None,
            block_sparse: None,
        }
    }

    /// A single-rank sliding-window case `(left, right)` with the default head layout.
    pub fn window(implementation: Implementation, seq_len: usize, (left, right): (usize, usize), c: Causality) -> Self {
        CaseSpec {
            mixing: Mixing::Window,
            causal: c.is_causal(),
            window: Some([left, right]),
            ..CaseSpec::dilated(implementation, seq_len, &[], &[])
        }
    }

    /// `base` over the sequences `lengths` (drawn from `1..=max_len` with `seed`) in `layout`.
    pub fn varlen(base: &CaseSpec, (seed, max_len): (u64, usize), lengths: &[usize], layout: VarLenLayout) -> Self {
        let varlen = VarLen { seed, max_len, lengths: lengths.to_vec(), layout };
        let (batch, seq_len) = varlen.batch_and_seq();
        CaseSpec { batch, seq_len, varlen: Some(varlen), ..base.clone() }
    }

    /// Whether the case uses a feature beyond dilated attention over whole rows.
    pub fn uses_features(&self) -> bool {
        self.kv_heads.is_some()
            || self.repeat_kv
            || self.window.is_some()
            || self.varlen.is_some()
            || self.block_sparse.is_some()
    }

    /// Key/value heads (`heads` without grouped-query attention).
    pub fn kv_heads(&self) -> usize {
        self.kv_heads.unwrap_or(self.heads)
    }

    /// A short stable label, e.g. `ring-pass_kv/P4 seq=16384 f32 fwd`.
    pub fn label(&self) -> String {
        let world = if self.kind == CaseKind::Ring {
            format!("/P{}/{}", self.world_size, self.layout.unwrap_or_default().as_str())
        } else {
            String::new()
        };
        format!(
            "{} {}{} seq={} b{} h{} d{} {} {}{}{}",
            self.kind.as_str(),
            self.implementation.as_str(),
            world,
            self.seq_len,
            self.batch,
            self.heads,
            self.head_dim,
            self.dtype.as_str(),
            if self.backward { "fwd+bwd" } else { "fwd" },
            if self.causal { " causal" } else { "" },
            self.feature_label(),
        )
    }

    /// The label's feature part, e.g. ` kv1 repeat-kv`, ` window(4095,0)`, ` packed x8`.
    fn feature_label(&self) -> String {
        let mut s = String::new();
        if let Some(kv) = self.kv_heads.filter(|&kv| kv != self.heads) {
            s += &format!(" kv{kv}");
        }
        if self.repeat_kv {
            s += " repeat-kv";
        }
        if let Some([l, r]) = self.window {
            s += &format!(" window({l},{r})");
        }
        if let Some(v) = &self.varlen {
            let layout = match v.layout {
                VarLenLayout::Packed => "packed",
                VarLenLayout::Padded => "padded",
            };
            s += &format!(" {layout} x{}", v.lengths.len());
        }
        if let Some(b) = self.block_sparse {
            s += &format!(" blocks{} kept{}%", b.block_size, b.kept_percent);
            // Random masks keep the label they had before local windows were measured.
            if b.kind != crate::block_sparse::SparseKind::Random {
                s += &format!(" {}", b.kind.as_str());
            }
        }
        s
    }

    /// The validated attention config (a sliding window when `window` is set).
    pub fn config(&self) -> Result<DilatedConfig> {
        let builder = match self.window {
            Some([left, right]) => DilatedConfig::builder().window(left, right),
            None => DilatedConfig::builder().segments(&self.segments).dilations(&self.dilations).mixing(self.mixing),
        };
        let cfg = builder.causality(self.causal.into()).build()?;
        cfg.validate_heads(self.heads)?;
        Ok(cfg)
    }

    /// The validated `[batch, seq, heads, head_dim]` shape of the queries.
    pub fn shape(&self) -> Result<Shape4> {
        if let Some(v) = &self.varlen
            && (v.lengths.contains(&0) || v.batch_and_seq() != (self.batch, self.seq_len))
        {
            return Err(AttnError::InvalidArgument(format!(
                "sequence lengths {:?} ({:?}) do not give batch {} and seq {}",
                v.lengths, v.layout, self.batch, self.seq_len
            )));
        }
        Shape4::new(self.batch, self.seq_len, self.heads, self.head_dim)
    }

    /// The validated shapes of q and of k and v (`kv_heads` heads, dividing `heads`).
    pub fn attn_shape(&self) -> Result<AttnShape> {
        let q = self.shape()?;
        let kv = [q.batch, q.seq, self.kv_heads(), q.head_dim];
        AttnShape::check(&q.dims(), &kv, &kv)
    }

    /// The pass a measurement times the end of: forward, or forward + backward.
    pub fn pass(&self) -> Pass {
        if self.backward { Pass::Backward } else { Pass::Forward }
    }

    /// Tokens processed per call: the real tokens of variable-length sequences, padding not counted.
    pub fn tokens(&self) -> u64 {
        match &self.varlen {
            Some(v) => v.lengths.iter().sum::<usize>() as u64,
            None => (self.batch * self.seq_len) as u64,
        }
    }

    /// Floating-point operations of the attention itself: for every head, pattern and
    /// segment with `m` selected positions, `4 m^2 d` (QK^T and PV, two flops per
    /// multiply-add), halved when causal; forward+backward counts 3.5x (as the
    /// PyTorch peer script does). This is `attn_kernels::model_flops` (forward, plus
    /// backward when asked); it equals the peer script's count when `w` divides `n`.
    /// Under a block mask (one pattern over the sequence), the kept share of that count.
    pub fn attention_flops(&self) -> Result<f64> {
        let (cfg, shape) = (self.config()?, self.shape()?);
        let one = |s: Shape4, pass: Pass| match self.window {
            Some([left, right]) => window_flops(s, left, if self.causal { 0 } else { right }, pass),
            None => attn_kernels::model_flops(&cfg, s, pass),
        };
        let call = |pass: Pass| -> Result<f64> {
            match &self.varlen {
                Some(v) => v
                    .lengths
                    .iter()
                    .try_fold(0.0, |sum, &n| Ok(sum + one(Shape4::new(1, n, shape.heads, shape.head_dim)?, pass))),
                None => Ok(one(shape, pass)),
            }
        };
        // A block mask leaves its kept share of the (query, key) pairs.
        let share = self.block_sparse.map_or(Ok(1.0), |b| crate::block_sparse::kept_share(&b, self.seq_len))?;
        let fwd = call(Pass::Forward)? * share;
        Ok(if self.backward { fwd + call(Pass::Backward)? * share } else { fwd })
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

/// The (query, key) pairs of `n` positions a window reaching `left` before and `right`
/// after each query admits: `sum_q min(q, left) + min(n - 1 - q, right) + 1`, in closed form.
fn window_pairs(n: usize, left: usize, right: usize) -> f64 {
    // sum_{q < n} min(q, a) = a(a+1)/2 + (n-1-a) a when a < n, else n(n-1)/2.
    let side = |a: usize| -> f64 {
        let (a, n) = (a as f64, n as f64);
        if a < n { a * (a + 1.0) / 2.0 + (n - 1.0 - a) * a } else { n * (n - 1.0) / 2.0 }
    };
    side(left) + side(right) + n as f64
}

/// Model FLOPs of a sliding window on `shape`: `4 d` per visible (query, key) pair
/// per head, times 2.5 for the backward (as `attn_kernels::model_flops`).
fn window_flops(shape: Shape4, left: usize, right: usize, pass: Pass) -> f64 {
    let pairs = window_pairs(shape.seq, left, right);
    let bwd = if pass == Pass::Backward { 2.5 } else { 1.0 };
    4.0 * pairs * (shape.head_dim * shape.heads * shape.batch) as f64 * bwd
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
    /// Bytes of each rank's attention data messages, their 9-byte headers included
    /// (ring cases, `RingStats::data_bytes_sent`: what `attn_ring::expected_bytes` predicts).
    #[serde(default)]
    pub data_bytes_sent: Vec<u64>,
    /// Attention data messages each rank sent (ring cases, `RingStats::data_messages`).
    #[serde(default)]
    pub data_messages: Vec<u64>,
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
            data_bytes_sent: Vec::new(),
            data_messages: Vec::new(),
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

/// The scaling config: the PyTorch peer script's default (3 head groups, w up to 8192).
pub const SEGMENTS: [usize; 3] = [2048, 4096, 8192];
pub const DILATIONS: [usize; 3] = [1, 2, 4];
/// A config whose segments divide 2048, for the comparison that includes the slow reference.
pub const SMALL_SEGMENTS: [usize; 3] = [512, 1024, 2048];

/// A ring case of the scaling config.
pub fn ring_case(base: &CaseSpec, world: usize, strategy: Strategy, layout: Layout) -> CaseSpec {
    let mut s = base.clone();
    s.kind = CaseKind::Ring;
    s.world_size = world;
    s.implementation = Implementation::Ring(strategy);
    s.strategy = Some(strategy);
    s.layout = Some(layout);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_match_the_peer_scripts_formula() {
        // Peer script: sum over groups g_i * (n / w) * 4 * m^2 * d with m = |range(i % r, w, r)|.
        let spec = CaseSpec::dilated(Implementation::Cpu, 8192, &[2048, 4096, 8192], &[1, 2, 4]);
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
        let mut spec = CaseSpec::dilated(Implementation::Cpu, 64, &[16, 32], &[1]);
        assert!(matches!(spec.config(), Err(AttnError::PatternCountMismatch { .. })));
        spec.dilations = vec![1, 2];
        spec.heads = 1;
        assert!(matches!(spec.config(), Err(AttnError::TooFewHeads { .. })));
        spec.seq_len = 0;
        assert!(spec.shape().is_err());
        assert!(CaseKind::parse("nope").is_err());
    }

    #[test]
    fn window_pairs_match_the_walk() {
        for n in [1usize, 2, 7, 64, 100] {
            for (left, right) in [(0, 0), (3, 0), (0, 5), (4095, 0), (6, 9), (200, 200)] {
                let walk: usize = (0..n).map(|q| q.min(left) + (n - 1 - q).min(right) + 1).sum();
                assert_eq!(window_pairs(n, left, right), walk as f64, "n={n} ({left},{right})");
            }
        }
        // A window covering the whole causal sequence is dense causal: n(n+1)/2 pairs.
        let w = CaseSpec::window(Implementation::Cpu, 64, (1000, 0), Causality::Causal);
        assert_eq!(w.attention_flops().unwrap(), 4.0 * (64.0 * 65.0 / 2.0) * 64.0 * 8.0);
        let bwd = CaseSpec { backward: true, ..w.clone() };
        assert_eq!(bwd.attention_flops().unwrap(), 3.5 * w.attention_flops().unwrap());
        assert!(w.config().unwrap().window().is_some() && w.label().ends_with("causal window(1000,0)"));
    }

    #[test]
    fn feature_specs_give_their_shapes_tokens_and_flops() {
        let base = CaseSpec { causal: true, ..CaseSpec::dilated(Implementation::Cpu, 1, &[16, 32], &[1, 2]) };
        let lengths = [5, 40, 17];
        let packed = CaseSpec::varlen(&base, (9, 40), &lengths, VarLenLayout::Packed);
        let padded = CaseSpec::varlen(&base, (9, 40), &lengths, VarLenLayout::Padded);
        assert_eq!((packed.batch, packed.seq_len, padded.batch, padded.seq_len), (1, 62, 3, 40));
        assert_eq!((packed.tokens(), padded.tokens()), (62, 62));
        let v = padded.varlen.as_ref().unwrap();
        assert_eq!(v.cu_seqlens(), [0, 5, 45, 62]);
        let flags = v.padding_flags();
        assert_eq!(flags.len(), 3 * 40);
        assert_eq!(flags.iter().filter(|&&f| !f).count(), 62);
        assert!(!flags[4] && flags[5] && !flags[40 + 39] && flags[80 + 17]);
        // Both count the same useful work: every sequence on its own.
        let each: f64 = lengths
            .iter()
            .map(|&n| {
                attn_kernels::model_flops(&base.config().unwrap(), Shape4::new(1, n, 8, 64).unwrap(), Pass::Forward)
            })
            .sum();
        assert_eq!((packed.attention_flops().unwrap(), padded.attention_flops().unwrap()), (each, each));
        assert!(packed.label().ends_with("packed x3") && padded.label().ends_with("padded x3"));
        let mut bad = packed.clone();
        bad.seq_len += 1;
        assert!(bad.shape().is_err());
        // Grouped heads: k and v have their own head count, which must divide q's.
        let gqa = CaseSpec { kv_heads: Some(2), ..base.clone() };
        let s = gqa.attn_shape().unwrap();
        assert_eq!((s.q.heads, s.kv.heads, s.group_size()), (8, 2, 4));
        assert!(CaseSpec { kv_heads: Some(3), ..base.clone() }.attn_shape().is_err());
        assert!(gqa.uses_features() && !base.uses_features() && gqa.label().ends_with(" kv2"));
    }
}
