//! The tile primitives, each written once over [`Simd`] and monomorphised per
//! instruction set: the register-blocked matrix product, `exp2` of a row, row maxima,
//! the lane softmax step and the backward's `dS` rows. Each public function checks its
//! slice bounds, then runs its algorithm through [`Simd::vectorize`], so the whole
//! algorithm is compiled with the instruction set's target features.
#![allow(unsafe_code)]

use crate::cpu::isa::mat::{Accumulate, LaneState, MatMul, RawMatMul};
use crate::cpu::isa::simd::{Simd, WithSimd};

/// Rows per register block of the micro-kernel.
pub(crate) const ROW_BLOCK: usize = 6;

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
pub(crate) fn exp2_scalar(x: f32) -> f32 {
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

/// `2^x` for `x <= 127` or NaN (a softmax weight `x` is never positive); 0 below -127
/// (no subnormal results, so no microcode assists). Rounds to nearest by adding
/// 1.5 * 2^23 (+ the exponent bias): the low mantissa bits of `t` are then `n + 127`,
/// which the shift moves into the exponent field (the higher bits shift out).
#[inline(always)]
fn exp2_nonpos<S: Simd>(s: S, x: S::V) -> S::V {
    // Constant first: `max` returns the second operand on NaN, so NaN propagates.
    let x = s.max(s.splat(-127.0), x);
    const MAGIC: f32 = 12_582_912.0 + 127.0;
    let t = s.add(x, s.splat(MAGIC));
    let f = s.sub(x, s.sub(t, s.splat(MAGIC)));
    let mut p = s.splat(EXP2_POLY[0]);
    for c in EXP2_POLY[1..].iter().copied() {
        p = s.fma(p, f, s.splat(c));
    }
    s.mul(p, s.shl23(t))
}

/// `2^x`, at most `2^127` (NaN kept: constant first in `min`, which returns the second
/// operand on NaN).
#[inline(always)]
fn exp2<S: Simd>(s: S, x: S::V) -> S::V {
    exp2_nonpos(s, s.min(s.splat(127.0), x))
}

/// Bounds of a `gemm` call, A row-major or (`TN`) column-major (internal invariant: a
/// violation is a bug, so it panics).
fn check_gemm<const TN: bool>(mm: &MatMul<'_>, c: &[f32], ldc: usize) {
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

/// `C[m x n] (=|+=) A[m x k] * B[k x n]` (`n` a multiple of 16, row strides `ld*`); A
/// row-major, or (`TN`) column-major (`A[i, kk]` at `a[kk*lda + i]`: a row-major buffer
/// read in place as its transpose).
pub(crate) fn gemm<S: Simd, const TN: bool>(s: S, mm: &MatMul<'_>, c: &mut [f32], ldc: usize, acc: Accumulate) {
    check_gemm::<TN>(mm, c, ldc);
    struct Op<const TN: bool> {
        mm: RawMatMul,
        c: *mut f32,
        ldc: usize,
        acc: Accumulate,
    }
    impl<const TN: bool> WithSimd for Op<TN> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            // SAFETY: `check_gemm` proved every index the shapes reach in bounds (with
            // k == 0 no A or B element is read).
            unsafe { gemm_raw::<S, TN>(s, self.mm, self.c, self.ldc, self.acc) }
        }
    }
    s.vectorize(Op::<TN> { mm: mm.raw(), c: c.as_mut_ptr(), ldc, acc })
}

