//! The portable vectors ([`Portable`]: 16 lanes as an array of plain Rust, which the
//! compiler vectorises for the baseline target, on every target) for the algorithms
//! of `kernels`.
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
