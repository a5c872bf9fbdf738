//! LongNet encoder layer (pre-LN, sub-LN attention, FFN with sub-LN, MAGNETO gains) and a stack of them; forward and backward.

use std::sync::Arc;

use attn_core::{Attention, AttnError, DilatedConfig, Result, TensorName};

use crate::call::Call;
use crate::config::MultiheadConfig;
use crate::dropout::{DropoutSite, MaskRows, Mode, apply_mask, dropout_mask};
use crate::float::LayerFloat;
use crate::init::{MagnetoGains, SeededRng};
use crate::layer::{MultiheadCache, MultiheadDilatedAttention};
use crate::layer_norm::{LayerNorm, NormStats};
use crate::projection::{Bias, Linear};
use crate::segment_window::{window_rows, windows};
use crate::weights::{MultiheadWeights, NamedParams, Param, ParamMut};
use crate::workspace::MultiheadWorkspace;

/// Whether the feed-forward branch keeps what the backward needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    Output,
    Cache,
}

/// Hyper-parameters of a LongNet encoder layer (`DilatedTransformerEncoderLayer` of
/// `dilated-attention-pytorch`; activation ReLU as its default).
#[derive(Debug, Clone, PartialEq)]
pub struct EncoderConfig {
    pub d_model: usize,
    pub nhead: usize,
    /// The self-attention's patterns, causality and scale (see [`MultiheadConfig::attention`]).
    pub attention: DilatedConfig,
    pub dim_feedforward: usize,
    pub dropout: f64,
    pub layer_norm_eps: f64,
    /// MAGNETO gain of v, out and `linear2`; stacks set it from their layer count.
    pub gamma_init: f64,
}

impl EncoderConfig {
    /// Defaults: no dropout, eps 1e-5, gain 1.
    pub fn new(d_model: usize, nhead: usize, attention: DilatedConfig, dim_feedforward: usize) -> Self {
        EncoderConfig {
            d_model,
            nhead,
            attention,
            dim_feedforward,
            dropout: 0.0,
            layer_norm_eps: 1e-5,
            gamma_init: 1.0,
        }
    }

    /// The attention sub-layer's config (bias, sub-LN on, same dropout and gain).
    pub fn self_attention(&self) -> MultiheadConfig {
        let mut c = MultiheadConfig::new(self.d_model, self.nhead, self.attention.clone())
            .with_dropout(self.dropout)
            .with_gamma_init(self.gamma_init);
        c.layer_norm_eps = self.layer_norm_eps;
        c
    }

    pub fn validate(&self) -> Result<()> {
        self.self_attention().validate()?;
        if self.dim_feedforward == 0 {
            return Err(AttnError::InvalidArgument("dim_feedforward must be positive".into()));
        }
        // `linear1` and `linear2` are `d_model x dim_feedforward`, in floats of up to 8 bytes.
        let (e, ff) = (self.d_model, self.dim_feedforward);
        if e.checked_mul(ff).and_then(|n| n.checked_mul(8)).is_none_or(|b| b > isize::MAX as usize) {
            return Err(AttnError::ShapeOverflow {
                tensor: attn_core::TensorName::Other("linear1"),
                dims: vec![ff, e],
            });
        }
        Ok(())
    }
}

/// One LongNet encoder layer: `x = x + drop(attn(norm1(x)))`,
/// `x = x + drop(linear2(norm3(drop(relu(linear1(norm2(x)))))))`. Parameter names
/// follow the library: `norm1.*`, `self_attn.*`, `norm2.*`, `linear1.*`, `norm3.*`, `linear2.*`.
#[derive(Debug, Clone)]
pub struct LongNetEncoderLayer<F: LayerFloat> {
    config: EncoderConfig,
    pub norm1: LayerNorm<F>,
    pub self_attn: MultiheadDilatedAttention<F>,
    pub norm2: LayerNorm<F>,
    pub linear1: Linear<F>,
    pub norm3: LayerNorm<F>,
    pub linear2: Linear<F>,
}

/// Gradients of every parameter of a [`LongNetEncoderLayer`] (same names and order).
#[derive(Debug, Clone, PartialEq)]
pub struct EncoderLayerGrads<F> {
    pub norm1: LayerNorm<F>,
    pub self_attn: MultiheadWeights<F>,
    pub norm2: LayerNorm<F>,
    pub linear1: Linear<F>,
    pub norm3: LayerNorm<F>,
    pub linear2: Linear<F>,
}

