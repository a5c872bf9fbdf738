//! `MultiheadDilatedAttention`: fused QKV projection, dilated attention on a backend, sub-LN, output projection; forward and backward.

use std::sync::Arc;

use attn_core::error::TensorName;
use attn_core::{
    Attention, AttnError, AttnInputs, DilatedConfig, Masks, OwnedMasks, Result, Shape4, TensorView, TensorViewMut,
};

use crate::call::{Call, Cross};
use crate::config::MultiheadConfig;
use crate::dropout::{DropoutSite, MaskRows, Mode, apply_mask, dropout_mask};
use crate::float::LayerFloat;
use crate::layer_norm::NormStats;
use crate::projection::{LinearRef, linear_forward};
use crate::qk_pre::QkPre;
use crate::segment_window::{DEFAULT_WINDOW_ROWS, window_rows, windows};
use crate::sparse_projection::{QkvInput, project_qkv};
use crate::weights::MultiheadWeights;
use crate::workspace::{MultiheadWorkspace, SelectionKey, sized};

mod backward;
mod qk_norm;
#[cfg(test)]
mod workspace_reuse;

/// The projected q, k, v: one fused `[b, s, h + 2 kv_h, d]` buffer for self-attention,
/// or q `[b, n, h, d]` and a fused kv `[b, m, 2 kv_h, d]` for cross-attention.
#[derive(Debug, Clone)]
enum Projected<F> {
    Fused(Vec<F>),
    Split { q: Vec<F>, kv: Vec<F> },
}

/// A borrowed [`Projected`].
#[derive(Debug, Clone, Copy)]
enum ProjectedRef<'a, F> {
    Fused(&'a [F]),
    Split { q: &'a [F], kv: &'a [F] },
}

impl<F> Projected<F> {
    fn as_ref(&self) -> ProjectedRef<'_, F> {
        match self {
            Projected::Fused(qkv) => ProjectedRef::Fused(qkv),
            Projected::Split { q, kv } => ProjectedRef::Split { q, kv },
        }
    }
}

/// Where a pass's projections are: `ws.qkv` holds the fused q/k/v (self-attention),
/// or q with k/v in `ws.kv` (cross-attention).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProjLayout {
    Fused,
    Split,
}

/// One attention pass of the layer: q and k/v shapes, where the projections are, the
/// mode and the call's masks.
#[derive(Debug, Clone, Copy)]
struct AttnPass<'a> {
    qs: Shape4,
    kvs: Shape4,
    layout: ProjLayout,
    mode: Mode,
    masks: Masks<'a>,
}

/// What a forward pass made besides the buffers of its workspace.
struct Kept<F: LayerFloat> {
    mask: Option<Vec<F>>,
    norm_stats: Option<NormStats<F::Acc>>,
    layout: ProjLayout,
    masks: OwnedMasks,
}

impl<F: LayerFloat> Kept<F> {
    /// Whether the output projection read `ws.pre_out` (dropout or sub-LN applied), else `ws.attn`.
    fn pre_out_used(&self) -> bool {
        self.mask.is_some() || self.norm_stats.is_some()
    }

    /// The backward's cache, taking the buffers of a workspace made for this pass.
    fn into_cache(
        self,
        q_shape: Shape4,
        kv_shape: Shape4,
        inputs: Inputs<F>,
        ws: MultiheadWorkspace<F>,
        qk_pre: Option<QkPre<F>>,
    ) -> MultiheadCache<F> {
        let pre_out = self.pre_out_used().then_some(ws.pre_out);
        let projected = match self.layout {
            ProjLayout::Fused => Projected::Fused(ws.qkv),
            ProjLayout::Split => Projected::Split { q: ws.qkv, kv: ws.kv },
        };
        MultiheadCache {
            q_shape,
            kv_shape,
            inputs,
            projected,
            attn: ws.attn,
            lse: ws.lse,
            mask: self.mask,
            norm_stats: self.norm_stats,
            pre_out,
            masks: self.masks,
            qk_pre,
        }
    }
}

