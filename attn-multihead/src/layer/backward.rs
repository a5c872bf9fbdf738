//! The layer's backward pass: output projection, sub-LN and dropout, attention, input
//! projections. Self-attention on one device walks the sequence in the same segment
//! windows as inference (`segment_window`), so its gradient buffers hold one window.

use std::ops::Range;

use attn_core::error::TensorName;
use attn_core::{AttnInputs, Grads, Result, Saved, Shape4, TensorView, TensorViewMut};

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
        let one_device = self.backend.placement().is_whole();
        if let (Inputs::SelfAttn(x), Projected::Fused(qkv), true) = (&cache.inputs, &cache.projected, one_device)
            && let Some(window) = window_rows(&self.config.segment_lengths, qs.seq, self.window_rows)
        {
            return self.backward_in_windows(cache, x, qkv, grad_out, grads, window);
        }
        let d_attn = self.attention_output_grad(cache, 0..rows, grad_out, grads)?;
        let mut dq = attn_kernels::zeroed_buffer(qs.numel())?;
        let mut dk = attn_kernels::zeroed_buffer(kvs.numel())?;
        let mut dv = attn_kernels::zeroed_buffer(kvs.numel())?;
        let (attn, lse) = (&cache.attn[..], &cache.lse[..]);
        self.attention_grads(cache.projected.as_ref(), attn, lse, &d_attn, [qs, kvs], [&mut dq, &mut dk, &mut dv])?;
        match &cache.inputs {
            Inputs::SelfAttn(x) => {
                let mut dx = attn_kernels::zeroed_buffer(rows * e)?;
                self.self_input_grads(x, [qs.batch, qs.seq], one_device, [&dq, &dk, &dv], grads, &mut dx)?;
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
                    linear_backward_input(
                        LinearRef { weight: self.in_proj_part(i), bias: None, in_dim: e, out_dim: e },
                        (dy, e),
                        r,
                        dx,
                        false,
                    )?;
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
        let (e, heads) = (self.config.embed_dim, self.config.num_heads);
        let mut dx = attn_kernels::zeroed_buffer(qs.batch * qs.seq * e)?;
        let mut dqkv: [Vec<F>; 3] = Default::default();
        for b in 0..qs.batch {
            for (start, len) in windows(qs.seq, window) {
                let rows = b * qs.seq + start..b * qs.seq + start + len;
                let el = rows.start * e..rows.end * e;
                let d_attn = self.attention_output_grad(cache, rows.clone(), &grad_out[el.clone()], grads)?;
                let shape = Shape4::new(1, len, heads, self.config.head_dim())?;
                for d in dqkv.iter_mut() {
                    sized(d, len * e)?.fill(F::zero());
                }
                let [dq, dk, dv] = &mut dqkv;
                let fused = ProjectedRef::Fused(&qkv[3 * el.start..3 * el.end]);
                let lse = &cache.lse[rows.start * heads..rows.end * heads];
                self.attention_grads(fused, &cache.attn[el.clone()], lse, &d_attn, [shape, shape], [dq, dk, dv])?;
                let d = [&dqkv[0][..], &dqkv[1][..], &dqkv[2][..]];
                self.self_input_grads(&x[el.clone()], [1, len], true, d, grads, &mut dx[el])?;
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

    /// Attention backward on the backend into zeroed `d = [dq, dk, dv]`.
    fn attention_grads(
        &self,
        projected: ProjectedRef<'_, F>,
        attn: &[F],
        lse: &[f32],
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
        self.backend.backward(&AttnInputs::new(&self.dilated, q, k, v), Saved { out, lse }, go, grads)
    }

    /// Input projection backward of self-attention over `x: [batch, seq, embed]` into
    /// the zeroed `dx`. On one device (`one_device`) with head groups only each group's
    /// selected rows carry gradient, so only they enter the products.
    fn self_input_grads(
        &self,
        x: &[F],
        [batch, seq]: [usize; 2],
        one_device: bool,
        d: [&[F]; 3],
        grads: &mut MultiheadWeights<F>,
        dx: &mut [F],
    ) -> Result<()> {
        let (e, heads, hd) = (self.config.embed_dim, self.config.num_heads, self.config.head_dim());
        let w = &self.weights.in_proj.weight;
        let g = &mut grads.in_proj;
        if one_device {
            let input = QkvInput { cfg: &self.dilated, heads, head_dim: hd, x, batch, seq };
            let grad = LinearGrad { dweight: &mut g.weight, dbias: g.bias.as_deref_mut(), in_dim: e, out_dim: 3 * e };
            if project_qkv_backward(&input, w, d, grad, dx)? == SparseBackward::Done {
                return Ok(());
            }
        }
        let rows = batch * seq;
        self.in_proj_param_grads([x, x, x], [rows; 3], d, grads)?;
        for (i, dy) in d.iter().enumerate() {
            linear_backward_input(
                LinearRef { weight: self.in_proj_part(i), bias: None, in_dim: e, out_dim: e },
                (dy, e),
                rows,
                dx,
                i > 0,
            )?;
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
        let g = &mut grads.in_proj;
        let mut gb: Vec<Option<&mut [F]>> = match &mut g.bias {
            Some(b) => b.chunks_mut(e).map(Some).collect(),
            None => vec![None, None, None],
        };
        for (i, gw) in g.weight.chunks_mut(e * e).enumerate() {
            linear_backward_params(
                LinearGrad { dweight: gw, dbias: gb[i].take(), in_dim: e, out_dim: e },
                (d[i], e),
                rows[i],
                inputs[i],
            )?;
        }
        Ok(())
    }

    /// Rows `i * E..(i + 1) * E` of the input projection weight: q, k or v's.
    fn in_proj_part(&self, i: usize) -> &[F] {
        let e = self.config.embed_dim;
        &self.weights.in_proj.weight[i * e * e..(i + 1) * e * e]
    }
}
