//! AVX2+FMA tile primitives (x86-64 CPUs without AVX-512): the register-blocked FMA
//! micro-kernel (6 rows x 16 columns), a vector `exp2`, and row max. Safe wrappers
//! check slice bounds and that the CPU has avx2 and fma before calling the
//! `#[target_feature]` code.
#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;

    use crate::cpu::isa::mat::{RawLaneState, RawMatMul};

    use crate::cpu::isa::portable::EXP2_POLY;

    /// `C[R x 16] (=|+=) A[R x k] * B[k x 16]` with all of C kept in registers; A
    /// row-major (`A[r, kk]` at `a[r*lda + kk]`), or column-major (`a[kk*lda + r]`) with `TN`.
    ///
    /// # Safety
    /// The CPU supports avx2 and fma; `a` is valid for reads at every `A[r, kk]` (r < R,
    /// kk < k), `b` at `kk*ldb + j` (j < 16), `c` for reads and writes at `r*ldc + j`.
    #[target_feature(enable = "avx2,fma")]
    // The register-blocked micro-kernel: each argument is a register or a stride of its loop.
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro<const R: usize, const TN: bool>(
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        let mut cr = [[_mm256_setzero_ps(); 2]; R];
        if acc {
            for (r, row) in cr.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().enumerate() {
                    // SAFETY: in bounds by the function contract.
                    *x = unsafe { _mm256_loadu_ps(c.add(r * ldc + 8 * v)) };
                }
            }
        }
        // Strides of A between rows and between steps of k.
        let (rs, ks) = if TN { (1, lda) } else { (lda, 1) };
        // Row pointers of A, advanced one step of k at a time.
        // SAFETY: in bounds by the function contract (r < R).
        let mut ap: [*const f32; R] = std::array::from_fn(|r| unsafe { a.add(r * rs) });
        let mut bp = b;
        // Four steps of k per iteration: the row pointers advance once per four
        // broadcasts (constant displacements when row-major), so the loop issues few
        // integer ops.
        for _ in 0..k / 4 {
            for u in 0..4 {
                // SAFETY: `bp + u*ldb` points at row kk + u < k of B (16 readable elements).
                let (b0, b1) = unsafe { (_mm256_loadu_ps(bp.add(u * ldb)), _mm256_loadu_ps(bp.add(u * ldb + 8))) };
                for (row, p) in cr.iter_mut().zip(ap.iter()) {
                    // SAFETY: `p + u*ks` points at A[r, kk + u], kk + u < k.
                    let av = _mm256_broadcast_ss(unsafe { &*p.add(u * ks) });
                    row[0] = _mm256_fmadd_ps(av, b0, row[0]);
                    row[1] = _mm256_fmadd_ps(av, b1, row[1]);
                }
            }
            // At most one step past A[r, k - 1] / one row past B's last row; read only while kk < k.
            ap.iter_mut().for_each(|p| *p = p.wrapping_add(4 * ks));
            bp = bp.wrapping_add(4 * ldb);
        }
        for _ in 0..k % 4 {
            // SAFETY: `bp` points at row kk of B, which has 16 readable elements.
            let (b0, b1) = unsafe { (_mm256_loadu_ps(bp), _mm256_loadu_ps(bp.add(8))) };
            for (row, p) in cr.iter_mut().zip(ap.iter_mut()) {
                // SAFETY: `p` points at A[r, kk], in bounds by the function contract.
                let av = _mm256_broadcast_ss(unsafe { &**p });
                row[0] = _mm256_fmadd_ps(av, b0, row[0]);
                row[1] = _mm256_fmadd_ps(av, b1, row[1]);
                // One step past A[r, kk] at most; read only while kk < k.
                *p = p.wrapping_add(ks);
            }
            // At most one row past the last row of B, never read.
            bp = bp.wrapping_add(ldb);
        }
        for (r, row) in cr.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                // SAFETY: in bounds by the function contract.
                unsafe { _mm256_storeu_ps(c.add(r * ldc + 8 * v), *x) };
            }
        }
    }

    /// `C[m x n] (=|+=) A[m x k] * B[k x n]`, `n` a multiple of 16; A row-major, or
    /// column-major (`A[r, kk]` at `a[kk*lda + r]`) with `TN`.
    ///
    /// # Safety
    /// The CPU supports avx2 and fma and the slices cover every index the shapes reach
    /// (checked by the safe wrapper).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemm<const TN: bool>(mm: RawMatMul, c: *mut f32, ldc: usize, acc: bool) {
        let RawMatMul { m, k, n, a, lda, b, ldb } = mm;
        // Column panels outside, row blocks inside: one 16-column panel of B stays in L1
        // while every row block of A passes over it.
        let mut j0 = 0;
        while j0 < n {
            let mut r0 = 0;
            while r0 < m {
                let rows = (m - r0).min(6);
                let a_off = if TN { r0 } else { r0 * lda };
                // SAFETY: offsets stay inside the caller's bounds (r0 + rows <= m, j0 + 16 <= n).
                let (ap, bp, cp) = unsafe { (a.add(a_off), b.add(j0), c.add(r0 * ldc + j0)) };
                // SAFETY: forwarded contract of `gemm` for this 6 x 16 (or smaller) block.
                unsafe {
                    match rows {
                        1 => micro::<1, TN>(k, ap, lda, bp, ldb, cp, ldc, acc),
                        2 => micro::<2, TN>(k, ap, lda, bp, ldb, cp, ldc, acc),
                        3 => micro::<3, TN>(k, ap, lda, bp, ldb, cp, ldc, acc),
                        4 => micro::<4, TN>(k, ap, lda, bp, ldb, cp, ldc, acc),
                        5 => micro::<5, TN>(k, ap, lda, bp, ldb, cp, ldc, acc),
                        _ => micro::<6, TN>(k, ap, lda, bp, ldb, cp, ldc, acc),
                    }
                }
                r0 += rows;
            }
            j0 += 16;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn exp2_vec(x: __m256) -> __m256 {
        // Above 127 the result is 2^127 * p (no wrap of the exponent field).
        // Constant first: `min` returns the second operand on NaN, so NaN propagates.
        exp2_nonpos(_mm256_min_ps(_mm256_set1_ps(127.0), x))
    }

    /// `2^x` for `x <= 127` or NaN (a softmax weight `s - max` is never positive).
    #[target_feature(enable = "avx2,fma")]
    fn exp2_nonpos(x: __m256) -> __m256 {
        // Below -127 the result is 0 (exponent field 0, mantissa 0 after the shift).
        // Constant first: `max` returns the second operand on NaN, so NaN propagates.
        let x = _mm256_max_ps(_mm256_set1_ps(-127.0), x);
        // Round to nearest by adding 1.5 * 2^23 (+ the exponent bias): the low mantissa
        // bits of `t` are then `n + 127`, which the shift below moves into the exponent
        // field (the higher bits shift out). Cheaper than round + convert.
        const MAGIC: f32 = 12_582_912.0 + 127.0;
        let t = _mm256_add_ps(x, _mm256_set1_ps(MAGIC));
        let f = _mm256_sub_ps(x, _mm256_sub_ps(t, _mm256_set1_ps(MAGIC)));
        let mut p = _mm256_set1_ps(EXP2_POLY[0]);
        for c in EXP2_POLY[1..].iter().copied() {
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
        }
        let bits = _mm256_slli_epi32::<23>(_mm256_castps_si256(t));
        _mm256_mul_ps(p, _mm256_castsi256_ps(bits))
    }

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    #[target_feature(enable = "avx2,fma")]
    fn hmax(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)))
    }

    /// `x[j] = exp2(x[j] - s - sv[j])` (`sv` absent = 0) for whole groups of 8 (the tail
    /// is left to the caller); returns the sum of the results and the count done.
    ///
    /// # Safety
    /// The CPU supports avx2 and fma; `x` (and `sv`) are valid for `len` elements.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp2_sub(x: *mut f32, len: usize, s: f32, sv: Option<*const f32>) -> (f32, usize) {
        let sub = _mm256_set1_ps(s);
        let mut sum = _mm256_setzero_ps();
        let mut j = 0;
        while j + 8 <= len {
            // SAFETY: j + 8 <= len.
            let mut v = unsafe { _mm256_loadu_ps(x.add(j)) };
            v = _mm256_sub_ps(v, sub);
            if let Some(sv) = sv {
                // SAFETY: j + 8 <= len.
                v = _mm256_sub_ps(v, unsafe { _mm256_loadu_ps(sv.add(j)) });
            }
            let e = exp2_vec(v);
            sum = _mm256_add_ps(sum, e);
            // SAFETY: j + 8 <= len.
            unsafe { _mm256_storeu_ps(x.add(j), e) };
            j += 8;
        }
        (hsum(sum), j)
    }

    /// `dp[j] = p[j] == 0 ? 0 : p[j] * (dp[j] - delta_j)` for the whole groups of 8
    /// (`delta_j` from `dv` when given, else `delta`), returning the count done.
    ///
    /// # Safety
    /// The CPU supports avx2 and fma; `p`, `dp` (and `dv`) are valid for `len` elements.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn ds_row(p: *const f32, dp: *mut f32, len: usize, dv: Option<*const f32>, delta: f32) -> usize {
        let zero = _mm256_setzero_ps();
        let dl = _mm256_set1_ps(delta);
        let mut j = 0;
        while j + 8 <= len {
            // SAFETY: j + 8 <= len for every pointer.
            unsafe {
                let pv = _mm256_loadu_ps(p.add(j));
                let d = match dv {
                    Some(dv) => _mm256_loadu_ps(dv.add(j)),
                    None => dl,
                };
                let v = _mm256_mul_ps(pv, _mm256_sub_ps(_mm256_loadu_ps(dp.add(j)), d));
                // Exactly 0 where p == 0 (a masked weight), whatever dp holds.
                let keep = _mm256_cmp_ps::<_CMP_NEQ_UQ>(pv, zero);
                _mm256_storeu_ps(dp.add(j), _mm256_and_ps(keep, v));
            }
            j += 8;
        }
        j
    }

    /// `out[j] = mul * f32(h[j])` for the whole groups of 8 of `len` f16 bit patterns
    /// (F16C, exact), returning the count done.
    ///
    /// # Safety
    /// The CPU supports avx2 and f16c; `h` is valid for `len` reads, `out` for `len` writes.
    /// One online-softmax step on a score tile with queries in lanes (the AVX2 form of
    /// `avx512::imp::softmax_lanes`, 8 lanes per group; same contract).
    ///
    /// # Safety
    /// The CPU supports avx2 and fma; `s` is valid for `rows * lanes` reads and writes
    /// (`lanes` a multiple of 8), `m` and `l` for `lanes`, `o` for `dp * lanes`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax_lanes(s: *mut f32, rows: usize, lanes: usize, tau: f32, st: RawLaneState) {
        let RawLaneState { m, l, o, dp } = st;
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        for g in (0..lanes).step_by(8) {
            // SAFETY: in this whole block, every offset is `r * lanes + g + 0..8` with r < rows,
            // `g + 0..8` < lanes, or `e * lanes + g + 0..8` with e < dp.
            unsafe {
                let (mut x0, mut x1) = (ninf, ninf);
                let mut r = 0;
                while r + 2 <= rows {
                    x0 = _mm256_max_ps(x0, _mm256_loadu_ps(s.add(r * lanes + g)));
                    x1 = _mm256_max_ps(x1, _mm256_loadu_ps(s.add((r + 1) * lanes + g)));
                    r += 2;
                }
                if r < rows {
                    x0 = _mm256_max_ps(x0, _mm256_loadu_ps(s.add(r * lanes + g)));
                }
                let tile_max = _mm256_max_ps(x0, x1);
                let m_old = _mm256_loadu_ps(m.add(g));
                // Ordered compare: a NaN maximum raises nothing (its weights poison `l`).
                let raise = _mm256_cmp_ps::<_CMP_GT_OQ>(tile_max, _mm256_add_ps(m_old, _mm256_set1_ps(tau)));
                let m_new = _mm256_blendv_ps(m_old, tile_max, raise);
                _mm256_storeu_ps(m.add(g), m_new);
                let corr = _mm256_blendv_ps(_mm256_set1_ps(1.0), exp2_nonpos(_mm256_sub_ps(m_old, m_new)), raise);
                let none = _mm256_cmp_ps::<_CMP_EQ_OQ>(m_new, ninf);
                let base = _mm256_blendv_ps(m_new, _mm256_setzero_ps(), none);
                let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut r = 0;
                while r + 2 <= rows {
                    let (p0, p1) = (s.add(r * lanes + g), s.add((r + 1) * lanes + g));
                    let e0 = exp2_nonpos(_mm256_sub_ps(_mm256_loadu_ps(p0), base));
                    let e1 = exp2_nonpos(_mm256_sub_ps(_mm256_loadu_ps(p1), base));
                    s0 = _mm256_add_ps(s0, e0);
                    s1 = _mm256_add_ps(s1, e1);
                    _mm256_storeu_ps(p0, e0);
                    _mm256_storeu_ps(p1, e1);
                    r += 2;
                }
                if r < rows {
                    let p0 = s.add(r * lanes + g);
                    let e0 = exp2_nonpos(_mm256_sub_ps(_mm256_loadu_ps(p0), base));
                    s0 = _mm256_add_ps(s0, e0);
                    _mm256_storeu_ps(p0, e0);
                }
                let l_old = _mm256_loadu_ps(l.add(g));
                _mm256_storeu_ps(l.add(g), _mm256_fmadd_ps(l_old, corr, _mm256_add_ps(s0, s1)));
                if _mm256_movemask_ps(raise) != 0 {
                    for e in 0..dp {
                        let p = o.add(e * lanes + g);
                        _mm256_storeu_ps(p, _mm256_mul_ps(corr, _mm256_loadu_ps(p)));
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn f16_to_f32(h: *const u16, len: usize, mul: f32, out: *mut f32) -> usize {
        let m = _mm256_set1_ps(mul);
        let mut j = 0;
        while j + 8 <= len {
            // SAFETY: j + 8 <= len for both pointers.
            unsafe {
                let x = _mm256_cvtph_ps(_mm_loadu_si128(h.add(j).cast()));
                _mm256_storeu_ps(out.add(j), _mm256_mul_ps(m, x));
            }
            j += 8;
        }
        j
    }

    /// Largest element of the whole groups of 8, and the count done.
    ///
    /// # Safety
    /// The CPU supports avx2 and fma; `x` is valid for `len` elements.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn max(x: *const f32, len: usize) -> (f32, usize) {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut j = 0;
        while j + 8 <= len {
            // SAFETY: j + 8 <= len.
            m = _mm256_max_ps(m, unsafe { _mm256_loadu_ps(x.add(j)) });
            j += 8;
        }
        (hmax(m), j)
    }
}

#[cfg(target_arch = "x86_64")]
use crate::cpu::isa::cpu_features;
use crate::cpu::isa::mat::{LaneState, MatMul};
use crate::cpu::isa::portable;

/// `C[m x n] (=|+=) A[m x k] * B[k x n]` with AVX2+FMA (`n` a multiple of 16); A
/// row-major, or column-major (`A[r, kk]` at `a[kk*lda + r]`) with `TN`.
pub(crate) fn gemm<const TN: bool>(mm: &MatMul<'_>, c: &mut [f32], ldc: usize, acc: bool) {
    portable::check_gemm::<TN>(mm, c, ldc);
    #[cfg(target_arch = "x86_64")]
    if cpu_features::avx2_fma() {
        // SAFETY: avx2 and fma are present and `check_gemm` proved every index in bounds
        // (with k == 0 no A or B element is read).
        unsafe { imp::gemm::<TN>(mm.raw(), c.as_mut_ptr(), ldc, acc) };
        return;
    }
    portable::gemm::<TN>(mm, c, ldc, acc)
}

/// `x[j] = exp2(x[j] - s - sv[j])`, returning the sum (AVX2).
pub(crate) fn exp2_sub(x: &mut [f32], s: f32, sv: Option<&[f32]>) -> f32 {
    if let Some(sv) = sv {
        assert!(sv.len() >= x.len(), "exp2_sub: sv too short");
    }
    #[cfg(target_arch = "x86_64")]
    if cpu_features::avx2_fma() {
        // SAFETY: avx2 and fma are present; `x` and `sv` hold at least `x.len()` elements.
        let (sum, done) = unsafe { imp::exp2_sub(x.as_mut_ptr(), x.len(), s, sv.map(|v| v.as_ptr())) };
        return sum + portable::exp2_sub(&mut x[done..], s, sv.map(|v| &v[done..]));
    }
    portable::exp2_sub(x, s, sv)
}

/// `out[e] = mul * row[e]` (`out` at least as long as `row`), with F16C for f16 rows
/// where the CPU has it (the conversion is exact: the same bits as `to_f32`). Returns
/// false, converting nothing, when this path does not apply (other dtypes, no F16C).
pub(crate) fn f16_row_to_f32<T: attn_core::Element>(row: &[T], mul: f32, out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<half::f16>() && cpu_features::f16c() {
        assert!(out.len() >= row.len(), "f16_row_to_f32: out too short");
        // SAFETY: T is half::f16 (same TypeId), a `#[repr(transparent)]` u16, so the row
        // is `row.len()` valid u16 values; avx2 and f16c are present; `out` holds
        // `row.len()` floats (checked above).
        let done = unsafe { imp::f16_to_f32(row.as_ptr().cast(), row.len(), mul, out.as_mut_ptr()) };
        for (o, x) in out[done..row.len()].iter_mut().zip(&row[done..]) {
            *o = mul * x.to_f32();
        }
        return true;
    }
    let _ = (row, mul, out);
    false
}

/// [`crate::cpu::isa::portable::fold_row`] compiled with AVX2 where the CPU has it (its plain
/// loops then vectorise 256 bits wide; SSE2 has no 32-bit maximum).
pub(crate) fn fold_row<T: attn_core::Element>(
    row: &[T],
    abs_mask: i32,
    inf: i32,
    acc: &mut [i32; 16],
    acc16: &mut [i16; 32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn run<T: attn_core::Element>(row: &[T], abs_mask: i32, inf: i32, acc: &mut [i32; 16], acc16: &mut [i16; 32]) {
            crate::cpu::isa::portable::fold_row(row, abs_mask, inf, acc, acc16)
        }
        if cpu_features::avx2_fma() {
            // SAFETY: the CPU has avx2 (checked on this line); `run` only calls the safe fold.
            return unsafe { run(row, abs_mask, inf, acc, acc16) };
        }
    }
    crate::cpu::isa::portable::fold_row(row, abs_mask, inf, acc, acc16)
}

/// One online-softmax step on a score tile with queries in lanes (see
/// `imp::softmax_lanes`); false when AVX2 is absent (the caller runs the portable one).
pub(crate) fn softmax_lanes(s: &mut [f32], rows: usize, lanes: usize, tau: f32, st: &mut LaneState<'_>) -> bool {
    let (m, l, o, dp) = (&*st.m, &*st.l, &*st.o, st.dp);
    assert!(lanes.is_multiple_of(8) && s.len() >= rows * lanes, "softmax_lanes: tile out of bounds");
    assert!(m.len() >= lanes && l.len() >= lanes && o.len() >= dp * lanes, "softmax_lanes: state out of bounds");
    #[cfg(target_arch = "x86_64")]
    if cpu_features::avx2_fma() {
        // SAFETY: avx2 and fma are present; the asserts above cover every index reached.
        unsafe { imp::softmax_lanes(s.as_mut_ptr(), rows, lanes, tau, st.raw()) };
        return true;
    }
    let _ = (s, rows, lanes, tau, st);
    false
}

/// `dp[j] = p[j] == 0 ? 0 : p[j] * (dp[j] - delta_j)` for `j < dp.len()`, where
/// `delta_j = dv[j]` when given, else `delta`.
pub(crate) fn ds_row(p: &[f32], dp: &mut [f32], dv: Option<&[f32]>, delta: f32) {
    assert!(p.len() >= dp.len() && dv.is_none_or(|v| v.len() >= dp.len()), "ds_row: short input");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if cpu_features::avx2_fma() {
        // SAFETY: avx2 and fma are present; `p` and `dv` hold at least `dp.len()` floats.
        done = unsafe { imp::ds_row(p.as_ptr(), dp.as_mut_ptr(), dp.len(), dv.map(|v| v.as_ptr()), delta) };
    }
    for j in done..dp.len() {
        let d = dv.map_or(delta, |v| v[j]);
        dp[j] = if p[j] == 0.0 { 0.0 } else { p[j] * (dp[j] - d) };
    }
}

/// Ask the CPU to bring `row` into L1 (a hint: no effect on results). The packing
/// loops call it a few rows ahead, because strided dilated rows defeat the hardware
/// prefetcher and every row would otherwise wait for memory.
#[inline]
pub(crate) fn prefetch_row<T>(row: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let bytes = std::mem::size_of_val(row);
        let base = row.as_ptr().cast::<i8>();
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults and reads nothing architecturally; the
            // address is inside `row` (off < its byte length).
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(base.add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// Largest element of `x` (AVX2).
pub(crate) fn max(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if cpu_features::avx2_fma() {
        // SAFETY: avx2 and fma are present; `x` holds `x.len()` elements.
        let (m, done) = unsafe { imp::max(x.as_ptr(), x.len()) };
        return m.max(portable::max(&x[done..]));
    }
    portable::max(x)
}