/// What the encoder layer's backward needs.
#[derive(Debug, Clone)]
pub struct EncoderLayerCache<F: LayerFloat> {
    batch: usize,
    seq: usize,
    x: Vec<F>,
    stats1: NormStats<F::Acc>,
    attn: MultiheadCache<F>,
    mask_attn: Option<Vec<F>>,
    x1: Vec<F>,
    ffn: FfnCache<F>,
}

/// The feed-forward branch's saved activations.
#[derive(Debug, Clone)]
struct FfnCache<F: LayerFloat> {
    stats2: NormStats<F::Acc>,
    h2: Vec<F>,
    f1: Vec<F>,
    mask_hidden: Option<Vec<F>>,
    r_d: Vec<F>,
    stats3: NormStats<F::Acc>,
    h3: Vec<F>,
    mask_out: Option<Vec<F>>,
}

fn add<F2>(a: &[F2], b: &[F2]) -> Vec<F2>
where
    F2: LayerFloat,
{
    a.iter().zip(b).map(|(&x, &y)| x + y).collect()
}

impl<F: LayerFloat> LongNetEncoderLayer<F> {
    /// A layer initialised as the library does (MAGNETO gains from `config.gamma_init`).
    pub fn new(config: EncoderConfig, seed: u64, backend: Arc<dyn Attention<F>>) -> Result<Self> {
        config.validate()?;
        let (e, ff) = (config.d_model, config.dim_feedforward);
        let eps = config.layer_norm_eps;
        let self_attn = MultiheadDilatedAttention::new(config.self_attention(), seed, backend)?;
        let mut rng = SeededRng::new(seed ^ 0x5EED_F00D);
        let linear1 = Linear::xavier(&mut rng, e, ff, 1.0, Bias::Zeros);
        let linear2 = Linear::xavier(&mut rng, ff, e, config.gamma_init, Bias::Zeros);
        Ok(LongNetEncoderLayer {
            norm1: LayerNorm::new(e, eps),
            self_attn,
            norm2: LayerNorm::new(e, eps),
            linear1,
            norm3: LayerNorm::new(ff, eps),
            linear2,
            config,
        })
    }

    pub fn config(&self) -> &EncoderConfig {
        &self.config
    }

    /// Zero gradients with this layer's layout.
    pub fn zero_grads(&self) -> EncoderLayerGrads<F> {
        EncoderLayerGrads {
            norm1: self.norm1.zeros_like(),
            self_attn: self.self_attn.weights.zeros_like(),
            norm2: self.norm2.zeros_like(),
            linear1: self.linear1.zeros_like(),
            norm3: self.norm3.zeros_like(),
            linear2: self.linear2.zeros_like(),
        }
    }

    /// Forward over `x: [call.batch, call.seq, d_model]` (nothing kept for backward);
    /// the call's masks apply to the self-attention, everything else is per token.
    pub fn forward(&self, x: &[F], call: &Call<'_, F>) -> Result<Vec<F>> {
        let mut y = attn_kernels::zeroed_buffer(x.len())?;
        self.forward_into(x, call, &mut MultiheadWorkspace::new(), &mut y)?;
        Ok(y)
    }

    /// [`LongNetEncoderLayer::forward`] into `out`, with the attention's intermediate
    /// buffers in `ws`, which can serve every layer of a stack and every call.
    pub fn forward_into(
        &self,
        x: &[F],
        call: &Call<'_, F>,
        ws: &mut MultiheadWorkspace<F>,
        out: &mut [F],
    ) -> Result<()> {
        call.self_attention_only("LongNetEncoderLayer")?;
        let h1 = self.norm1.forward(x)?.0;
        let mut a = attn_kernels::zeroed_buffer(x.len())?;
        self.self_attn.forward_into(&h1, call, ws, &mut a)?;
        drop(h1);
        self.after_attention(x, a, [call.batch, call.seq], call.mode, out)
    }