#[derive(Debug, Clone)]
enum Inputs<F> {
    SelfAttn(Vec<F>),
    Cross { query: Vec<F>, key: Vec<F>, value: Vec<F> },
}

/// What `backward` needs from a training forward pass.
#[derive(Debug, Clone)]
pub struct MultiheadCache<F: LayerFloat> {
    q_shape: Shape4,
    kv_shape: Shape4,
    inputs: Inputs<F>,
    projected: Projected<F>,
    attn: Vec<F>,
    lse: Vec<f32>,
    mask: Option<Vec<F>>,
    norm_stats: Option<NormStats<F::Acc>>,
    /// Input of the output projection; `None` when it is `attn` itself (no dropout, no sub-LN).
    pre_out: Option<Vec<F>>,
    /// The key padding and packed sequences of the pass.
    masks: OwnedMasks,
    /// q and k before `q_ln` and `k_ln` (qk-LN only).
    qk_pre: Option<QkPre<F>>,
}

/// Gradients of the layer inputs. For self-attention `key` and `value` are `None`
/// and `query` is the whole gradient of `x`.
#[derive(Debug, Clone, PartialEq)]
pub struct InputGrads<F> {
    pub query: Vec<F>,
    pub key: Option<Vec<F>>,
    pub value: Option<Vec<F>>,
}

/// Multihead dilated attention (MAGNETO / LongNet layout, SPEC.md "Multihead").
#[derive(Debug, Clone)]
pub struct MultiheadDilatedAttention<F: LayerFloat> {
    config: MultiheadConfig,
    pub weights: MultiheadWeights<F>,
    backend: Arc<dyn Attention<F>>,
    /// Target rows of a segment window (`segment_window`); 0 walks the whole sequence at once.
    window_rows: usize,
}

fn check_input<F>(name: &'static str, x: &[F], batch: usize, seq: usize, embed: usize) -> Result<()> {
    let tensor = TensorName::Other(name);
    for (d, dim) in [(batch, "batch"), (seq, "seq")] {
        if d == 0 {
            return Err(AttnError::ZeroDim { tensor, dim });
        }
    }
    let n = batch
        .checked_mul(seq)
        .and_then(|r| r.checked_mul(embed))
        .ok_or_else(|| AttnError::ShapeOverflow { tensor, dims: vec![batch, seq, embed] })?;
    if x.len() != n {
        return Err(AttnError::ShapeMismatch { tensor, expected: vec![batch, seq, embed], got: vec![x.len()] });
    }
    Ok(())
}

impl<F: LayerFloat> MultiheadDilatedAttention<F> {
    /// A layer with MAGNETO-initialised weights from `seed`.
    pub fn new(config: MultiheadConfig, seed: u64, backend: Arc<dyn Attention<F>>) -> Result<Self> {
        config.validate()?;
        let weights = MultiheadWeights::magneto(&config, seed);
        Self::from_weights(config, weights, backend)
    }

    /// A layer with the given weights (their layout must match the config).
    pub fn from_weights(
        config: MultiheadConfig,
        weights: MultiheadWeights<F>,
        backend: Arc<dyn Attention<F>>,
    ) -> Result<Self> {
        config.validate()?;
        weights.check_layout(&config, "weights")?;
        Ok(MultiheadDilatedAttention { config, weights, backend, window_rows: DEFAULT_WINDOW_ROWS })
    }

    /// Zero gradients with this layer's weight layout.
    pub fn zero_grads(&self) -> MultiheadWeights<F> {
        self.weights.zeros_like()
    }

