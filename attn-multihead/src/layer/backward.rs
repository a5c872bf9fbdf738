//! The layer's backward pass: output projection, sub-LN and dropout, attention, qk-LN's
//! norms, input projections. Self-attention on one device walks the sequence in the same segment
//! windows as inference (`segment_window`), so its gradient buffers hold one window.

use std::ops::Range;

use attn_core::error::TensorName;
use attn_core::{AttnInputs, Grads, Masks, Result, Saved, Shape4, TensorView, TensorViewMut};

use super::{InputGrads, Inputs, MultiheadCache, MultiheadDilatedAttention, Projected, ProjectedRef, check_input};
use crate::dropout::apply_mask;
use crate::float::LayerFloat;
use crate::layer_norm::NormStats;
use crate::projection::{LinearGrad, LinearRef, linear_backward_input, linear_backward_params};
use crate::segment_window::{window_rows, windows};
use crate::sparse_projection::{QkvInput, SparseBackward, project_qkv_backward};
use crate::weights::MultiheadWeights;
use crate::workspace::sized;

impl<F: LayerFloat> MultiheadDilatedAttention<F> {
    /// Gradients of `sum(out * grad_out)`: accumulates every weight gradient into
    /// `grads` (same layout as the weights) and returns the input gradients.
    pub fn backward(
        &self,
        cache: &MultiheadCache<F>,
        grad_out: &[F],
        grads: &mut MultiheadWeights<F>,
    ) -> Result<InputGrads<F>> {
        let (qs, kvs) = (cache.q_shape, cache.kv_shape);
        let e = self.config.embed_dim;
        let rows = qs.batch * qs.seq;
        let kv_rows = kvs.batch * kvs.seq;
        check_input("grad_out", grad_out, qs.batch, qs.seq, e)?;
        self.weights.check_layout(&self.config, "weights")?;
        grads.check_layout(&self.config, "gradient accumulator")?;
        let masks = cache.masks.view();
        // Windows of whole segments: one device, no masks (they cover the whole
        // sequence), no sliding window.
        let windowed =
            self.backend.placement().is_whole() && masks.is_none() && self.config.attention.window().is_none();
        if let (Inputs::SelfAttn(x), Projected::Fused(qkv), true) = (&cache.inputs, &cache.projected, windowed)
            && let Some(window) = window_rows(self.config.attention.segment_lengths(), qs.seq, self.window_rows)
        {
            return self.backward_in_windows(cache, x, qkv, grad_out, grads, window);
        }
        let d_attn = self.attention_output_grad(cache, 0..rows, grad_out, grads)?;
        let mut dq = attn_kernels::zeroed_buffer(qs.numel())?;
        let mut dk = attn_kernels::zeroed_buffer(kvs.numel())?;
        let mut dv = attn_kernels::zeroed_buffer(kvs.numel())?;
        let saved = (&cache.attn[..], &cache.lse[..]);
        let projected = cache.projected.as_ref();
        self.attention_grads((projected, masks), saved, &d_attn, [qs, kvs], [&mut dq, &mut dk, &mut dv])?;
        self.qk_norm_backward(cache.qk_pre.as_ref(), [0..rows, 0..kv_rows], [&mut dq, &mut dk], grads)?;
        match &cache.inputs {
            Inputs::SelfAttn(x) => {
                let mut dx = attn_kernels::zeroed_buffer(rows * e)?;
                let sparse = self.sparse_projection(&masks);
                self.self_input_grads(x, [qs.batch, qs.seq], sparse, [&dq, &dk, &dv], grads, &mut dx)?;
                Ok(InputGrads { query: dx, key: None, value: None })
            }
            Inputs::Cross { query, key, value } => {
                let d = [&dq[..], &dk[..], &dv[..]];
                self.in_proj_param_grads([query, key, value], [rows, kv_rows, kv_rows], d, grads)?;
                let mut out = [
                    attn_kernels::zeroed_buffer(rows * e)?,
                    attn_kernels::zeroed_buffer(kv_rows * e)?,
                    attn_kernels::zeroed_buffer(kv_rows * e)?,
                ];
                for (i, ((dy, r), dx)) in d.iter().zip([rows, kv_rows, kv_rows]).zip(out.iter_mut()).enumerate() {
                    let part = LinearRef { bias: None, ..self.in_proj_part(i) };
                    linear_backward_input(part, (dy, part.out_dim), r, dx, false)?;
                }
                let [query, key, value] = out;
                Ok(InputGrads { query, key: Some(key), value: Some(value) })
            }
        }
    }