/// [`gemm`] on raw pointers: column panels of `PANEL_VECS` vectors outside, blocks of
/// [`ROW_BLOCK`] rows inside, so one panel of B stays in L1 while every row block of A
/// passes over it.
///
/// # Safety
/// The pointers cover every index the shapes reach.
#[inline(always)]
unsafe fn gemm_raw<S: Simd, const TN: bool>(s: S, mm: RawMatMul, c: *mut f32, ldc: usize, acc: Accumulate) {
    let RawMatMul { m, k, n, a, lda, b, ldb } = mm;
    let mut j0 = 0;
    while j0 < n {
        let cols = (n - j0).min(S::PANEL_VECS * S::LANES);
        let mut r0 = 0;
        while r0 < m {
            let rows = (m - r0).min(ROW_BLOCK);
            let a_off = if TN { r0 } else { r0 * lda };
            // SAFETY: offsets stay inside the caller's bounds (r0 + rows <= m, j0 + cols <= n).
            let (ap, bp, cp) = unsafe { (a.add(a_off), b.add(j0), c.add(r0 * ldc + j0)) };
            let mk = Micro { k, a: ap, lda, b: bp, ldb, c: cp, ldc, acc: acc == Accumulate::Add };
            // SAFETY: forwarded contract for this block of `rows` rows and `cols` columns.
            unsafe {
                match cols / S::LANES {
                    1 => rows_of::<S, 1, TN>(s, rows, mk),
                    2 => rows_of::<S, 2, TN>(s, rows, mk),
                    3 => rows_of::<S, 3, TN>(s, rows, mk),
                    _ => rows_of::<S, 4, TN>(s, rows, mk),
                }
            }
            r0 += rows;
        }
        j0 += cols;
    }
}

/// One register block's operands (see [`micro`]).
#[derive(Clone, Copy)]
struct Micro {
    k: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    acc: bool,
}

/// [`micro`] on a block of `rows` (1 to 6) rows.
///
/// # Safety
/// As [`micro`], for `R = rows`.
#[inline(always)]
unsafe fn rows_of<S: Simd, const V: usize, const TN: bool>(s: S, rows: usize, mk: Micro) {
    // SAFETY: forwarded contract.
    unsafe {
        match rows {
            1 => micro::<S, 1, V, TN>(s, mk),
            2 => micro::<S, 2, V, TN>(s, mk),
            3 => micro::<S, 3, V, TN>(s, mk),
            4 => micro::<S, 4, V, TN>(s, mk),
            5 => micro::<S, 5, V, TN>(s, mk),
            _ => micro::<S, 6, V, TN>(s, mk),
        }
    }
}

/// `C[R x V*LANES] (=|+=) A[R x k] * B[k x V*LANES]` with all of C kept in registers; A
/// row-major (`A[r, kk]` at `a[r*lda + kk]`), or column-major (`a[kk*lda + r]`) with `TN`.
///
/// # Safety
/// `a` is valid for reads at every `A[r, kk]` (r < R, kk < k), `b` at `kk*ldb + j`
/// (j < V*LANES), `c` for reads and writes at `r*ldc + j`.
#[inline(always)]
unsafe fn micro<S: Simd, const R: usize, const V: usize, const TN: bool>(s: S, mk: Micro) {
    let Micro { k, a, lda, b, ldb, c, ldc, acc } = mk;
    let l = S::LANES;
    let mut cr = [[s.splat(0.0); V]; R];
    if acc {
        for (r, row) in cr.iter_mut().enumerate() {
            for (v, x) in row.iter_mut().enumerate() {
                // SAFETY: in bounds by the function contract.
                *x = unsafe { s.load(c.add(r * ldc + l * v)) };
            }
        }
    }
    // Strides of A between rows and between steps of k.
    let (rs, ks) = if TN { (1, lda) } else { (lda, 1) };
    // Row pointers of A, advanced four steps of k per iteration: row-major, the
    // broadcasts use constant displacements, so the loop issues few integer ops (which
    // would compete with the FMAs for their ports).
    // SAFETY: in bounds by the function contract (r < R).
    let mut ap: [*const f32; R] = std::array::from_fn(|r| unsafe { a.add(r * rs) });
    let mut bp = b;
    for _ in 0..k / 4 {
        for u in 0..4 {
            let mut bv = [s.splat(0.0); V];
            for (v, x) in bv.iter_mut().enumerate() {
                // SAFETY: `bp + u*ldb` points at row kk + u < k of B (V*LANES readable elements).
                *x = unsafe { s.load(bp.add(u * ldb + l * v)) };
            }
            for (row, p) in cr.iter_mut().zip(ap.iter()) {
                // SAFETY: `p + u*ks` points at A[r, kk + u], kk + u < k.
                let av = s.splat(unsafe { *p.add(u * ks) });
                for (x, bx) in row.iter_mut().zip(&bv) {
                    *x = s.fma(av, *bx, *x);
                }
            }
        }
        // At most one step past A[r, k - 1] / one row past B's last row; read only while kk < k.
        ap.iter_mut().for_each(|p| *p = p.wrapping_add(4 * ks));
        bp = bp.wrapping_add(4 * ldb);
    }
    for _ in 0..k % 4 {
        let mut bv = [s.splat(0.0); V];
        for (v, x) in bv.iter_mut().enumerate() {
            // SAFETY: `bp` points at row kk < k of B (V*LANES readable elements).
            *x = unsafe { s.load(bp.add(l * v)) };
        }
        for (row, p) in cr.iter_mut().zip(ap.iter_mut()) {
            // SAFETY: `p` points at A[r, kk], in bounds by the function contract.
            let av = s.splat(unsafe { **p });
            for (x, bx) in row.iter_mut().zip(&bv) {
                *x = s.fma(av, *bx, *x);
            }
            // One step past A[r, kk] at most; read only while kk < k.
            *p = p.wrapping_add(ks);
        }
        // At most one row past the last row of B, never read.
        bp = bp.wrapping_add(ldb);
    }
    for (r, row) in cr.iter().enumerate() {
        for (v, x) in row.iter().enumerate() {
            // SAFETY: in bounds by the function contract.
            unsafe { s.store(c.add(r * ldc + l * v), *x) };
        }
    }
}