    /// The residual around the attention output `a` and the feed-forward branch.
    /// Writes `x1 + ffn(x1)` into `out`, where `x1 = x + dropout(a)`.
    fn after_attention(&self, x: &[F], a: Vec<F>, [batch, seq]: [usize; 2], mode: Mode, out: &mut [F]) -> Result<()> {
        if out.len() != x.len() {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Output,
                expected: vec![batch, seq, self.config.d_model],
                got: vec![out.len()],
            });
        }
        let rows = self.self_attn.mask_rows(mode, batch, seq)?;
        let mask = dropout_mask(mode, self.config.dropout, DropoutSite::AttentionResidual, &rows, self.config.d_model);
        let x1 = add(x, &apply_mask(&a, mask.as_deref()));
        drop(a);
        let ffn = self.feedforward(&x1, &rows, mode, Keep::Output)?.0;
        out.iter_mut().zip(x1.iter().zip(&ffn)).for_each(|(o, (&u, &f))| *o = u + f);
        Ok(())
    }

    /// Runs the FFN branch over `[batch, seq, d_model]` (`at`: the rows' global
    /// positions for dropout masks); returns its output and (with [`Keep::Cache`]) the
    /// pieces backward needs.
    fn feedforward(&self, x1: &[F], at: &MaskRows, mode: Mode, keep: Keep) -> Result<(Vec<F>, Option<FfnCache<F>>)> {
        let rows = x1.len() / self.config.d_model;
        let (h2, stats2) = self.norm2.forward(x1)?;
        let f1 = self.linear1.forward(&h2, rows)?;
        let r: Vec<F> = f1.iter().map(|&v| v.max(F::zero())).collect();
        let (p, ff) = (self.config.dropout, self.config.dim_feedforward);
        let mask_hidden = dropout_mask(mode, p, DropoutSite::FeedForwardHidden, at, ff);
        let r_d = apply_mask(&r, mask_hidden.as_deref()).into_owned();
        drop(r);
        let (h3, stats3) = self.norm3.forward(&r_d)?;
        let f2 = self.linear2.forward(&h3, rows)?;
        let mask_out = dropout_mask(mode, p, DropoutSite::FeedForwardResidual, at, self.config.d_model);
        let y = apply_mask(&f2, mask_out.as_deref()).into_owned();
        let kept = (keep == Keep::Cache).then_some(FfnCache { stats2, h2, f1, mask_hidden, r_d, stats3, h3, mask_out });
        Ok((y, kept))
    }

    /// [`LongNetEncoderLayer::forward`] keeping what [`LongNetEncoderLayer::backward`]
    /// needs (the call's masks included).
    pub fn forward_train(&self, x: &[F], call: &Call<'_, F>) -> Result<(Vec<F>, EncoderLayerCache<F>)> {
        call.self_attention_only("LongNetEncoderLayer")?;
        let (batch, seq, mode) = (call.batch, call.seq, call.mode);
        let (h1, stats1) = self.norm1.forward(x)?;
        let (a, attn) = self.self_attn.forward_train(&h1, call)?;
        let rows = self.self_attn.mask_rows(mode, batch, seq)?;
        let mask_attn =
            dropout_mask(mode, self.config.dropout, DropoutSite::AttentionResidual, &rows, self.config.d_model);
        let x1 = add(x, &apply_mask(&a, mask_attn.as_deref()));
        let (ffn, kept) = self.feedforward(&x1, &rows, mode, Keep::Cache)?;
        let ffn_cache = kept.ok_or_else(|| AttnError::InvalidArgument("feed-forward cache missing".into()))?;
        let y = add(&x1, &ffn);
        let cache = EncoderLayerCache { batch, seq, x: x.to_vec(), stats1, attn, mask_attn, x1, ffn: ffn_cache };
        Ok((y, cache))
    }

    /// Gradient of `sum(y * grad_out)` with respect to `x`; accumulates parameter gradients.
    pub fn backward(
        &self,
        cache: &EncoderLayerCache<F>,
        grad_out: &[F],
        grads: &mut EncoderLayerGrads<F>,
    ) -> Result<Vec<F>> {
        // The fields are public: gradients of another layout would be accumulated into
        // the wrong elements (or partly dropped) without an error.
        let layout =
            |ps: Vec<Param<'_, F>>| ps.into_iter().map(|p| (p.name, p.shape, p.data.len())).collect::<Vec<_>>();
        if layout(self.params()) != layout(grads.params()) {
            return Err(AttnError::InvalidArgument("gradient accumulator does not match the layer".into()));
        }
        let rows = cache.batch * cache.seq;
        if grad_out.len() != cache.x.len() {
            return Err(AttnError::InvalidArgument(format!(
                "grad_out has {} elements, the layer output {}",
                grad_out.len(),
                cache.x.len()
            )));
        }
        let f = &cache.ffn;
        let g_f2 = apply_mask(grad_out, f.mask_out.as_deref());
        let dh3 = self.linear2.backward(&f.h3, rows, &g_f2, &mut grads.linear2)?;
        let dr_d = self.norm3.backward(&f.r_d, &f.stats3, &dh3, &mut grads.norm3)?;
        let mut df1 = apply_mask(&dr_d, f.mask_hidden.as_deref()).into_owned();
        df1.iter_mut().zip(&f.f1).for_each(|(g, &pre)| {
            if pre <= F::zero() {
                *g = F::zero();
            }
        });
        let dh2 = self.linear1.backward(&f.h2, rows, &df1, &mut grads.linear1)?;
        let dx1 = add(grad_out, &self.norm2.backward(&cache.x1, &f.stats2, &dh2, &mut grads.norm2)?);
        let g_a = apply_mask(&dx1, cache.mask_attn.as_deref());
        let dh1 = self.self_attn.backward(&cache.attn, &g_a, &mut grads.self_attn)?.query;
        let (h1_stats, x) = (&cache.stats1, &cache.x);
        Ok(add(&dx1, &self.norm1.backward(x, h1_stats, &dh1, &mut grads.norm1)?))
    }
}