    /// Self-attention on one device, one window of whole segments at a time: each
    /// window's gradients need only its own rows (attention never crosses a segment
    /// edge), and its dq/dk/dv buffers are reused window after window.
    fn backward_in_windows(
        &self,
        cache: &MultiheadCache<F>,
        x: &[F],
        qkv: &[F],
        grad_out: &[F],
        grads: &mut MultiheadWeights<F>,
        window: usize,
    ) -> Result<InputGrads<F>> {
        let qs = cache.q_shape;
        let (e, heads, kvd, cols) =
            (self.config.embed_dim, self.config.num_heads, self.config.kv_dim(), self.qkv_dim());
        let mut dx = attn_kernels::zeroed_buffer(qs.batch * qs.seq * e)?;
        let mut dqkv: [Vec<F>; 3] = Default::default();
        let sparse = self.sparse_projection(&Masks::NONE);
        for b in 0..qs.batch {
            for (start, len) in windows(qs.seq, window) {
                let rows = b * qs.seq + start..b * qs.seq + start + len;
                let el = rows.start * e..rows.end * e;
                let d_attn = self.attention_output_grad(cache, rows.clone(), &grad_out[el.clone()], grads)?;
                let shape = Shape4::new(1, len, heads, self.config.head_dim())?;
                let kv_shape = Shape4::new(1, len, self.config.num_kv_heads, self.config.head_dim())?;
                for (d, width) in dqkv.iter_mut().zip([e, kvd, kvd]) {
                    sized(d, len * width)?.fill(F::zero());
                }
                let [dq, dk, dv] = &mut dqkv;
                let fused = ProjectedRef::Fused(&qkv[rows.start * cols..rows.end * cols]);
                let saved = (&cache.attn[el.clone()], &cache.lse[rows.start * heads..rows.end * heads]);
                self.attention_grads((fused, Masks::NONE), saved, &d_attn, [shape, kv_shape], [dq, dk, dv])?;
                self.qk_norm_backward(cache.qk_pre.as_ref(), [rows.clone(), rows.clone()], [dq, dk], grads)?;
                let d = [&dqkv[0][..], &dqkv[1][..], &dqkv[2][..]];
                self.self_input_grads(&x[el.clone()], [1, len], sparse, d, grads, &mut dx[el])?;
            }
        }
        Ok(InputGrads { query: dx, key: None, value: None })
    }

    /// Gradient of the attention output for cache rows `rows` (`grad_out` holds just
    /// those rows): output projection, sub-LN and dropout backward, accumulating
    /// their weight gradients.
    fn attention_output_grad(
        &self,
        cache: &MultiheadCache<F>,
        rows: Range<usize>,
        grad_out: &[F],
        grads: &mut MultiheadWeights<F>,
    ) -> Result<Vec<F>> {
        let e = self.config.embed_dim;
        let el = rows.start * e..rows.end * e;
        let pre_out = &cache.pre_out.as_deref().unwrap_or(&cache.attn)[el.clone()];
        let d_pre = self.weights.out_proj.backward(pre_out, rows.len(), grad_out, &mut grads.out_proj)?;
        let mask = cache.mask.as_deref().map(|m| &m[el.clone()]);
        let mut d_attn = match (&self.weights.norm, &cache.norm_stats, &mut grads.norm) {
            (Some(norm), Some(st), Some(gn)) => {
                let st = NormStats { mean: st.mean[rows.clone()].to_vec(), rstd: st.rstd[rows].to_vec() };
                norm.backward(&apply_mask(&cache.attn[el], mask), &st, &d_pre, gn)?
            }
            _ => d_pre,
        };
        if let Some(m) = mask {
            d_attn.iter_mut().zip(m).for_each(|(g, &k)| *g *= k);
        }
        Ok(d_attn)
    }

