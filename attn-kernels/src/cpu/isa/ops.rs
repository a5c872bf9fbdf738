//! The dispatch module: every call from the kernels into an instruction-set module
//! (`avx512`, `avx2`, `portable`) or the bf16 pair engines (`bf16_pairs`) goes through
//! here, chosen by the [`Isa`] picked once at run time: matrix products, `exp2`, row
//! maxima, the backward's `dS` rows, row conversion and prefetch, the score-bound scan,
//! and the bf16 pair forward of a piece.

use attn_core::Element;

use super::{avx2, avx512, bf16_pairs, portable};
use crate::cpu::isa::Isa;
use crate::cpu::isa::bf16_pairs::Engine;
use crate::cpu::isa::mat::{LaneState, MatMul};
use crate::cpu::isa::rows::{Piece, PieceSpec};

/// The bf16 pair forward's per-thread scratch.
pub(crate) type PairScratch = bf16_pairs::PairScratch;

/// `C[m x n] (=|+=) A[m x k] * B[k x n]` (`n` a multiple of 16, row strides `ld*`).
#[inline]
pub(crate) fn gemm(isa: Isa, mm: &MatMul<'_>, c: &mut [f32], ldc: usize, acc: bool) {
    product::<false>(isa, mm, c, ldc, acc)
}

/// [`gemm`] on the chosen flavour, A row-major or (`TN`) column-major (`A[i, kk]` at
/// `a[kk*lda + i]`: a row-major buffer read in place as its transpose).
#[inline]
pub(crate) fn product<const TN: bool>(isa: Isa, mm: &MatMul<'_>, c: &mut [f32], ldc: usize, acc: bool) {
    match isa {
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => avx512::gemm::<TN>(mm, c, ldc, acc),
        Isa::Avx2 => avx2::gemm::<TN>(mm, c, ldc, acc),
        Isa::Portable => portable::gemm::<TN>(mm, c, ldc, acc),
    }
}

/// One online-softmax step on a score tile whose columns are queries (`lanes` of them,
/// a multiple of 16) and whose `rows` rows are keys; see `portable::softmax_lanes`.
#[inline]
pub(crate) fn softmax_lanes(isa: Isa, s: &mut [f32], rows: usize, lanes: usize, tau: f32, st: &mut LaneState<'_>) {
    let done = match isa {
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => avx512::softmax_lanes(s, rows, lanes, tau, st),
        Isa::Avx2 => avx2::softmax_lanes(s, rows, lanes, tau, st),
        Isa::Portable => false,
    };
    if !done {
        portable::softmax_lanes(s, rows, lanes, tau, st)
    }
}

/// `C[i] += sum_{kk in ranges[i]} A[i, kk] * B[kk]` for `m = ranges.len()` rows, A
/// row-major or (`TN`) column-major (`A[i, kk]` at `a[kk*lda + i]`, a transposed buffer
/// read in place): each row reads only its own range of the inner dimension, so a masked
/// entry (weight 0) never multiplies a value it must not see (`0 * NaN` would leak the
/// NaN). The part common to all rows runs as one product; the rest row by row.
pub(crate) fn gemm_ranges<const TN: bool>(
    isa: Isa,
    ranges: &[(usize, usize)],
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
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
            product::<TN>(isa, &MatMul { m: 1, k: to - from, n, a, lda, b, ldb }, c, ldc, true);
        }
    };
    if lo < hi {
        let common = MatMul { m: ranges.len(), k: hi - lo, n, a: &a[at(0, lo)..], lda, b: &b[lo * ldb..], ldb };
        product::<TN>(isa, &common, c, ldc, true);
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

/// `2^x` (scalar).
#[inline]
pub(crate) fn exp2(x: f32) -> f32 {
    portable::exp2(x)
}

/// `dp[j] = p[j] == 0 ? 0 : p[j] * (dp[j] - delta_j)` for `j < dp.len()`, where
/// `delta_j = dv[j]` when given, else `delta` (AVX2 wherever the CPU has it, whatever
/// the flavour: the result is the same element-wise arithmetic).
#[inline]
pub(crate) fn ds_row(p: &[f32], dp: &mut [f32], dv: Option<&[f32]>, delta: f32) {
    avx2::ds_row(p, dp, dv, delta)
}

/// `out[e] = mul * row[e]` with F16C for f16 rows where the CPU has it; false (nothing
/// converted) where this path does not apply.
#[inline]
pub(crate) fn f16_row_to_f32<T: Element>(row: &[T], mul: f32, out: &mut [f32]) -> bool {
    avx2::f16_row_to_f32(row, mul, out)
}

/// Prefetch the cache lines of `row` (a hint; nothing on other architectures).
#[inline]
pub(crate) fn prefetch_row<T>(row: &[T]) {
    avx2::prefetch_row(row)
}

/// The score-bound scan of one row (see `score_bound`): AVX2 where the CPU has it.
#[inline]
pub(crate) fn fold_row<T: Element>(row: &[T], abs_mask: i32, inf: i32, acc: &mut [i32; 16], acc16: &mut [i16; 32]) {
    avx2::fold_row(row, abs_mask, inf, acc, acc16)
}

/// The bf16 pair engine `isa` runs the bf16 forward on, if any.
#[inline]
pub(crate) fn pair_engine(isa: Isa) -> Option<Engine> {
    match isa {
        Isa::Amx => Some(Engine::Tiles),
        Isa::Avx512Bf16 => Some(Engine::Dot),
        _ => None,
    }
}

/// The bf16 pair forward of a piece on its flavour's engine; false (nothing written)
/// where it does not apply and the f32 kernel must run the piece (see `bf16_pairs`).
#[inline]
pub(crate) fn pair_forward_piece<T: Element>(
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    ws: &mut PairScratch,
    out: &mut [f32],
    lse: &mut [f32],
) -> bool {
    pair_engine(spec.isa).is_some_and(|e| bf16_pairs::forward_piece(e, spec, piece, ws, out, lse))
}

/// Bytes of the bf16 pair forward's scratch on `isa` for head dim `d` and `m` keys.
pub(crate) fn pair_scratch_bytes(isa: Isa, d: usize, m: usize) -> u128 {
    if pair_engine(isa).is_some() { bf16_pairs::scratch_bytes(d, m) } else { 0 }
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
        for isa in attn_testkit::isa_policy::runnable("column_major_product", Isa::ALL, Isa::as_str, Isa::is_supported)
        {
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
                gemm(isa, &MatMul { m, k, n, a: &a_rows, lda: k, b: &b, ldb }, &mut want, ldc, acc);
                product::<true>(isa, &MatMul { m, k, n, a: &a_cols, lda, b: &b, ldb }, &mut got, ldc, acc);
                assert_eq!(got, want, "{isa:?} m={m} k={k} n={n}");
            }
        }
    }
}