impl<F: LayerFloat> NamedParams<F> for LongNetEncoderLayer<F> {
    fn params_with_prefix<'a>(&'a self, prefix: &str, out: &mut Vec<Param<'a, F>>) {
        self.norm1.params_with_prefix(&format!("{prefix}norm1."), out);
        self.self_attn.weights.params_with_prefix(&format!("{prefix}self_attn."), out);
        self.norm2.params_with_prefix(&format!("{prefix}norm2."), out);
        self.linear1.params_with_prefix(&format!("{prefix}linear1."), out);
        self.norm3.params_with_prefix(&format!("{prefix}norm3."), out);
        self.linear2.params_with_prefix(&format!("{prefix}linear2."), out);
    }
    fn params_mut_with_prefix<'a>(&'a mut self, prefix: &str, out: &mut Vec<ParamMut<'a, F>>) {
        self.norm1.params_mut_with_prefix(&format!("{prefix}norm1."), out);
        self.self_attn.weights.params_mut_with_prefix(&format!("{prefix}self_attn."), out);
        self.norm2.params_mut_with_prefix(&format!("{prefix}norm2."), out);
        self.linear1.params_mut_with_prefix(&format!("{prefix}linear1."), out);
        self.norm3.params_mut_with_prefix(&format!("{prefix}norm3."), out);
        self.linear2.params_mut_with_prefix(&format!("{prefix}linear2."), out);
    }
}

impl<F: LayerFloat> NamedParams<F> for EncoderLayerGrads<F> {
    fn params_with_prefix<'a>(&'a self, prefix: &str, out: &mut Vec<Param<'a, F>>) {
        self.norm1.params_with_prefix(&format!("{prefix}norm1."), out);
        self.self_attn.params_with_prefix(&format!("{prefix}self_attn."), out);
        self.norm2.params_with_prefix(&format!("{prefix}norm2."), out);
        self.linear1.params_with_prefix(&format!("{prefix}linear1."), out);
        self.norm3.params_with_prefix(&format!("{prefix}norm3."), out);
        self.linear2.params_with_prefix(&format!("{prefix}linear2."), out);
    }
    fn params_mut_with_prefix<'a>(&'a mut self, prefix: &str, out: &mut Vec<ParamMut<'a, F>>) {
        self.norm1.params_mut_with_prefix(&format!("{prefix}norm1."), out);
        self.self_attn.params_mut_with_prefix(&format!("{prefix}self_attn."), out);
        self.norm2.params_mut_with_prefix(&format!("{prefix}norm2."), out);
        self.linear1.params_mut_with_prefix(&format!("{prefix}linear1."), out);
        self.norm3.params_mut_with_prefix(&format!("{prefix}norm3."), out);
        self.linear2.params_mut_with_prefix(&format!("{prefix}linear2."), out);
    }
}

/// A stack of LongNet encoder layers (`layers.{i}.*`, as `nn.TransformerEncoder`), with
/// MAGNETO gains from the layer count.
#[derive(Debug, Clone)]
pub struct LongNetEncoder<F: LayerFloat> {
    pub layers: Vec<LongNetEncoderLayer<F>>,
}

/// Per-layer caches of a stack forward.
#[derive(Debug, Clone)]
pub struct EncoderCache<F: LayerFloat> {
    layers: Vec<EncoderLayerCache<F>>,
}

/// Seed of layer `i`'s weights or dropout masks, derived from the stack's seed.
fn layer_seed(seed: u64, i: usize) -> u64 {
    SeededRng::new(seed ^ (i as u64).wrapping_mul(0xA24B_AED4_963E_E407)).next_u64()
}

