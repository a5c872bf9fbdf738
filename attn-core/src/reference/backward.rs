//! Exact float64 backward of the reference: dq, dk, dv of `sum(out * grad_out)` (plus
//! `sum(lse * grad_lse)` where a gradient reaches the LSE), and
//! the magnitudes (sums of absolute terms) that a low-precision result is judged by.

use super::{
    FLUSHED_WEIGHT, Flushable, Forward, Gradients, KeyRule, Magnitudes, Rows, check_len, dot, forward_impl, softmax,
};
use crate::band::Band;
use crate::config::{Causality, DilatedConfig};
use crate::error::{AttnError, Result, TensorName};
use crate::masks::Masks;
use crate::shape::AttnShape;

fn backward_impl(
    rule: KeyRule<'_>,
    scale: f64,
    [q, k, v]: [&[f64]; 3],
    grad_out: &[f64],
    grad_lse: Option<&[f64]>,
) -> Result<(Forward, Gradients, Magnitudes)> {
    let fwd = forward_impl(rule, scale, [q, k, v])?;
    let shape = rule.shape;
    check_len(TensorName::GradOutput, grad_out.len(), shape.q.numel())?;
    if let Some(g) = grad_lse {
        check_len(TensorName::GradLse, g.len(), shape.q.lse_len())?;
    }
    let (qs, kvs) = (shape.q, shape.kv);
    let d = qs.head_dim;
    let qr = Rows { seq: qs.seq, heads: qs.heads, d };
    let kr = Rows { seq: kvs.seq, heads: kvs.heads, d };
    let mut dq = vec![0.0; qs.numel()];
    let mut dk = vec![0.0; kvs.numel()];
    let mut dv = vec![0.0; kvs.numel()];
    let mut mag = Magnitudes {
        lse: vec![0.0; qs.lse_len()],
        out: vec![0.0; qs.numel()],
        dq: vec![0.0; qs.numel()],
        dk: vec![0.0; kvs.numel()],
        dv: vec![0.0; kvs.numel()],
        flushable: Flushable::zeros(qs.numel(), kvs.numel()),
        quantum: Flushable::zeros(qs.numel(), kvs.numel()),
    };
    let abs_dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum::<f64>();
    for b in 0..qs.batch {
        for h in 0..qs.heads {
            let hk = shape.kv_head(h);
            for i in 0..qs.seq {
                let (keys, out_scale) = rule.keys(b, h, i);
                let qi = &q[qr.at(b, i, h)..][..d];
                let scores: Vec<f64> = keys.iter().map(|&j| scale * dot(qi, &k[kr.at(b, j, hk)..][..d])).collect();
                let (p, _) = softmax(&scores);
                if !keys.is_empty() {
                    let largest =
                        keys.iter().map(|&j| scale * abs_dot(qi, &k[kr.at(b, j, hk)..][..d])).fold(0.0, f64::max);
                    mag.lse[(b * qs.seq + i) * qs.heads + h] = largest + (keys.len() as f64).ln();
                }
                // out = out_scale * sum_j p_j v_j, so d(out)/d(p_j) = out_scale * v_j.
                let go: Vec<f64> = grad_out[qr.at(b, i, h)..][..d].iter().map(|g| g * out_scale).collect();
                let dp: Vec<f64> = keys.iter().map(|&j| dot(&go, &v[kr.at(b, j, hk)..][..d])).collect();
                // d(lse)/d(score_j) = p_j, so a gradient into the LSE moves D by -grad_lse.
                let g_lse = match grad_lse {
                    Some(g) if !keys.is_empty() => g[(b * qs.seq + i) * qs.heads + h],
                    _ => 0.0,
                };
                let big_d: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum::<f64>() - g_lse;
                // |dp_j| and |D| bounded by their sums of absolute terms.
                let dp_abs: Vec<f64> = keys.iter().map(|&j| abs_dot(&go, &v[kr.at(b, j, hk)..][..d])).collect();
                let d_abs: f64 = p.iter().zip(&dp_abs).map(|(a, b)| a * b).sum::<f64>() + g_lse.abs();
                for (((&j, &pj), &dpj), &dpj_abs) in keys.iter().zip(&p).zip(&dp).zip(&dp_abs) {
                    let ds = pj * (dpj - big_d) * scale;
                    let ds_abs = pj * (dpj_abs + d_abs) * scale;
                    let (ko, qo) = (kr.at(b, j, hk), qr.at(b, i, h));
                    for e in 0..d {
                        dv[ko + e] += pj * go[e];
                        dq[qo + e] += ds * k[ko + e];
                        dk[ko + e] += ds * q[qo + e];
                        let terms = [
                            out_scale.abs() * pj * v[ko + e].abs(),
                            pj * go[e].abs(),
                            ds_abs * k[ko + e].abs(),
                            ds_abs * q[qo + e].abs(),
                        ];
                        let qu = &mut mag.quantum;
                        qu.out[qo + e] += out_scale.abs() * v[ko + e].abs();
                        qu.dv[ko + e] += go[e].abs();
                        qu.dq[qo + e] += scale * k[ko + e].abs();
                        qu.dk[ko + e] += scale * q[qo + e].abs();
                        mag.out[qo + e] += terms[0];
                        mag.dv[ko + e] += terms[1];
                        mag.dq[qo + e] += terms[2];
                        mag.dk[ko + e] += terms[3];
                        if pj < FLUSHED_WEIGHT {
                            let fl = &mut mag.flushable;
                            fl.out[qo + e] += terms[0];
                            fl.dv[ko + e] += terms[1];
                            fl.dq[qo + e] += terms[2];
                            fl.dk[ko + e] += terms[3];
                        }
                    }
                }
            }
        }
    }
    Ok((fwd, Gradients { dq, dk, dv }, mag))
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
    let (fwd, grads, _) = dilated_backward_with_magnitudes(cfg, shape, q, k, v, grad_out)?;
    Ok((fwd, grads))
}

