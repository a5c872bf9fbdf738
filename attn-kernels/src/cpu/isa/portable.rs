//! Portable tile primitives (plain Rust, every target): matrix product, `exp2`, max.
//! Same contracts as the AVX-512 versions; results agree within f32 rounding.

use crate::cpu::isa::mat::{LaneState, MatMul};

/// Bounds of a `gemm` call, A row-major or (`TN`) column-major (internal invariant: a
/// violation is a bug, so it panics).
pub(crate) fn check_gemm<const TN: bool>(mm: &MatMul<'_>, c: &[f32], ldc: usize) {
    let MatMul { m, k, n, a, lda, b, ldb } = *mm;
    assert!(n.is_multiple_of(16), "gemm: n = {n} is not a multiple of 16");
    if m > 0 && k > 0 {
        let a_end = if TN { (k - 1) * lda + m } else { (m - 1) * lda + k };
        assert!(a_end <= a.len(), "gemm: A out of bounds");
        assert!((k - 1) * ldb + n <= b.len(), "gemm: B out of bounds");
    }
    if m > 0 {
        assert!((m - 1) * ldc + n <= c.len(), "gemm: C out of bounds");
    }
}

/// `C[m x n] (=|+=) A[m x k] * B[k x n]`; A row-major (`A[i, kk]` at `a[i*lda + kk]`),
/// or column-major (`a[kk*lda + i]`) with `TN`.
pub(crate) fn gemm<const TN: bool>(mm: &MatMul<'_>, c: &mut [f32], ldc: usize, acc: bool) {
    let MatMul { m, k, n, a, lda, b, ldb } = *mm;
    for i in 0..m {
        let crow = &mut c[i * ldc..i * ldc + n];
        if !acc {
            crow.fill(0.0);
        }
        for kk in 0..k {
            let aik = if TN { a[kk * lda + i] } else { a[i * lda + kk] };
            let brow = &b[kk * ldb..kk * ldb + n];
            for (cv, bv) in crow.iter_mut().zip(brow) {
                *cv += aik * bv;
            }
        }
    }
}

/// Coefficients (highest degree first) of a degree-5 polynomial for `2^f` on
/// `f` in `[-0.5, 0.5]`: constant term exactly 1 (so `exp2(0) = 1` and a lone visible
/// key gets weight exactly 1 and an exact LSE), the rest fitted for minimax relative
/// error (iteratively reweighted least squares): at most 1.7e-7 (2.9 ulp) evaluated in
/// f32 with FMA; two fewer FMAs per score than the degree-7 Taylor series used before.
// The degree-1 coefficient is fitted (0.693147), not ln 2 (0.6931472).
#[allow(clippy::approx_constant)]
pub(crate) const EXP2_POLY: [f32; 6] = [0.001_326_472_5, 0.009_671_513, 0.055_507_336, 0.240_222_42, 0.693_147, 1.0];

/// `2^x` for one value (`0` below -150, so `-inf` gives `0`; clamped at 127).
#[inline]
pub(crate) fn exp2(x: f32) -> f32 {
    let x = x.clamp(-150.0, 127.0);
    let n = x.round();
    let f = x - n;
    let mut p = EXP2_POLY[0];
    for c in EXP2_POLY[1..].iter().copied() {
        p = p * f + c;
    }
    // Scale by 2^n in two steps so that n down to -150 stays representable.
    let n = n as i32;
    let (n1, n2) = (n / 2, n - n / 2);
    p * f32::from_bits(((n1 + 127) as u32) << 23) * f32::from_bits(((n2 + 127) as u32) << 23)
}

/// `x[j] = exp2(x[j] - s - sv[j])`, returning the sum.
pub(crate) fn exp2_sub(x: &mut [f32], s: f32, sv: Option<&[f32]>) -> f32 {
    let mut sum = 0.0;
    match sv {
        Some(sv) => {
            for (v, &t) in x.iter_mut().zip(sv) {
                *v = exp2(*v - s - t);
                sum += *v;
            }
        }
        None => {
            for v in x.iter_mut() {
                *v = exp2(*v - s);
                sum += *v;
            }
        }
    }
    sum
}

/// Largest element (`-inf` for an empty slice).
pub(crate) fn max(x: &[f32]) -> f32 {
    x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// One online-softmax step on a score tile with queries in lanes (`rows` key rows of
/// `lanes` scores, also the row stride): per lane, `m` rises to the tile's maximum only
/// where that exceeds it by more than `tau`; the tile becomes `exp2(s - m)` (0 for
/// `-inf`), `l` is rescaled and adds the column sums, and the raised lanes of the `dp`
/// accumulator rows `o` are rescaled by `exp2(m_old - m_new)`.
pub(crate) fn softmax_lanes(s: &mut [f32], rows: usize, lanes: usize, tau: f32, st: &mut LaneState<'_>) {
    let (m, l, o, dp) = (&mut *st.m, &mut *st.l, &mut *st.o, st.dp);
    for j in 0..lanes {
        let tile_max = (0..rows).map(|r| s[r * lanes + j]).fold(f32::NEG_INFINITY, f32::max);
        let m_old = m[j];
        // A NaN maximum raises nothing (its weights poison `l`).
        let raise = tile_max > m_old + tau;
        let corr = if raise { exp2(m_old - tile_max) } else { 1.0 };
        if raise {
            m[j] = tile_max;
        }
        // Lanes with nothing visible yet subtract 0, so their `-inf` scores give 0.
        let base = if m[j] == f32::NEG_INFINITY { 0.0 } else { m[j] };
        let mut sum = 0.0;
        for r in 0..rows {
            let e = exp2(s[r * lanes + j] - base);
            s[r * lanes + j] = e;
            sum += e;
        }
        l[j] = l[j] * corr + sum;
        if raise {
            for e in 0..dp {
                o[e * lanes + j] *= corr;
            }
        }
    }
}

/// Folds one row into lane maxima of its sign-cleared bits (`& abs_mask`), counting
/// non-finite values (bits at or above `inf`) as 0: 32-bit formats into `acc`, 16-bit
/// ones into `acc16` (sign-cleared bits are non-negative as i32, and as i16 for the
/// 16-bit formats). Always inlined, so it vectorises for the caller's target features.
#[inline(always)]
pub(crate) fn fold_row<T: attn_core::Element>(
    row: &[T],
    abs_mask: i32,
    inf: i32,
    acc: &mut [i32; 16],
    acc16: &mut [i16; 32],
) {
    // Whole chunks of the lane width (fixed trip count: they vectorise), then the rest.
    #[inline(always)]
    fn fold<T: attn_core::Element, L: Copy + Ord, const N: usize>(row: &[T], acc: &mut [L; N], lane: impl Fn(&T) -> L) {
        let mut chunks = row.chunks_exact(N);
        let mut step = |c: &[T]| acc.iter_mut().zip(c).for_each(|(a, e)| *a = (*a).max(lane(e)));
        (&mut chunks).for_each(&mut step);
        step(chunks.remainder());
    }
    if T::DTYPE.size() == 2 {
        let (m, f) = (abs_mask as i16, inf as i16);
        fold(row, acc16, |e| {
            let b = (e.to_bits() as u16 as i16) & m;
            if b < f { b } else { 0 }
        })
    } else {
        fold(row, acc, |e| {
            let b = (e.to_bits() as u32 as i32) & abs_mask;
            if b < inf { b } else { 0 }
        })
    }
}
