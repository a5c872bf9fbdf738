//! Exact float64 backward of the reference: dq, dk, dv of `sum(out * grad_out)`.

use super::{Forward, Gradients, Rows, check_len, dot, forward_impl, keys_for, softmax};
use crate::config::DilatedConfig;
use crate::error::{AttnError, Result, TensorName};
use crate::shape::AttnShape;

#[allow(clippy::too_many_arguments)]
fn backward_impl(
    cfg: Option<&DilatedConfig>,
    causal: bool,
    scale: f64,
    shape: AttnShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    grad_out: &[f64],
) -> Result<(Forward, Gradients)> {
    let fwd = forward_impl(cfg, causal, scale, shape, q, k, v)?;
    check_len(TensorName::GradOutput, grad_out.len(), shape.q.numel())?;
    let (qs, kvs) = (shape.q, shape.kv);
    let d = qs.head_dim;
    let qr = Rows { seq: qs.seq, heads: qs.heads, d };
    let kr = Rows { seq: kvs.seq, heads: kvs.heads, d };
    let mut dq = vec![0.0; qs.numel()];
    let mut dk = vec![0.0; kvs.numel()];
    let mut dv = vec![0.0; kvs.numel()];
    for b in 0..qs.batch {
        for h in 0..qs.heads {
            for i in 0..qs.seq {
                let (keys, out_scale) = keys_for(cfg, causal, qs.heads, h, i, kvs.seq);
                let qi = &q[qr.at(b, i, h)..][..d];
                let scores: Vec<f64> = keys.iter().map(|&j| scale * dot(qi, &k[kr.at(b, j, h)..][..d])).collect();
                let (p, _) = softmax(&scores);
                // out = out_scale * sum_j p_j v_j, so d(out)/d(p_j) = out_scale * v_j.
                let go: Vec<f64> = grad_out[qr.at(b, i, h)..][..d].iter().map(|g| g * out_scale).collect();
                let dp: Vec<f64> = keys.iter().map(|&j| dot(&go, &v[kr.at(b, j, h)..][..d])).collect();
                let big_d: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for ((&j, &pj), &dpj) in keys.iter().zip(&p).zip(&dp) {
                    let ds = pj * (dpj - big_d) * scale;
                    let (ko, qo) = (kr.at(b, j, h), qr.at(b, i, h));
                    for e in 0..d {
                        dv[ko + e] += pj * go[e];
                        dq[qo + e] += ds * k[ko + e];
                        dk[ko + e] += ds * q[qo + e];
                    }
                }
            }
        }
    }
    Ok((fwd, Gradients { dq, dk, dv }))
}

/// Forward and gradients of dilated attention in float64.
pub fn dilated_backward(
    cfg: &DilatedConfig,
    shape: AttnShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    grad_out: &[f64],
) -> Result<(Forward, Gradients)> {
    cfg.validate_heads(shape.q.heads)?;
    backward_impl(Some(cfg), cfg.causal(), cfg.scale_for(shape.q.head_dim), shape, q, k, v, grad_out)
}

/// Forward and gradients of dense attention in float64.
pub fn dense_backward(
    shape: AttnShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    grad_out: &[f64],
    scale: f64,
    causal: bool,
) -> Result<(Forward, Gradients)> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(AttnError::InvalidScale(scale));
    }
    backward_impl(None, causal, scale, shape, q, k, v, grad_out)
}