/// The mode layer `i` of a stack runs in: its dropout masks come from a seed derived
/// from the stack's.
pub fn layer_mode(mode: Mode, i: usize) -> Mode {
    match mode {
        Mode::Eval => Mode::Eval,
        Mode::Train { seed } => Mode::Train { seed: layer_seed(seed, i) },
    }
}

impl<F: LayerFloat> LongNetEncoder<F> {
    /// `num_layers` layers with the encoder-only MAGNETO gain `sqrt(log(2 * num_layers))`
    /// (overriding `config.gamma_init`); layer `i` is initialised from a seed derived from `seed`.
    pub fn new(config: EncoderConfig, num_layers: usize, seed: u64, backend: Arc<dyn Attention<F>>) -> Result<Self> {
        Self::with_gains(config, num_layers, MagnetoGains::encoder_only(num_layers), seed, backend)
    }

    /// Like [`LongNetEncoder::new`] with explicit gains (e.g. [`MagnetoGains::encoder_decoder`]).
    pub fn with_gains(
        mut config: EncoderConfig,
        num_layers: usize,
        gains: MagnetoGains,
        seed: u64,
        backend: Arc<dyn Attention<F>>,
    ) -> Result<Self> {
        if num_layers == 0 {
            return Err(AttnError::InvalidArgument("an encoder needs at least one layer".into()));
        }
        config.gamma_init = gains.encoder;
        let layers = (0..num_layers)
            .map(|i| LongNetEncoderLayer::new(config.clone(), layer_seed(seed, i), backend.clone()))
            .collect::<Result<Vec<_>>>()?;
        Ok(LongNetEncoder { layers })
    }

    /// Forward through every layer (nothing kept); the call's masks apply in every
    /// layer's self-attention. An eval pass without masks on one device walks long
    /// sequences in segment windows ([`LongNetEncoder::forward_windows`] with a window
    /// that is a multiple of every layer's segment lengths, at least the attention's
    /// `window_rows`, default [`crate::DEFAULT_WINDOW_ROWS`]): the same function with
    /// one window's activations (the feed-forward's included).
    pub fn forward(&self, x: &[F], call: &Call<'_, F>) -> Result<Vec<F>> {
        if let Some(window) = self.eval_window(call)? {
            return self.forward_windows(x, call.batch, call.seq, window, |_| {});
        }
        let mut y = attn_kernels::zeroed_buffer(x.len())?;
        self.forward_into(x, call, &mut MultiheadWorkspace::new(), &mut y)?;
        Ok(y)
    }

    /// Set every layer's window target ([`MultiheadDilatedAttention::with_window_rows`];
    /// 0 makes [`LongNetEncoder::forward`] one pass over the whole sequence).
    pub fn with_window_rows(mut self, rows: usize) -> Self {
        for l in &mut self.layers {
            l.self_attn.set_window_rows(rows);
        }
        self
    }

    /// The window an eval pass walks, if any (not on a ring, not in training, not with
    /// masks, not with a sliding window, which crosses every window edge).
    fn eval_window(&self, call: &Call<'_, F>) -> Result<Option<usize>> {
        let attn = &self.first_layer()?.self_attn;
        if call.mode != Mode::Eval
            || !call.masks.is_none()
            || !attn.backend().placement().is_whole()
            || self.layers.iter().any(|l| l.config.attention.window().is_some())
        {
            return Ok(None);
        }
        let segments: Vec<usize> =
            self.layers.iter().flat_map(|l| l.config.attention.segment_lengths().iter().copied()).collect();
        Ok(window_rows(&segments, call.seq, attn.window_rows()))
    }

    /// The first layer (`layers` is public: an empty stack is an error, not a panic).
    fn first_layer(&self) -> Result<&LongNetEncoderLayer<F>> {
        self.layers.first().ok_or_else(|| AttnError::InvalidArgument("an encoder needs at least one layer".into()))
    }