/// `C[i] += sum_{kk in ranges[i]} A[i, kk] * B[kk]` for `m = ranges.len()` rows, A
/// row-major or (`TN`) column-major (`A[i, kk]` at `a[kk*lda + i]`, a transposed buffer
/// read in place): each row reads only its own range of the inner dimension, so a masked
/// entry (weight 0) never multiplies a value it must not see (`0 * NaN` would leak the
/// NaN). The part common to all rows runs as one product; the rest row by row.
pub(crate) fn gemm_ranges<S: Simd, const TN: bool>(
    s: S,
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
            gemm::<S, TN>(s, &MatMul { m: 1, k: to - from, n, a, lda, b, ldb }, c, ldc, Accumulate::Add);
        }
    };
    if lo < hi {
        let common = MatMul { m: ranges.len(), k: hi - lo, n, a: &a[at(0, lo)..], lda, b: &b[lo * ldb..], ldb };
        gemm::<S, TN>(s, &common, c, ldc, Accumulate::Add);
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

/// `x[j] = exp2(x[j] - sub - sv[j])` (`sv` absent = 0), returning the sum.
pub(crate) fn exp2_sub<S: Simd>(s: S, x: &mut [f32], sub: f32, sv: Option<&[f32]>) -> f32 {
    assert!(sv.is_none_or(|v| v.len() >= x.len()), "exp2_sub: sv too short");
    struct Op<'a> {
        x: &'a mut [f32],
        sub: f32,
        sv: Option<&'a [f32]>,
    }
    impl WithSimd for Op<'_> {
        type Output = f32;
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) -> f32 {
            let (x, len, l) = (self.x.as_mut_ptr(), self.x.len(), S::LANES);
            let sv = self.sv.map(|v| v.as_ptr());
            let sub = s.splat(self.sub);
            let mut sum = s.splat(0.0);
            let mut j = 0;
            // SAFETY: whole vectors while j + LANES <= len, then the first
            // `len - j` lanes; `sv` holds at least `len` elements (asserted above).
            unsafe {
                while j + l <= len {
                    let mut v = s.sub(s.load(x.add(j)), sub);
                    if let Some(sv) = sv {
                        v = s.sub(v, s.load(sv.add(j)));
                    }
                    let e = exp2(s, v);
                    sum = s.add(sum, e);
                    s.store(x.add(j), e);
                    j += l;
                }
                if j < len {
                    let n = len - j;
                    let mut v = s.sub(s.load_part(x.add(j), n), sub);
                    if let Some(sv) = sv {
                        v = s.sub(v, s.load_part(sv.add(j), n));
                    }
                    let e = exp2(s, v);
                    sum = s.add(sum, s.select(s.first(n), e, s.splat(0.0)));
                    s.store_part(x.add(j), n, e);
                }
            }
            s.reduce_add(sum)
        }
    }
    s.vectorize(Op { x, sub, sv })
}

