//! Plain Rust for every target: the portable vectors ([`Portable`], 16 lanes as an
//! array, which the compiler vectorises for the baseline target) for the algorithms of
//! `kernels`, the scalar `exp2`, and the score-bound row fold.
#![allow(unsafe_code)]

use crate::cpu::isa::simd::{Simd, WithSimd};

/// Token of the portable vectors (always available).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Portable;

/// Lanes of a portable vector.
const L: usize = 16;

/// `[f(a[i], b[i])]` over the lanes.
#[inline(always)]
fn zip<R: Copy + Default>(a: [f32; L], b: [f32; L], f: impl Fn(f32, f32) -> R) -> [R; L] {
    let mut r = [R::default(); L];
    for i in 0..L {
        r[i] = f(a[i], b[i]);
    }
    r
}

impl Simd for Portable {
    const LANES: usize = L;
    const PANEL_VECS: usize = 1;
    type V = [f32; L];
    type M = [bool; L];

    #[inline(always)]
    fn vectorize<Op: WithSimd>(self, op: Op) -> Op::Output {
        op.with_simd(self)
    }
    #[inline(always)]
    fn splat(self, x: f32) -> [f32; L] {
        [x; L]
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> [f32; L] {
        // SAFETY: `p` is valid for `L` reads (the trait's contract); unaligned read.
        unsafe { p.cast::<[f32; L]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: [f32; L]) {
        // SAFETY: `p` is valid for `L` writes (the trait's contract); unaligned write.
        unsafe { p.cast::<[f32; L]>().write_unaligned(v) }
    }
    #[inline(always)]
    unsafe fn load_part(self, p: *const f32, n: usize) -> [f32; L] {
        let mut v = [0.0; L];
        // SAFETY: `p` is valid for `n < L` reads (the trait's contract).
        v[..n].copy_from_slice(unsafe { std::slice::from_raw_parts(p, n) });
        v
    }
    #[inline(always)]
    unsafe fn store_part(self, p: *mut f32, n: usize, v: [f32; L]) {
        // SAFETY: `p` is valid for `n < L` writes (the trait's contract).
        unsafe { std::slice::from_raw_parts_mut(p, n) }.copy_from_slice(&v[..n]);
    }
    #[inline(always)]
    fn first(self, n: usize) -> [bool; L] {
        std::array::from_fn(|i| i < n)
    }
    #[inline(always)]
    fn add(self, a: [f32; L], b: [f32; L]) -> [f32; L] {
        zip(a, b, |x, y| x + y)
    }
    #[inline(always)]
    fn sub(self, a: [f32; L], b: [f32; L]) -> [f32; L] {
        zip(a, b, |x, y| x - y)
    }
    #[inline(always)]
    fn mul(self, a: [f32; L], b: [f32; L]) -> [f32; L] {
        zip(a, b, |x, y| x * y)
    }
    #[inline(always)]
    fn fma(self, a: [f32; L], b: [f32; L], c: [f32; L]) -> [f32; L] {
        // Unfused: `mul_add` without hardware FMA is a slow library call.
        zip(zip(a, b, |x, y| x * y), c, |p, z| p + z)
    }
    #[inline(always)]
    fn max(self, a: [f32; L], b: [f32; L]) -> [f32; L] {
        zip(a, b, |x, y| if x > y { x } else { y })
    }
    #[inline(always)]
    fn min(self, a: [f32; L], b: [f32; L]) -> [f32; L] {
        zip(a, b, |x, y| if x < y { x } else { y })
    }
    #[inline(always)]
    fn gt(self, a: [f32; L], b: [f32; L]) -> [bool; L] {
        zip(a, b, |x, y| x > y)
    }
    #[inline(always)]
    fn eq(self, a: [f32; L], b: [f32; L]) -> [bool; L] {
        zip(a, b, |x, y| x == y)
    }
    #[inline(always)]
    fn ne(self, a: [f32; L], b: [f32; L]) -> [bool; L] {
        zip(a, b, |x, y| x != y)
    }
    #[inline(always)]
    fn select(self, m: [bool; L], t: [f32; L], f: [f32; L]) -> [f32; L] {
        std::array::from_fn(|i| if m[i] { t[i] } else { f[i] })
    }
    #[inline(always)]
    fn any(self, m: [bool; L]) -> bool {
        m.iter().any(|&x| x)
    }
    #[inline(always)]
    fn shl23(self, v: [f32; L]) -> [f32; L] {
        v.map(|x| f32::from_bits(x.to_bits() << 23))
    }
    #[inline(always)]
    fn reduce_add(self, v: [f32; L]) -> f32 {
        v.iter().sum()
    }
    #[inline(always)]
    fn reduce_max(self, v: [f32; L]) -> f32 {
        v.iter().copied().fold(f32::NEG_INFINITY, |m, x| if m > x { m } else { x })
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