/// [`dilated_backward`] plus the [`Magnitudes`] of the output and each gradient.
pub fn dilated_backward_with_magnitudes(
    cfg: &DilatedConfig,
    shape: AttnShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    grad_out: &[f64],
) -> Result<(Forward, Gradients, Magnitudes)> {
    dilated_backward_masked(cfg, shape, Masks::NONE, [q, k, v], grad_out)
}

/// [`dilated_backward_with_magnitudes`] with key padding and packed sequences.
pub fn dilated_backward_masked(
    cfg: &DilatedConfig,
    shape: AttnShape,
    masks: Masks<'_>,
    qkv: [&[f64]; 3],
    grad_out: &[f64],
) -> Result<(Forward, Gradients, Magnitudes)> {
    dilated_backward_lse(cfg, shape, masks, qkv, grad_out, None)
}

/// [`dilated_backward_masked`] of `sum(out * grad_out) + sum(lse * grad_lse)`:
/// `grad_lse` (`[batch, seq, heads]`, `None` for zeros) is the gradient a loss sends into
/// the LSE; rows whose LSE is `-inf` take none of it.
pub fn dilated_backward_lse(
    cfg: &DilatedConfig,
    shape: AttnShape,
    masks: Masks<'_>,
    qkv: [&[f64]; 3],
    grad_out: &[f64],
    grad_lse: Option<&[f64]>,
) -> Result<(Forward, Gradients, Magnitudes)> {
    cfg.validate_heads(shape.q.heads)?;
    let rule = KeyRule { cfg: Some(cfg), band: cfg.band(), masks, shape };
    backward_impl(rule, cfg.scale_for(shape.q.head_dim), qkv, grad_out, grad_lse)
}

/// Forward and gradients of dense attention in float64.
pub fn dense_backward(
    shape: AttnShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    grad_out: &[f64],
    scale: f64,
    causality: Causality,
) -> Result<(Forward, Gradients)> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(AttnError::InvalidScale(scale));
    }
    let band = if causality.is_causal() { Band::CAUSAL } else { Band::FULL };
    let rule = KeyRule { cfg: None, band, masks: Masks::NONE, shape };
    let (fwd, grads, _) = backward_impl(rule, scale, [q, k, v], grad_out, None)?;
    Ok((fwd, grads))
}