    pub fn config(&self) -> &MultiheadConfig {
        &self.config
    }
    /// The attention the layer runs (`config().attention`).
    pub fn dilated_config(&self) -> &DilatedConfig {
        &self.config.attention
    }
    pub fn backend(&self) -> &Arc<dyn Attention<F>> {
        &self.backend
    }
    /// Run on another attention backend (same weights).
    pub fn with_backend(mut self, backend: Arc<dyn Attention<F>>) -> Self {
        self.backend = backend;
        self
    }

    /// Walk long sequences in windows of at least `rows` rows, rounded up to a multiple
    /// of every segment length (default [`DEFAULT_WINDOW_ROWS`]; 0 makes one pass over
    /// the whole sequence): inference passes ([`Self::forward`] and
    /// [`Self::forward_into`] in [`Mode::Eval`]) and the backward of self-attention, on
    /// one device. The result is the same function (see [`crate::segment_window`]); the
    /// intermediate and gradient buffers hold one window. [`Self::forward_train`] keeps
    /// every row, since the backward reads them.
    pub fn with_window_rows(mut self, rows: usize) -> Self {
        self.set_window_rows(rows);
        self
    }

    /// [`Self::with_window_rows`] in place.
    pub fn set_window_rows(&mut self, rows: usize) {
        self.window_rows = rows;
    }

    /// The window target set by [`Self::with_window_rows`] (0: one pass).
    pub fn window_rows(&self) -> usize {
        self.window_rows
    }

    /// The rows an inference pass over `seq` rows walks at a time, if it walks in windows
    /// (not with masks, which cover the whole sequence, nor with a sliding window).
    fn forward_window(&self, seq: usize, mode: Mode, masks: &Masks<'_>) -> Result<Option<usize>> {
        if mode != Mode::Eval
            || !self.backend.placement().is_whole()
            || !masks.is_none()
            || self.config.attention.window().is_some()
        {
            return Ok(None);
        }
        Ok(window_rows(self.config.attention.segment_lengths(), seq, self.window_rows))
    }

    /// The rows of a `[batch, seq, ..]` activation for dropout masks: their global
    /// positions come from the backend (a ring rank's rows), and are only looked up
    /// in training mode.
    pub(crate) fn mask_rows(&self, mode: Mode, batch: usize, seq: usize) -> Result<MaskRows> {
        let positions = match mode {
            Mode::Eval => Vec::new(),
            Mode::Train { .. } => self.backend.query_positions(seq)?,
        };
        Ok(MaskRows { batch, positions })
    }

    fn shape(&self, batch: usize, seq: usize) -> Result<Shape4> {
        Shape4::new(batch, seq, self.config.num_heads, self.config.head_dim())
    }

    /// The key/value shape: `num_kv_heads` heads.
    fn kv_shape(&self, batch: usize, seq: usize) -> Result<Shape4> {
        Shape4::new(batch, seq, self.config.num_kv_heads, self.config.head_dim())
    }

    /// The layer over `x` (the queries, `[call.batch, call.seq, embed]`) as `call`
    /// says (mode, masks, cross-attention keys); returns the output only.
    pub fn forward(&self, x: &[F], call: &Call<'_, F>) -> Result<Vec<F>> {
        let mut y = attn_kernels::zeroed_buffer(x.len())?;
        self.forward_into(x, call, &mut MultiheadWorkspace::new(), &mut y)?;
        Ok(y)
    }

