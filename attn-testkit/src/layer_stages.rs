//! The float64 references of the multihead layer's stages other than attention (the
//! projections and LayerNorm, forward and backward), each on the stage's inputs exactly as
//! a half-precision layer handed them over, with the magnitudes the test kit's row bound
//! ([`crate::judge::check_rows`]) takes: the sums of absolute terms that a rounding
//! of products or of partial sums scales.
//!
//! The roundings covered are those of candle's CPU ops (a matmul accumulates in f32 and
//! rounds once, a bias add rounds, a sum over rows accumulates in the dtype, each partial
//! sum rounded, LayerNorm normalises in f32 and rounds, then scales and shifts) and the
//! fewer of attn-multihead's (sums and LayerNorm in f32, each result rounded once).

/// A reference result and the magnitude of each element (row-major).
#[derive(Debug, Clone)]
pub struct Want {
    pub v: Vec<f64>,
    pub mag: Vec<f64>,
}

/// `x [rows, k] · y [k, cols]` given as accessors: values and sums of absolute products.
fn product(
    rows: usize,
    k: usize,
    cols: usize,
    x: impl Fn(usize, usize) -> f64,
    y: impl Fn(usize, usize) -> f64,
) -> Want {
    let mut w = Want { v: vec![0.0; rows * cols], mag: vec![0.0; rows * cols] };
    for r in 0..rows {
        for c in 0..cols {
            for i in 0..k {
                let p = x(r, i) * y(i, c);
                w.v[r * cols + c] += p;
                w.mag[r * cols + c] += p.abs();
            }
        }
    }
    w
}

/// Column sums of `x [rows, cols]` accumulated row after row in the dtype: the magnitude
/// is the sum of the partial sums' absolute values (each partial sum is one rounding).
pub fn column_sums(x: &[f64], rows: usize, cols: usize) -> Want {
    let mut w = Want { v: vec![0.0; cols], mag: vec![0.0; cols] };
    for r in 0..rows {
        for c in 0..cols {
            w.v[c] += x[r * cols + c];
            w.mag[c] += w.v[c].abs();
        }
    }
    w
}

/// `x [rows, inp] W^T + b` (`W [out, inp]`): the product, then the bias (`|b|` joins the
/// magnitude).
pub fn linear(x: &[f64], w: &[f64], b: Option<&[f64]>, [rows, inp, out]: [usize; 3]) -> Want {
    let mut y = product(rows, inp, out, |r, i| x[r * inp + i], |i, o| w[o * inp + i]);
    if let Some(b) = b {
        for (i, (v, m)) in y.v.iter_mut().zip(&mut y.mag).enumerate() {
            *v += b[i % out];
            *m += b[i % out].abs();
        }
    }
    y
}

/// The backward of [`linear`] given `dy [rows, out]`: `(dx, dW, db)`.
pub fn linear_backward(x: &[f64], w: &[f64], dy: &[f64], [rows, inp, out]: [usize; 3]) -> (Want, Want, Want) {
    let dx = product(rows, out, inp, |r, o| dy[r * out + o], |o, i| w[o * inp + i]);
    let dw = product(out, rows, inp, |o, r| dy[r * out + o], |r, i| x[r * inp + i]);
    (dx, dw, column_sums(dy, rows, out))
}

/// Per row of `x [rows, e]`: the mean, `sigma = sqrt(var + eps)` and the normalised row.
fn normalise(x: &[f64], e: usize, eps: f64) -> Vec<(f64, f64, Vec<f64>)> {
    x.chunks(e)
        .map(|row| {
            let mean = row.iter().sum::<f64>() / e as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / e as f64;
            let sigma = (var + eps).sqrt();
            (mean, sigma, row.iter().map(|v| (v - mean) / sigma).collect())
        })
        .collect()
}

/// LayerNorm `gamma * (x - mean) / sigma + beta` over rows of `e`. Magnitude: the
/// normalised value rounded, then scaled (each `|gamma hat|`), the shift `|beta|`, and the
/// f32 centring's cancellation (`|gamma| |mean| / sigma`).
pub fn layer_norm(x: &[f64], [gamma, beta]: [&[f64]; 2], e: usize, eps: f64) -> Want {
    let mut y = Want { v: Vec::with_capacity(x.len()), mag: Vec::with_capacity(x.len()) };
    for (mean, sigma, hat) in normalise(x, e, eps) {
        for (c, h) in hat.iter().enumerate() {
            y.v.push(gamma[c] * h + beta[c]);
            y.mag.push(gamma[c].abs() * (2.0 * h.abs() + mean.abs() / sigma) + beta[c].abs());
        }
    }
    y
}

/// The backward of [`layer_norm`] given `dy`: `(dx, dgamma, dbeta)`. `dx = (g - mean(g) -
/// hat mean(g hat)) / sigma` for `g = dy gamma` (rounded: its bound carried through);
/// `dgamma` sums the rounded products `dy * hat` (hat itself rounded) over rows.
pub fn layer_norm_backward(x: &[f64], dy: &[f64], gamma: &[f64], e: usize, eps: f64) -> (Want, Want, Want) {
    let rows = x.len() / e;
    let mut dx = Want { v: Vec::with_capacity(x.len()), mag: Vec::with_capacity(x.len()) };
    let mut prod = vec![0.0; x.len()];
    let mut prod_mag = vec![0.0; e];
    for (r, (mean, sigma, hat)) in normalise(x, e, eps).into_iter().enumerate() {
        let dyr = &dy[r * e..][..e];
        let g: Vec<f64> = dyr.iter().zip(gamma).map(|(d, w)| d * w).collect();
        let mean_g = g.iter().sum::<f64>() / e as f64;
        let mean_gh = g.iter().zip(&hat).map(|(a, b)| a * b).sum::<f64>() / e as f64;
        let abs_g = g.iter().map(|v| v.abs()).sum::<f64>() / e as f64;
        let abs_gh = g.iter().zip(&hat).map(|(a, b)| (a * b).abs()).sum::<f64>() / e as f64;
        for c in 0..e {
            dx.v.push((g[c] - mean_g - hat[c] * mean_gh) / sigma);
            let centring = g[c].abs() * mean.abs() / sigma;
            dx.mag.push((g[c].abs() + abs_g + hat[c].abs() * abs_gh + centring) / sigma);
            prod[r * e + c] = dyr[c] * hat[c];
            prod_mag[c] += 2.0 * prod[r * e + c].abs();
        }
    }
    let mut dgamma = column_sums(&prod, rows, e);
    dgamma.mag.iter_mut().zip(&prod_mag).for_each(|(m, p)| *m += p);
    (dx, dgamma, column_sums(dy, rows, e))
}

/// `parts` summed element by element in the dtype in some order: a partial sum is at most
/// the parts' absolute values summed.
pub fn accumulated(parts: &[&[f64]]) -> Want {
    let n = parts[0].len();
    let v = (0..n).map(|i| parts.iter().map(|p| p[i]).sum()).collect();
    let mag = (0..n).map(|i| parts.iter().map(|p| p[i].abs()).sum()).collect();
    Want { v, mag }
}
