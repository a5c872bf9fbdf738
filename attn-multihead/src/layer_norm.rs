//! LayerNorm over the last dimension (`nn.LayerNorm` with affine weight and bias), forward
//! and backward; statistics, normalisation and parameter-gradient sums run in the
//! accumulator (f32 for bf16/f16), each result rounded once.

use attn_core::{AttnError, Element, Result};
use num_traits::{Float, One, Zero};
use rayon::prelude::*;

use crate::float::{Accumulator, LayerFloat};

/// Rows per rayon task.
const ROWS_PER_TASK: usize = 256;

/// `sum f(x[i])` over 8 interleaved partial sums (independent chains the compiler
/// vectorises, instead of one serial chain of `dim` dependent adds).
fn lane_sum<F: LayerFloat>(x: &[F], f: impl Fn(F) -> F::Acc) -> F::Acc {
    let mut acc = [F::Acc::zero(); 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f(v);
        }
    }
    let tail = chunks.remainder().iter().fold(F::Acc::zero(), |s, &v| s + f(v));
    let pairs = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]];
    (pairs[0] + pairs[2]) + (pairs[1] + pairs[3]) + tail
}

/// One task's weight and bias gradient sums.
type ParamSums<A> = (Vec<A>, Vec<A>);

/// `acc[i] += part[i]`.
fn add_into<A: Accumulator>(acc: &mut [A], part: &[A]) {
    acc.iter_mut().zip(part).for_each(|(a, &p)| *a += p);
}

/// `nn.LayerNorm(dim, eps)` with affine parameters (`weight` init 1, `bias` init 0).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerNorm<F> {
    pub dim: usize,
    pub eps: f64,
    pub weight: Vec<F>,
    pub bias: Vec<F>,
}

/// Per-row mean and reciprocal standard deviation saved by the forward pass, in the
/// accumulator `A` (`NormStats<F::Acc>` for a `LayerNorm<F>`).
#[derive(Debug, Clone)]
pub struct NormStats<A> {
    pub mean: Vec<A>,
    pub rstd: Vec<A>,
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
    pub fn forward(&self, x: &[F]) -> Result<(Vec<F>, NormStats<F::Acc>)> {
        let mut y = attn_kernels::zeroed_buffer(x.len())?;
        let stats = self.forward_into(x, &mut y)?;
        Ok((y, stats))
    }

    /// Normalise every row of `x` into `y` (same length); returns the statistics.
    pub fn forward_into(&self, x: &[F], y: &mut [F]) -> Result<NormStats<F::Acc>> {
        let rows = self.check(x.len())?;
        if y.len() != x.len() {
            return Err(AttnError::InvalidArgument(format!(
                "layer norm output: buffer of {} elements for an input of {}",
                y.len(),
                x.len()
            )));
        }
        let d = self.dim;
        let mut mean = vec![F::Acc::zero(); rows];
        let mut rstd = vec![F::Acc::zero(); rows];
        let eps = <F::Acc as Element>::from_f64(self.eps);
        let inv_d = <F::Acc as Element>::from_f64(1.0 / d as f64);
        y.par_chunks_mut(d * ROWS_PER_TASK)
            .zip(x.par_chunks(d * ROWS_PER_TASK))
            .zip(mean.par_chunks_mut(ROWS_PER_TASK).zip(rstd.par_chunks_mut(ROWS_PER_TASK)))
            .for_each(|((yc, xc), (mc, rc))| {
                for (((yr, xr), m), rs) in yc.chunks_mut(d).zip(xc.chunks(d)).zip(mc).zip(rc) {
                    let mu = lane_sum(xr, |v| v.widen()) * inv_d;
                    let var = lane_sum(xr, |v| (v.widen() - mu) * (v.widen() - mu)) * inv_d;
                    let r = F::Acc::one() / (var + eps).sqrt();
                    for (((yo, &xv), &w), &b) in yr.iter_mut().zip(xr).zip(&self.weight).zip(&self.bias) {
                        *yo = F::narrow((xv.widen() - mu) * r * w.widen() + b.widen());
                    }
                    *m = mu;
                    *rs = r;
                }
            });
        Ok(NormStats { mean, rstd })
    }

    /// Gradient of the input; accumulates the weight and bias gradients into `grads`.
    pub fn backward(&self, x: &[F], stats: &NormStats<F::Acc>, dy: &[F], grads: &mut LayerNorm<F>) -> Result<Vec<F>> {
        let rows = self.check(x.len())?;
        if dy.len() != x.len() || stats.mean.len() != rows || stats.rstd.len() != rows {
            return Err(AttnError::InvalidArgument("layer norm backward: buffers disagree".into()));
        }
        let d = self.dim;
        let inv_d = <F::Acc as Element>::from_f64(1.0 / d as f64);
        let mut dx = attn_kernels::zeroed_buffer(x.len())?;
        let zeros = || vec![F::Acc::zero(); d];
        // Each task returns its partial weight/bias gradients; they are summed in task order.
        let partials: Vec<ParamSums<F::Acc>> = dx
            .par_chunks_mut(d * ROWS_PER_TASK)
            .enumerate()
            .map(|(t, dxc)| {
                let (mut gw, mut gb) = (zeros(), zeros());
                for (j, dxr) in dxc.chunks_mut(d).enumerate() {
                    let r = t * ROWS_PER_TASK + j;
                    let (xr, dyr) = (&x[r * d..(r + 1) * d], &dy[r * d..(r + 1) * d]);
                    let (mu, rs) = (stats.mean[r], stats.rstd[r]);
                    let mut sum_g = F::Acc::zero();
                    let mut sum_gx = F::Acc::zero();
                    for i in 0..d {
                        let (xhat, dyi) = ((xr[i].widen() - mu) * rs, dyr[i].widen());
                        let g = dyi * self.weight[i].widen();
                        sum_g += g;
                        sum_gx += g * xhat;
                        gw[i] += dyi * xhat;
                        gb[i] += dyi;
                    }
                    let (mg, mgx) = (sum_g * inv_d, sum_gx * inv_d);
                    for i in 0..d {
                        let xhat = (xr[i].widen() - mu) * rs;
                        dxr[i] = F::narrow(rs * (dyr[i].widen() * self.weight[i].widen() - mg - xhat * mgx));
                    }
                }
                (gw, gb)
            })
            .collect();
        // Summed in the accumulator from the gradients' current values, rounded once.
        let mut gw: Vec<F::Acc> = grads.weight.iter().map(|w| w.widen()).collect();
        let mut gb: Vec<F::Acc> = grads.bias.iter().map(|b| b.widen()).collect();
        for (pw, pb) in partials {
            add_into(&mut gw, &pw);
            add_into(&mut gb, &pb);
        }
        grads.weight.iter_mut().zip(gw).for_each(|(g, a)| *g = F::narrow(a));
        grads.bias.iter_mut().zip(gb).for_each(|(g, a)| *g = F::narrow(a));
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