/// Largest element (`-inf` for an empty slice).
pub(crate) fn max<S: Simd>(s: S, x: &[f32]) -> f32 {
    struct Op<'a>(&'a [f32]);
    impl WithSimd for Op<'_> {
        type Output = f32;
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) -> f32 {
            let (x, len, l) = (self.0.as_ptr(), self.0.len(), S::LANES);
            let ninf = s.splat(f32::NEG_INFINITY);
            let mut m = ninf;
            let mut j = 0;
            // SAFETY: whole vectors while j + LANES <= len, then the rest.
            unsafe {
                while j + l <= len {
                    m = s.max(m, s.load(x.add(j)));
                    j += l;
                }
                if j < len {
                    let n = len - j;
                    m = s.max(m, s.select(s.first(n), s.load_part(x.add(j), n), ninf));
                }
            }
            s.reduce_max(m)
        }
    }
    s.vectorize(Op(x))
}

/// `dp[j] = p[j] == 0 ? 0 : p[j] * (dp[j] - delta_j)` for `j < dp.len()`, where
/// `delta_j = dv[j]` when given, else `delta`: exactly 0 where `p == 0` (a masked
/// weight), whatever `dp` holds.
pub(crate) fn ds_row<S: Simd>(s: S, p: &[f32], dp: &mut [f32], dv: Option<&[f32]>, delta: f32) {
    assert!(p.len() >= dp.len() && dv.is_none_or(|v| v.len() >= dp.len()), "ds_row: short input");
    struct Op<'a> {
        p: &'a [f32],
        dp: &'a mut [f32],
        dv: Option<&'a [f32]>,
        delta: f32,
    }
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            let (p, dp, len, l) = (self.p.as_ptr(), self.dp.as_mut_ptr(), self.dp.len(), S::LANES);
            let dv = self.dv.map(|v| v.as_ptr());
            let (zero, dl) = (s.splat(0.0), s.splat(self.delta));
            let step = |pv: S::V, dpv: S::V, d: S::V| s.select(s.ne(pv, zero), s.mul(pv, s.sub(dpv, d)), zero);
            let mut j = 0;
            // SAFETY: whole vectors while j + LANES <= len, then the first
            // `len - j` lanes; `p` and `dv` hold at least `len` elements (asserted above).
            unsafe {
                while j + l <= len {
                    let d = dv.map_or(dl, |dv| s.load(dv.add(j)));
                    s.store(dp.add(j), step(s.load(p.add(j)), s.load(dp.add(j)), d));
                    j += l;
                }
                if j < len {
                    let n = len - j;
                    let d = dv.map_or(dl, |dv| s.load_part(dv.add(j), n));
                    s.store_part(dp.add(j), n, step(s.load_part(p.add(j), n), s.load_part(dp.add(j), n), d));
                }
            }
        }
    }
    s.vectorize(Op { p, dp, dv, delta })
}

