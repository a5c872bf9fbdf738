//! LayerNorm over the last dimension (`nn.LayerNorm` with affine weight and bias), forward and backward.

use attn_core::{AttnError, Result};
use rayon::prelude::*;

use crate::float::LayerFloat;

/// Rows per rayon task.
const ROWS_PER_TASK: usize = 256;

/// `sum f(x[i])` over 8 interleaved partial sums (independent chains the compiler
/// vectorises, instead of one serial chain of `dim` dependent adds).
fn lane_sum<F: LayerFloat>(x: &[F], f: impl Fn(F) -> F) -> F {
    let mut acc = [F::zero(); 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f(v);
        }
    }
    let tail = chunks.remainder().iter().fold(F::zero(), |s, &v| s + f(v));
    let pairs = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]];
    (pairs[0] + pairs[2]) + (pairs[1] + pairs[3]) + tail
}

/// `nn.LayerNorm(dim, eps)` with affine parameters (`weight` init 1, `bias` init 0).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerNorm<F> {
    pub dim: usize,
    pub eps: f64,
    pub weight: Vec<F>,
    pub bias: Vec<F>,
}

/// Per-row mean and reciprocal standard deviation saved by the forward pass.
#[derive(Debug, Clone)]
pub struct NormStats<F> {
    pub mean: Vec<F>,
    pub rstd: Vec<F>,
}

impl<F: LayerFloat> LayerNorm<F> {
    pub fn new(dim: usize, eps: f64) -> Self {
        LayerNorm { dim, eps, weight: vec![F::one(); dim], bias: vec![F::zero(); dim] }
    }

    /// All-zero parameters of the same shape (a gradient accumulator).
    pub fn zeros_like(&self) -> Self {
        LayerNorm { dim: self.dim, eps: self.eps, weight: vec![F::zero(); self.dim], bias: vec![F::zero(); self.dim] }
    }