    /// [`Self::forward`] into the caller's `out` (`[batch, seq, embed]`), with every
    /// intermediate buffer in `ws`: repeated calls with the same shapes allocate nothing
    /// (dropout masks in training mode, and qk-LN's copies of q and k before their norms, aside).
    pub fn forward_into(
        &self,
        x: &[F],
        call: &Call<'_, F>,
        ws: &mut MultiheadWorkspace<F>,
        out: &mut [F],
    ) -> Result<()> {
        let (batch, seq, e) = (call.batch, call.seq, self.config.embed_dim);
        let masks = call.masks;
        if let Some(cross) = call.cross {
            let (qs, kvs, _) = self.project_cross(x, cross, [batch, seq], ws)?;
            self.finish_forward(AttnPass { qs, kvs, layout: ProjLayout::Split, mode: call.mode, masks }, ws, out)?;
            return Ok(());
        }
        check_input("query", x, batch, seq, e)?;
        let pass = |qs: Shape4| -> Result<AttnPass<'_>> {
            let kvs = self.kv_shape(qs.batch, qs.seq)?;
            Ok(AttnPass { qs, kvs, layout: ProjLayout::Fused, mode: call.mode, masks })
        };
        let Some(window) = self.forward_window(seq, call.mode, &masks)? else {
            let (shape, _) = self.project_self(x, [batch, seq], &masks, ws)?;
            self.finish_forward(pass(shape)?, ws, out)?;
            return Ok(());
        };
        check_input("output", out, batch, seq, e)?;
        for b in 0..batch {
            for (start, len) in windows(seq, window) {
                let rows = (b * seq + start) * e..(b * seq + start + len) * e;
                let (shape, _) = self.project_self(&x[rows.clone()], [1, len], &Masks::NONE, ws)?;
                self.finish_forward(pass(shape)?, ws, &mut out[rows])?;
            }
        }
        Ok(())
    }

    /// [`Self::forward`] keeping what [`Self::backward`] needs (the inputs, the
    /// projections, the attention output and statistics, dropout masks, the call's
    /// masks). Every row is kept, so the pass never walks in windows.
    pub fn forward_train(&self, x: &[F], call: &Call<'_, F>) -> Result<(Vec<F>, MultiheadCache<F>)> {
        let (batch, seq) = (call.batch, call.seq);
        let mut ws = MultiheadWorkspace::new();
        let (qs, kvs, layout, inputs, qk_pre) = match call.cross {
            None => {
                let (qs, pre) = self.project_self(x, [batch, seq], &call.masks, &mut ws)?;
                (qs, self.kv_shape(batch, seq)?, ProjLayout::Fused, Inputs::SelfAttn(x.to_vec()), pre)
            }
            Some(c) => {
                let (qs, kvs, pre) = self.project_cross(x, c, [batch, seq], &mut ws)?;
                let inputs = Inputs::Cross { query: x.to_vec(), key: c.key.to_vec(), value: c.value.to_vec() };
                (qs, kvs, ProjLayout::Split, inputs, pre)
            }
        };
        let mut y = attn_kernels::zeroed_buffer(x.len())?;
        let pass = AttnPass { qs, kvs, layout, mode: call.mode, masks: call.masks };
        let kept = self.finish_forward(pass, &mut ws, &mut y)?;
        Ok((y, kept.into_cache(qs, kvs, inputs, ws, qk_pre)))
    }

    /// Whether k and v have fewer heads than q.
    fn grouped(&self) -> bool {
        self.config.num_kv_heads != self.config.num_heads
    }

    /// Columns of the fused projection: q, k and v together.
    fn qkv_dim(&self) -> usize {
        self.config.embed_dim + 2 * self.config.kv_dim()
    }

    /// Whether the input projection may project only the rows each head group selects:
    /// the whole sequence on one device, without grouped heads, windows or packing (whose
    /// selection is relative to each sequence), nor qk-LN (whose `q_ln` and `k_ln` read
    /// every head of a row).
    fn sparse_projection(&self, masks: &Masks<'_>) -> bool {
        self.backend.placement().is_whole()
            && self.qk_norms().is_none()
            && !self.grouped()
            && self.config.attention.window().is_none()
            && masks.packing.is_none()
    }

    /// The fused q/k/v projection of `x` into `ws.qkv`, for a call with `masks`, with
    /// qk-LN's norms applied (returning q and k as they were before them).
    fn project_self(
        &self,
        x: &[F],
        [batch, seq]: [usize; 2],
        masks: &Masks<'_>,
        ws: &mut MultiheadWorkspace<F>,
    ) -> Result<(Shape4, Option<QkPre<F>>)> {
        let e = self.config.embed_dim;
        check_input("query", x, batch, seq, e)?;
        self.weights.check_layout(&self.config, "weights")?;
        let shape = self.shape(batch, seq)?;
        let len = (batch * seq).checked_mul(self.qkv_dim()).ok_or_else(|| AttnError::ShapeOverflow {
            tensor: TensorName::Other("qkv"),
            dims: vec![batch, seq, self.qkv_dim()],
        })?;
        let w = &self.weights.in_proj;
        let (heads, head_dim) = (self.config.num_heads, self.config.head_dim());
        if self.sparse_projection(masks) {
            // The whole sequence on one device: each head group projects only the rows
            // its pattern selects.
            let key = SelectionKey { cfg: self.config.attention.clone(), heads, head_dim, batch, seq };
            let qkv = ws.projection_buffer(len, Some(key))?;
            let input = QkvInput { cfg: &self.config.attention, heads, head_dim, x, batch, seq };
            project_qkv(&input, &w.weight, w.bias.as_deref(), qkv)?;
        } else {
            // A ring rank's rows (their global positions decide the selection), grouped
            // heads or a window: dense.
            let (qkv, cols) = (ws.projection_buffer(len, None)?, self.qkv_dim());
            linear_forward(
                LinearRef { weight: &w.weight, bias: w.bias.as_deref(), in_dim: e, out_dim: cols },
                x,
                batch * seq,
                qkv,
                cols,
            )?;
        }
        Ok((shape, self.normalize_qk(ws, ProjLayout::Fused)?))
    }

    /// The q projection of `query` into `ws.qkv` and the k/v projections of `cross`
    /// into `ws.kv` (cross-attention), with qk-LN's norms applied; returns the q and k/v
    /// shapes (and q and k as they were before the norms).
    fn project_cross(
        &self,
        query: &[F],
        cross: Cross<'_, F>,
        [batch, q_seq]: [usize; 2],
        ws: &mut MultiheadWorkspace<F>,
    ) -> Result<(Shape4, Shape4, Option<QkPre<F>>)> {
        let (e, kv_seq) = (self.config.embed_dim, cross.kv_seq());
        check_input("query", query, batch, q_seq, e)?;
        check_input("key", cross.key, batch, kv_seq, e)?;
        check_input("value", cross.value, batch, kv_seq, e)?;
        self.weights.check_layout(&self.config, "weights")?;
        let (qs, kvs) = (self.shape(batch, q_seq)?, self.kv_shape(batch, kv_seq)?);
        let kvd = self.config.kv_dim();
        let q = ws.projection_buffer(batch * q_seq * e, None)?;
        linear_forward(self.in_proj_part(0), query, batch * q_seq, q, e)?;
        let kv = sized(&mut ws.kv, batch * kv_seq * 2 * kvd)?;
        linear_forward(self.in_proj_part(1), cross.key, batch * kv_seq, kv, 2 * kvd)?;
        linear_forward(self.in_proj_part(2), cross.value, batch * kv_seq, &mut kv[kvd..], 2 * kvd)?;
        Ok((qs, kvs, self.normalize_qk(ws, ProjLayout::Split)?))
    }

    /// Part `i` (q, k or v) of the input projection as a linear map.
    pub(crate) fn in_proj_part(&self, i: usize) -> LinearRef<'_, F> {
        let (e, w) = (self.config.embed_dim, &self.weights.in_proj);
        let rows = self.weights.part_rows();
        let start: usize = rows[..i].iter().sum();
        let (lo, hi) = (start, start + rows[i]);
        LinearRef {
            weight: &w.weight[(lo * e).min(w.weight.len())..(hi * e).min(w.weight.len())],
            bias: w.bias.as_ref().map(|b| &b[lo.min(b.len())..hi.min(b.len())]),
            in_dim: e,
            out_dim: rows[i],
        }
    }

    fn views<'a>(&self, projected: ProjectedRef<'a, F>, qs: Shape4, kvs: Shape4) -> Result<[TensorView<'a, F>; 3]> {
        let (e, kvd) = (self.config.embed_dim, self.config.kv_dim());
        let at = |x: &'a [F], start: usize| &x[start.min(x.len())..];
        match projected {
            ProjectedRef::Fused(qkv) if !self.grouped() => TensorView::fused_qkv(qkv, qs),
            ProjectedRef::Fused(qkv) => {
                // Rows of `[q (e) | k (kvd) | v (kvd)]`.
                let row = e + 2 * kvd;
                let (qst, kst) = ([qs.seq * row, row, qs.head_dim, 1], [kvs.seq * row, row, kvs.head_dim, 1]);
                Ok([
                    TensorView::strided(TensorName::Query, qkv, qs, qst)?,
                    TensorView::strided(TensorName::Key, at(qkv, e), kvs, kst)?,
                    TensorView::strided(TensorName::Value, at(qkv, e + kvd), kvs, kst)?,
                ])
            }
            ProjectedRef::Split { q, kv } => {
                let strides = [kvs.seq * 2 * kvd, 2 * kvd, kvs.head_dim, 1];
                Ok([
                    TensorView::contiguous(TensorName::Query, q, qs)?,
                    TensorView::strided(TensorName::Key, kv, kvs, strides)?,
                    TensorView::strided(TensorName::Value, at(kv, kvd), kvs, strides)?,
                ])
            }
        }
    }

    /// Attention over the projections in `ws` (`ws.qkv` fused, or q in `ws.qkv` and kv
    /// in `ws.kv`), dropout, sub-LN and the output projection into `out`.
    fn finish_forward(&self, pass: AttnPass<'_>, ws: &mut MultiheadWorkspace<F>, out: &mut [F]) -> Result<Kept<F>> {
        let AttnPass { qs, kvs, layout, mode, masks } = pass;
        let rows = qs.batch * qs.seq;
        let e = self.config.embed_dim;
        if out.len() != qs.numel() {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Output,
                expected: vec![qs.batch, qs.seq, e],
                got: vec![out.len()],
            });
        }
        let attn = sized(&mut ws.attn, qs.numel())?;
        let lse = sized(&mut ws.lse, qs.lse_len())?;
        {
            let projected = match layout {
                ProjLayout::Fused => ProjectedRef::Fused(&ws.qkv),
                ProjLayout::Split => ProjectedRef::Split { q: &ws.qkv, kv: &ws.kv },
            };
            let [q, k, v] = self.views(projected, qs, kvs)?;
            let attn_view = TensorViewMut::contiguous(TensorName::Output, attn, qs)?;
            self.backend.forward(
                &AttnInputs::new(&self.config.attention, q, k, v).with_masks(masks),
                attn_view,
                lse,
            )?;
        }
        let rows_at = self.mask_rows(mode, qs.batch, qs.seq)?;
        let mask = dropout_mask(mode, self.config.dropout, DropoutSite::Attention, &rows_at, e);
        let norm_stats = match &self.weights.norm {
            Some(norm) => {
                let src = apply_mask(&ws.attn, mask.as_deref());
                Some(norm.forward_into(&src, sized(&mut ws.pre_out, qs.numel())?)?)
            }
            None => {
                if let Some(m) = &mask {
                    let dst = sized(&mut ws.pre_out, qs.numel())?;
                    dst.iter_mut().zip(&ws.attn).zip(m).for_each(|((d, &a), &k)| *d = a * k);
                }
                None
            }
        };
        let kept = Kept { mask, norm_stats, layout, masks: OwnedMasks::from(masks) };
        let pre_out = if kept.pre_out_used() { &ws.pre_out } else { &ws.attn };
        self.weights.out_proj.forward_into(pre_out, rows, out)?;
        Ok(kept)
    }
}
