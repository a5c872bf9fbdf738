//! `AttentionBackend`: the attention core a layer runs on (the float64 reference, the CPU kernels, ...).

use attn_core::error::TensorName;
use attn_core::reference::{dilated_backward, dilated_forward};
use attn_core::{AttnError, AttnShape, DilatedConfig, Result, TensorView, TensorViewMut};

use crate::float::LayerFloat;

/// Dilated attention over strided `[batch, seq, heads, head_dim]` views.
///
/// `lse` is `[batch, q_seq, heads]`, written by `forward` and read by `backward`.
/// `backward` writes (does not accumulate) `dq`, `dk`, `dv`.
pub trait AttentionBackend<F: LayerFloat>: Send + Sync + std::fmt::Debug {
    /// Name for reports (`reference`, `cpu`, ...).
    fn name(&self) -> &'static str;

    /// Global sequence positions of the `local_seq` query rows a layer passes (local
    /// row order), which position-dependent steps such as dropout masks use. `None`
    /// (the default): the rows are the whole sequence, `0..local_seq`.
    fn query_positions(&self, local_seq: usize) -> Result<Option<Vec<usize>>> {
        let _ = local_seq;
        Ok(None)
    }

    fn forward(
        &self,
        cfg: &DilatedConfig,
        q: TensorView<'_, F>,
        k: TensorView<'_, F>,
        v: TensorView<'_, F>,
        out: &mut TensorViewMut<'_, F>,
        lse: &mut [f32],
    ) -> Result<()>;

    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        cfg: &DilatedConfig,
        q: TensorView<'_, F>,
        k: TensorView<'_, F>,
        v: TensorView<'_, F>,
        out: TensorView<'_, F>,
        lse: &[f32],
        grad_out: TensorView<'_, F>,
        dq: &mut TensorViewMut<'_, F>,
        dk: &mut TensorViewMut<'_, F>,
        dv: &mut TensorViewMut<'_, F>,
    ) -> Result<()>;
}

/// The float64 reference of `attn-core` behind the backend interface (slow; for
/// conformance and gradient checks). Any float type is converted to f64 and back.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceBackend;

fn shapes<F: LayerFloat>(q: &TensorView<'_, F>, k: &TensorView<'_, F>, v: &TensorView<'_, F>) -> Result<AttnShape> {
    let cross = q.shape().seq != k.shape().seq;
    AttnShape::check(&q.shape().dims(), &k.shape().dims(), &v.shape().dims(), cross)
}

fn write_rows<F: LayerFloat>(dst: &mut TensorViewMut<'_, F>, src: &[f64], name: TensorName) -> Result<()> {
    let s = dst.shape();
    if src.len() != s.numel() {
        return Err(AttnError::ShapeMismatch { tensor: name, expected: vec![s.numel()], got: vec![src.len()] });
    }
    let mut rows = src.chunks_exact(s.head_dim);
    for b in 0..s.batch {
        for t in 0..s.seq {
            for h in 0..s.heads {
                if let Some(r) = rows.next() {
                    for (o, &x) in dst.row_mut(b, t, h).iter_mut().zip(r) {
                        *o = F::of(x);
                    }
                }
            }
        }
    }
    Ok(())
}

impl<F: LayerFloat> AttentionBackend<F> for ReferenceBackend {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn forward(
        &self,
        cfg: &DilatedConfig,
        q: TensorView<'_, F>,
        k: TensorView<'_, F>,
        v: TensorView<'_, F>,
        out: &mut TensorViewMut<'_, F>,
        lse: &mut [f32],
    ) -> Result<()> {
        let shape = shapes(&q, &k, &v)?;
        if out.shape() != shape.q || lse.len() != shape.q.lse_len() {
            return Err(AttnError::ShapeMismatch {
                tensor: TensorName::Output,
                expected: shape.q.dims().to_vec(),
                got: out.shape().dims().to_vec(),
            });
        }
        let f = dilated_forward(cfg, shape, &q.to_f64_vec(), &k.to_f64_vec(), &v.to_f64_vec())?;
        write_rows(out, &f.out, TensorName::Output)?;
        for (l, &x) in lse.iter_mut().zip(&f.lse) {
            *l = x as f32;
        }
        Ok(())
    }

    fn backward(
        &self,
        cfg: &DilatedConfig,
        q: TensorView<'_, F>,
        k: TensorView<'_, F>,
        v: TensorView<'_, F>,
        _out: TensorView<'_, F>,
        _lse: &[f32],
        grad_out: TensorView<'_, F>,
        dq: &mut TensorViewMut<'_, F>,
        dk: &mut TensorViewMut<'_, F>,
        dv: &mut TensorViewMut<'_, F>,
    ) -> Result<()> {
        let shape = shapes(&q, &k, &v)?;
        let (_, g) =
            dilated_backward(cfg, shape, &q.to_f64_vec(), &k.to_f64_vec(), &v.to_f64_vec(), &grad_out.to_f64_vec())?;
        write_rows(dq, &g.dq, TensorName::GradQuery)?;
        write_rows(dk, &g.dk, TensorName::GradKey)?;
        write_rows(dv, &g.dv, TensorName::GradValue)
    }
}

pub(crate) fn reborrow<'a, F: LayerFloat>(
    name: TensorName,
    v: &'a mut TensorViewMut<'_, F>,
) -> Result<TensorViewMut<'a, F>> {
    let (shape, strides) = (v.shape(), v.strides());
    TensorViewMut::strided(name, v.data_mut(), shape, strides)
}

/// The CPU kernels of `attn-kernels` (fused flash-style, f32 accumulation). Keys and
/// values with their own sequence length (cross-attention) go to the kernels' cross
/// entry points, whose key positions are `0..kv_seq` as in the reference (causal:
/// query `i` sees keys `<= i`).
impl<F: LayerFloat> AttentionBackend<F> for attn_kernels::CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn forward(
        &self,
        cfg: &DilatedConfig,
        q: TensorView<'_, F>,
        k: TensorView<'_, F>,
        v: TensorView<'_, F>,
        out: &mut TensorViewMut<'_, F>,
        lse: &mut [f32],
    ) -> Result<()> {
        let out = reborrow(TensorName::Output, out)?;
        if k.shape().seq == q.shape().seq {
            attn_kernels::CpuBackend::forward(self, cfg, q, k, v, out, lse)
        } else {
            attn_kernels::CpuBackend::forward_cross(self, cfg, q, k, v, out, lse)
        }
    }

    fn backward(
        &self,
        cfg: &DilatedConfig,
        q: TensorView<'_, F>,
        k: TensorView<'_, F>,
        v: TensorView<'_, F>,
        out: TensorView<'_, F>,
        lse: &[f32],
        grad_out: TensorView<'_, F>,
        dq: &mut TensorViewMut<'_, F>,
        dk: &mut TensorViewMut<'_, F>,
        dv: &mut TensorViewMut<'_, F>,
    ) -> Result<()> {
        let dq = reborrow(TensorName::GradQuery, dq)?;
        let dk = reborrow(TensorName::GradKey, dk)?;
        let dv = reborrow(TensorName::GradValue, dv)?;
        if k.shape().seq == q.shape().seq {
            attn_kernels::CpuBackend::backward(self, cfg, q, k, v, out, lse, grad_out, dq, dk, dv)
        } else {
            attn_kernels::CpuBackend::backward_cross(self, cfg, q, k, v, out, lse, grad_out, dq, dk, dv)
        }
    }
}