    fn check(&self, len: usize) -> Result<usize> {
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(AttnError::InvalidArgument(format!(
                "layer norm eps must be finite and positive, got {}",
                self.eps
            )));
        }
        if self.dim == 0
            || !len.is_multiple_of(self.dim)
            || self.weight.len() != self.dim
            || self.bias.len() != self.dim
        {
            return Err(AttnError::InvalidArgument(format!(
                "layer norm over {} features got a buffer of {len} elements",
                self.dim
            )));
        }
        Ok(len / self.dim)
    }

    /// Normalise every row of `x` (`[rows, dim]`); returns the output and the statistics.
    pub fn forward(&self, x: &[F]) -> Result<(Vec<F>, NormStats<F>)> {
        let mut y = attn_kernels::zeroed_buffer(x.len())?;
        let stats = self.forward_into(x, &mut y)?;
        Ok((y, stats))
    }

    /// Normalise every row of `x` into `y` (same length); returns the statistics.
    pub fn forward_into(&self, x: &[F], y: &mut [F]) -> Result<NormStats<F>> {
        let rows = self.check(x.len())?;
        if y.len() != x.len() {
            return Err(AttnError::InvalidArgument(format!(
                "layer norm output: buffer of {} elements for an input of {}",
                y.len(),
                x.len()
            )));
        }
        let d = self.dim;
        let mut mean = vec![F::zero(); rows];
        let mut rstd = vec![F::zero(); rows];
        let eps = F::of(self.eps);
        let inv_d = F::of(1.0 / d as f64);
        y.par_chunks_mut(d * ROWS_PER_TASK)
            .zip(x.par_chunks(d * ROWS_PER_TASK))
            .zip(mean.par_chunks_mut(ROWS_PER_TASK).zip(rstd.par_chunks_mut(ROWS_PER_TASK)))
            .for_each(|((yc, xc), (mc, rc))| {
                for (((yr, xr), m), rs) in yc.chunks_mut(d).zip(xc.chunks(d)).zip(mc).zip(rc) {
                    let mu = lane_sum(xr, |v| v) * inv_d;
                    let var = lane_sum(xr, |v| (v - mu) * (v - mu)) * inv_d;
                    let r = F::one() / (var + eps).sqrt();
                    for (((yo, &xv), &w), &b) in yr.iter_mut().zip(xr).zip(&self.weight).zip(&self.bias) {
                        *yo = (xv - mu) * r * w + b;
                    }
                    *m = mu;
                    *rs = r;
                }
            });
        Ok(NormStats { mean, rstd })
    }

    /// Gradient of the input; accumulates the weight and bias gradients into `grads`.
    pub fn backward(&self, x: &[F], stats: &NormStats<F>, dy: &[F], grads: &mut LayerNorm<F>) -> Result<Vec<F>> {
        let rows = self.check(x.len())?;
        if dy.len() != x.len() || stats.mean.len() != rows || stats.rstd.len() != rows {
            return Err(AttnError::InvalidArgument("layer norm backward: buffers disagree".into()));
        }
        let d = self.dim;
        let inv_d = F::of(1.0 / d as f64);
        let mut dx = attn_kernels::zeroed_buffer(x.len())?;
        // Each task returns its partial weight/bias gradients; they are summed in task order.
        let partials: Vec<(Vec<F>, Vec<F>)> = dx
            .par_chunks_mut(d * ROWS_PER_TASK)
            .enumerate()
            .map(|(t, dxc)| {
                let (mut gw, mut gb) = (vec![F::zero(); d], vec![F::zero(); d]);
                for (j, dxr) in dxc.chunks_mut(d).enumerate() {
                    let r = t * ROWS_PER_TASK + j;
                    let (xr, dyr) = (&x[r * d..(r + 1) * d], &dy[r * d..(r + 1) * d]);
                    let (mu, rs) = (stats.mean[r], stats.rstd[r]);
                    let mut sum_g = F::zero();
                    let mut sum_gx = F::zero();
                    for i in 0..d {
                        let xhat = (xr[i] - mu) * rs;
                        let g = dyr[i] * self.weight[i];
                        sum_g += g;
                        sum_gx += g * xhat;
                        gw[i] += dyr[i] * xhat;
                        gb[i] += dyr[i];
                    }
                    let (mg, mgx) = (sum_g * inv_d, sum_gx * inv_d);
                    for i in 0..d {
                        let xhat = (xr[i] - mu) * rs;
                        dxr[i] = rs * (dyr[i] * self.weight[i] - mg - xhat * mgx);
                    }
                }
                (gw, gb)
            })
            .collect();
        for (gw, gb) in partials {
            grads.weight.iter_mut().zip(&gw).for_each(|(a, &b)| *a += b);
            grads.bias.iter_mut().zip(&gb).for_each(|(a, &b)| *a += b);
        }
        Ok(dx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::SeededRng;

    #[test]
    fn normalises_and_gradients_match_finite_differences() {
        let mut rng = SeededRng::new(11);
        let mut ln = LayerNorm::<f64>::new(5, 1e-5);
        ln.weight.iter_mut().for_each(|w| *w = 1.0 + 0.3 * rng.normal());
        ln.bias.iter_mut().for_each(|b| *b = 0.3 * rng.normal());
        let x: Vec<f64> = (0..15).map(|_| rng.normal()).collect();
        let dy: Vec<f64> = (0..15).map(|_| rng.normal()).collect();
        let plain = LayerNorm::<f64>::new(5, 1e-5);
        let (y, _) = plain.forward(&x).unwrap();
        for r in y.chunks(5) {
            let m = r.iter().sum::<f64>() / 5.0;
            let v = r.iter().map(|a| (a - m).powi(2)).sum::<f64>() / 5.0;
            assert!(m.abs() < 1e-12 && (v - 1.0).abs() < 1e-4);
        }
        let loss = |ln: &LayerNorm<f64>, x: &[f64]| -> f64 {
            ln.forward(x).unwrap().0.iter().zip(&dy).map(|(a, b)| a * b).sum()
        };
        let (_, st) = ln.forward(&x).unwrap();
        let mut g = ln.zeros_like();
        let dx = ln.backward(&x, &st, &dy, &mut g).unwrap();
        let h = 1e-6;
        for i in 0..15 {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[i] += h;
            xm[i] -= h;
            let fd = (loss(&ln, &xp) - loss(&ln, &xm)) / (2.0 * h);
            assert!((fd - dx[i]).abs() < 1e-7, "dx[{i}] {fd} vs {}", dx[i]);
        }
        for i in 0..5 {
            let (mut p, mut m) = (ln.clone(), ln.clone());
            p.weight[i] += h;
            m.weight[i] -= h;
            let fd = (loss(&p, &x) - loss(&m, &x)) / (2.0 * h);
            assert!((fd - g.weight[i]).abs() < 1e-7);
            let (mut p, mut m) = (ln.clone(), ln.clone());
            p.bias[i] += h;
            m.bias[i] -= h;
            let fd = (loss(&p, &x) - loss(&m, &x)) / (2.0 * h);
            assert!((fd - g.bias[i]).abs() < 1e-7);
        }
        assert!(LayerNorm::<f64>::new(4, 1e-5).forward(&x).is_err());
    }
}
