//! Tile primitives dispatched on the chosen [`Isa`]: matrix product, `exp2`, row max.

use crate::isa::Isa;
use crate::{avx2, avx512, portable};

/// `C[m x n] (=|+=) A[m x k] * B[k x n]` (`n` a multiple of 16, row strides `ld*`).
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn gemm(
    isa: Isa,
    m: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    n: usize,
    c: &mut [f32],
    ldc: usize,
    acc: bool,
) {
    product::<false>(isa, m, k, a, lda, b, ldb, n, c, ldc, acc)
}

/// [`gemm`] on the chosen flavour, A row-major or (`TN`) column-major (`A[i, kk]` at
/// `a[kk*lda + i]`: a row-major buffer read in place as its transpose).
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn product<const TN: bool>(
    isa: Isa,
    m: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    n: usize,
    c: &mut [f32],
    ldc: usize,
    acc: bool,
) {
    match isa {
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => avx512::gemm::<TN>(m, k, a, lda, b, ldb, n, c, ldc, acc),
        Isa::Avx2 => avx2::gemm::<TN>(m, k, a, lda, b, ldb, n, c, ldc, acc),
        Isa::Portable => portable::gemm::<TN>(m, k, a, lda, b, ldb, n, c, ldc, acc),
    }
}

/// One online-softmax step on a score tile whose columns are queries (`lanes` of them,
/// a multiple of 16) and whose `rows` rows are keys; see `portable::softmax_lanes`.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn softmax_lanes(
    isa: Isa,
    s: &mut [f32],
    rows: usize,
    lanes: usize,
    tau: f32,
    m: &mut [f32],
    l: &mut [f32],
    o: &mut [f32],
    dp: usize,
) {
    let done = match isa {
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => avx512::softmax_lanes(s, rows, lanes, tau, m, l, o, dp),
        Isa::Avx2 => avx2::softmax_lanes(s, rows, lanes, tau, m, l, o, dp),
        Isa::Portable => false,
    };
    if !done {
        portable::softmax_lanes(s, rows, lanes, tau, m, l, o, dp)
    }
}

/// `C[i] += sum_{kk in ranges[i]} A[i, kk] * B[kk]` for `m = ranges.len()` rows, A
/// row-major or (`TN`) column-major (`A[i, kk]` at `a[kk*lda + i]`, a transposed buffer
/// read in place): each row reads only its own range of the inner dimension, so a masked
/// entry (weight 0) never multiplies a value it must not see (`0 * NaN` would leak the
/// NaN). The part common to all rows runs as one product; the rest row by row.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_ranges<const TN: bool>(
    isa: Isa,
    ranges: &[(usize, usize)],
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    n: usize,
    c: &mut [f32],
    ldc: usize,
) {
    // Offset of A[i, kk] in either layout.
    let at = |i: usize, kk: usize| if TN { kk * lda + i } else { i * lda + kk };
    let lo = ranges.iter().map(|r| r.0).max().unwrap_or(0);
    let hi = ranges.iter().map(|r| r.1).min().unwrap_or(0);
    let row = |c: &mut [f32], i: usize, from: usize, to: usize| {
        if from < to {
            let (a, b, c) = (&a[at(i, from)..], &b[from * ldb..], &mut c[i * ldc..]);
            product::<TN>(isa, 1, to - from, a, lda, b, ldb, n, c, ldc, true);
        }
    };
    if lo < hi {
        product::<TN>(isa, ranges.len(), hi - lo, &a[at(0, lo)..], lda, &b[lo * ldb..], ldb, n, c, ldc, true);
        for (i, &(from, to)) in ranges.iter().enumerate() {
            row(c, i, from, lo);
            row(c, i, hi, to);
        }
    } else {
        for (i, &(from, to)) in ranges.iter().enumerate() {
            row(c, i, from, to);
        }
    }
}

/// `x[j] = exp2(x[j] - s - sv[j])` (`sv` absent = 0), returning the sum.
#[inline]
pub(crate) fn exp2_sub(isa: Isa, x: &mut [f32], s: f32, sv: Option<&[f32]>) -> f32 {
    match isa {
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => avx512::exp2_sub(x, s, sv),
        Isa::Avx2 => avx2::exp2_sub(x, s, sv),
        Isa::Portable => portable::exp2_sub(x, s, sv),
    }
}

/// Largest element (`-inf` if empty).
#[inline]
pub(crate) fn max(isa: Isa, x: &[f32]) -> f32 {
    match isa {
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => avx512::max(x),
        Isa::Avx2 => avx2::max(x),
        Isa::Portable => portable::max(x),
    }
}

/// Keys per tile of the backward kernel.
pub(crate) const KEY_TILE: usize = 64;
/// Keys per tile of the f32 forward kernel: wider than the backward's, so each row's
/// softmax step (max, rescale, horizontal sums) is paid once per 128 keys. Measured
/// on AVX2 (seq 8192, one thread): 64 keys 330 ms, 128 keys 312 ms, 256 keys 320 ms;
/// the backward is faster with 64 (1,180 against 1,320 ms forward + backward).
pub(crate) const FORWARD_KEY_TILE: usize = 128;
/// Rows per register block of the micro-kernel.
pub(crate) const ROW_BLOCK: usize = 6;
/// Query rows whose accumulators are kept together (cache blocking).
pub(crate) const QUERY_CHUNK: usize = 128;
/// Query rows of one forward chunk: whole row blocks (a short block runs the
/// micro-kernel at a fraction of its rate, so only a piece's last chunk has one), and
/// twice the backward's, so each packed key tile is fetched from L3 half as often
/// (seq 65536, 2 threads: 132-134 GFLOP/s with 126 rows, 136-137 with 252).
pub(crate) const FORWARD_QUERY_CHUNK: usize = 2 * QUERY_CHUNK / ROW_BLOCK * ROW_BLOCK;

/// `head_dim` rounded up to the SIMD width.
#[inline]
pub(crate) fn padded(d: usize) -> usize {
    d.next_multiple_of(16)
}

/// Resize a scratch vector (contents unspecified) without shrinking its capacity.
#[inline]
pub(crate) fn scratch(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / 16_777_216.0 - 0.5)
            .collect()
    }

    /// On every kernel flavour this CPU runs, the column-major product equals the
    /// row-major one on an explicit transpose bit for bit (the same multiply-adds in the
    /// same order), ragged row blocks and column panels included.
    #[test]
    fn column_major_product_equals_product_on_the_transpose() {
        for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
            for (m, k, n, acc) in [(1, 1, 16, false), (5, 7, 48, true), (13, 64, 64, false), (64, 130, 80, true)] {
                let (lda, ldb, ldc) = (m + 3, n + 16, n + 32);
                let a_cols = values(k * lda, 1);
                let mut a_rows = vec![0.0; m * k];
                for r in 0..m {
                    for kk in 0..k {
                        a_rows[r * k + kk] = a_cols[kk * lda + r];
                    }
                }
                let b = values(k * ldb, 2);
                let c0 = values(m * ldc, 3);
                let (mut want, mut got) = (c0.clone(), c0);
                gemm(isa, m, k, &a_rows, k, &b, ldb, n, &mut want, ldc, acc);
                product::<true>(isa, m, k, &a_cols, lda, &b, ldb, n, &mut got, ldc, acc);
                assert_eq!(got, want, "{isa:?} m={m} k={k} n={n}");
            }
        }
    }
}