    /// [`LongNetEncoder::forward`] into `out` in one pass, with one attention
    /// workspace for every layer (and for later calls with the same shapes).
    pub fn forward_into(
        &self,
        x: &[F],
        call: &Call<'_, F>,
        ws: &mut MultiheadWorkspace<F>,
        out: &mut [F],
    ) -> Result<()> {
        self.first_layer()?;
        let mut h = x.to_vec();
        let mut next = attn_kernels::zeroed_buffer(x.len())?;
        for (i, l) in self.layers.iter().enumerate() {
            l.forward_into(&h, &call.with_mode(layer_mode(call.mode, i)), ws, &mut next)?;
            std::mem::swap(&mut h, &mut next);
        }
        if out.len() != h.len() {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Output,
                expected: vec![call.batch, call.seq, self.first_layer()?.config.d_model],
                got: vec![out.len()],
            });
        }
        out.copy_from_slice(&h);
        Ok(())
    }

    /// Eval forward in independent windows of `window` positions, calling `progress`
    /// with the number of tokens done after each window. Exact (equal to
    /// [`LongNetEncoder::forward`]) because every segment length must divide `window`
    /// (checked): attention never crosses a window boundary, everything else is per
    /// token. Peak memory is that of one window.
    pub fn forward_windows(
        &self,
        x: &[F],
        batch: usize,
        seq: usize,
        window: usize,
        mut progress: impl FnMut(usize),
    ) -> Result<Vec<F>> {
        let e = self.first_layer()?.config.d_model;
        if batch == 0
            || seq == 0
            || window == 0
            || batch.checked_mul(seq).and_then(|r| r.checked_mul(e)) != Some(x.len())
        {
            return Err(AttnError::InvalidArgument(format!(
                "forward_windows: {} elements are not [{batch}, {seq}, {e}] with a positive window",
                x.len()
            )));
        }
        if window < seq {
            for l in &self.layers {
                if let Some(w) = l.config.attention.window() {
                    return Err(AttnError::InvalidArgument(format!(
                        "a sliding window ({}, {}) crosses windows of {window} rows: run one pass",
                        w.left, w.right
                    )));
                }
                if let Some(w) = l.config.attention.segment_lengths().iter().find(|&&w| !window.is_multiple_of(w)) {
                    return Err(AttnError::InvalidArgument(format!(
                        "window {window} is not a multiple of segment length {w}: attention would cross windows"
                    )));
                }
            }
        }
        let mut y = attn_kernels::zeroed_buffer(x.len())?;
        let mut ws = MultiheadWorkspace::new();
        let mut done = 0;
        for b in 0..batch {
            for (start, len) in windows(seq, window) {
                let rows = (b * seq + start) * e..(b * seq + start + len) * e;
                self.forward_into(&x[rows.clone()], &Call::new(1, len), &mut ws, &mut y[rows])?;
                done += len;
                progress(done);
            }
        }
        Ok(y)
    }

    /// [`LongNetEncoder::forward`] keeping every layer's cache.
    pub fn forward_train(&self, x: &[F], call: &Call<'_, F>) -> Result<(Vec<F>, EncoderCache<F>)> {
        let mut h = x.to_vec();
        let mut layers = Vec::with_capacity(self.layers.len());
        for (i, l) in self.layers.iter().enumerate() {
            let (y, c) = l.forward_train(&h, &call.with_mode(layer_mode(call.mode, i)))?;
            layers.push(c);
            h = y;
        }
        Ok((h, EncoderCache { layers }))
    }

    /// Zero gradients, one per layer.
    pub fn zero_grads(&self) -> Vec<EncoderLayerGrads<F>> {
        self.layers.iter().map(LongNetEncoderLayer::zero_grads).collect()
    }

    /// Backward through every layer; accumulates into `grads` (one per layer).
    pub fn backward(
        &self,
        cache: &EncoderCache<F>,
        grad_out: &[F],
        grads: &mut [EncoderLayerGrads<F>],
    ) -> Result<Vec<F>> {
        if cache.layers.len() != self.layers.len() || grads.len() != self.layers.len() {
            return Err(AttnError::InvalidArgument("cache or gradients do not match the stack".into()));
        }
        let mut g = grad_out.to_vec();
        for ((l, c), gr) in self.layers.iter().zip(&cache.layers).zip(grads.iter_mut()).rev() {
            g = l.backward(c, &g, gr)?;
        }
        Ok(g)
    }
}

impl<F: LayerFloat> NamedParams<F> for LongNetEncoder<F> {
    fn params_with_prefix<'a>(&'a self, prefix: &str, out: &mut Vec<Param<'a, F>>) {
        for (i, l) in self.layers.iter().enumerate() {
            l.params_with_prefix(&format!("{prefix}layers.{i}."), out);
        }
    }
    fn params_mut_with_prefix<'a>(&'a mut self, prefix: &str, out: &mut Vec<ParamMut<'a, F>>) {
        for (i, l) in self.layers.iter_mut().enumerate() {
            l.params_mut_with_prefix(&format!("{prefix}layers.{i}."), out);
        }
    }
}