/// One online-softmax step on a tile of scores with queries in lanes: `rows` key rows
/// of `lanes` scores (a multiple of 16, also the row stride). Per lane, the running
/// maximum `m` is raised to the tile's maximum only where that exceeds it by more than
/// `tau` (so weights stay at most `2^tau` and most tiles rescale nothing); the tile
/// becomes its weights `exp2(s - m)` (0 for `-inf`), `l` is rescaled and adds the
/// column sums, and the raised lanes of the `dp` accumulator rows `o` (stride `lanes`)
/// are rescaled by `exp2(m_old - m_new)`.
pub(crate) fn softmax_lanes<S: Simd>(
    s: S,
    tile: &mut [f32],
    rows: usize,
    lanes: usize,
    tau: f32,
    st: &mut LaneState<'_>,
) {
    let (m, l, o, dp) = (&*st.m, &*st.l, &*st.o, st.dp);
    assert!(lanes.is_multiple_of(16) && tile.len() >= rows * lanes, "softmax_lanes: tile out of bounds");
    assert!(m.len() >= lanes && l.len() >= lanes && o.len() >= dp * lanes, "softmax_lanes: state out of bounds");
    struct Op {
        t: *mut f32,
        rows: usize,
        lanes: usize,
        tau: f32,
        m: *mut f32,
        l: *mut f32,
        o: *mut f32,
        dp: usize,
    }
    impl WithSimd for Op {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            let Op { t, rows, lanes, tau, m, l, o, dp } = self;
            let ninf = s.splat(f32::NEG_INFINITY);
            for g in (0..lanes).step_by(S::LANES) {
                // SAFETY: in this whole block, every offset is `r * lanes + g + 0..LANES`
                // with r < rows, `g + 0..LANES` < lanes, or `e * lanes + g + 0..LANES` with
                // e < dp (asserted above).
                unsafe {
                    let (mut x0, mut x1) = (ninf, ninf);
                    let mut r = 0;
                    while r + 2 <= rows {
                        x0 = s.max(x0, s.load(t.add(r * lanes + g)));
                        x1 = s.max(x1, s.load(t.add((r + 1) * lanes + g)));
                        r += 2;
                    }
                    if r < rows {
                        x0 = s.max(x0, s.load(t.add(r * lanes + g)));
                    }
                    let tile_max = s.max(x0, x1);
                    let m_old = s.load(m.add(g));
                    // Ordered compare: a NaN maximum raises nothing (its weights poison `l`).
                    let raise = s.gt(tile_max, s.add(m_old, s.splat(tau)));
                    let m_new = s.select(raise, tile_max, m_old);
                    s.store(m.add(g), m_new);
                    // exp2(-inf) = 0 where nothing was visible before.
                    let corr = s.select(raise, exp2_nonpos(s, s.sub(m_old, m_new)), s.splat(1.0));
                    // Lanes with nothing visible yet subtract 0, so their `-inf` scores give 0.
                    let base = s.select(s.eq(m_new, ninf), s.splat(0.0), m_new);
                    let (mut s0, mut s1) = (s.splat(0.0), s.splat(0.0));
                    let mut r = 0;
                    while r + 2 <= rows {
                        let (p0, p1) = (t.add(r * lanes + g), t.add((r + 1) * lanes + g));
                        let e0 = exp2_nonpos(s, s.sub(s.load(p0), base));
                        let e1 = exp2_nonpos(s, s.sub(s.load(p1), base));
                        s0 = s.add(s0, e0);
                        s1 = s.add(s1, e1);
                        s.store(p0, e0);
                        s.store(p1, e1);
                        r += 2;
                    }
                    if r < rows {
                        let p0 = t.add(r * lanes + g);
                        let e0 = exp2_nonpos(s, s.sub(s.load(p0), base));
                        s0 = s.add(s0, e0);
                        s.store(p0, e0);
                    }
                    let l_old = s.load(l.add(g));
                    s.store(l.add(g), s.fma(l_old, corr, s.add(s0, s1)));
                    if s.any(raise) {
                        for e in 0..dp {
                            let p = o.add(e * lanes + g);
                            s.store(p, s.mul(corr, s.load(p)));
                        }
                    }
                }
            }
        }
    }
    let (m, l, o) = (st.m.as_mut_ptr(), st.l.as_mut_ptr(), st.o.as_mut_ptr());
    s.vectorize(Op { t: tile.as_mut_ptr(), rows, lanes, tau, m, l, o, dp })
}