    /// Attention backward on the backend (the projections and the pass's masks; the
    /// saved output and LSE) into zeroed `d = [dq, dk, dv]`.
    fn attention_grads(
        &self,
        (projected, masks): (ProjectedRef<'_, F>, Masks<'_>),
        (attn, lse): (&[F], &[f32]),
        grad_attn: &[F],
        [qs, kvs]: [Shape4; 2],
        [dq, dk, dv]: [&mut [F]; 3],
    ) -> Result<()> {
        let [q, k, v] = self.views(projected, qs, kvs)?;
        let out = TensorView::contiguous(TensorName::Output, attn, qs)?;
        let go = TensorView::contiguous(TensorName::GradOutput, grad_attn, qs)?;
        let grads = Grads {
            dq: TensorViewMut::contiguous(TensorName::GradQuery, dq, qs)?,
            dk: TensorViewMut::contiguous(TensorName::GradKey, dk, kvs)?,
            dv: TensorViewMut::contiguous(TensorName::GradValue, dv, kvs)?,
        };
        let inputs = AttnInputs::new(&self.config.attention, q, k, v).with_masks(masks);
        self.backend.backward(&inputs, Saved { out, lse }, go, grads)
    }

    /// Input projection backward of self-attention over `x: [batch, seq, embed]` into
    /// the zeroed `dx`. Where the forward projected sparsely (`sparse`, see
    /// `sparse_projection`) only each head group's selected rows carry gradient, so only
    /// they enter the products.
    fn self_input_grads(
        &self,
        x: &[F],
        [batch, seq]: [usize; 2],
        sparse: bool,
        d: [&[F]; 3],
        grads: &mut MultiheadWeights<F>,
        dx: &mut [F],
    ) -> Result<()> {
        let (e, heads, hd) = (self.config.embed_dim, self.config.num_heads, self.config.head_dim());
        let w = &self.weights.in_proj.weight;
        let g = &mut grads.in_proj;
        if sparse {
            let input = QkvInput { cfg: &self.config.attention, heads, head_dim: hd, x, batch, seq };
            let grad = LinearGrad { dweight: &mut g.weight, dbias: g.bias.as_deref_mut(), in_dim: e, out_dim: 3 * e };
            if project_qkv_backward(&input, w, d, grad, dx)? == SparseBackward::Done {
                return Ok(());
            }
        }
        let rows = batch * seq;
        self.in_proj_param_grads([x, x, x], [rows; 3], d, grads)?;
        for (i, dy) in d.iter().enumerate() {
            let part = LinearRef { bias: None, ..self.in_proj_part(i) };
            linear_backward_input(part, (dy, part.out_dim), rows, dx, i > 0)?;
        }
        Ok(())
    }

    /// Accumulate the q, k and v input projections' weight (and bias) gradients from
    /// their inputs and output gradients.
    fn in_proj_param_grads(
        &self,
        inputs: [&[F]; 3],
        rows: [usize; 3],
        d: [&[F]; 3],
        grads: &mut MultiheadWeights<F>,
    ) -> Result<()> {
        let e = self.config.embed_dim;
        let parts = self.weights.part_rows();
        let g = &mut grads.in_proj;
        let (mut w_rest, mut b_rest) = (&mut g.weight[..], g.bias.as_deref_mut());
        for (i, &out) in parts.iter().enumerate() {
            let k = (out * e).min(w_rest.len());
            let (gw, wr) = std::mem::take(&mut w_rest).split_at_mut(k);
            w_rest = wr;
            let gb = match b_rest.take() {
                Some(b) => {
                    let (gb, br) = b.split_at_mut(out.min(b.len()));
                    b_rest = Some(br);
                    Some(gb)
                }
                None => None,
            };
            linear_backward_params(
                LinearGrad { dweight: gw, dbias: gb, in_dim: e, out_dim: out },
                (d[i], out),
                rows[i],
                inputs[i],
            )?;
        }
        Ok(())
    }
}
