//! The vector primitives of one instruction set ([`Simd`], one implementation each in
//! `portable`, `avx2` and `avx512`; the token for a piece is chosen once, in `ops`) and
//! the way into code compiled with the set's target features ([`WithSimd`], run by
//! [`Simd::vectorize`]).
#![allow(unsafe_code)]

/// An operation written once over [`Simd`]: `with_simd` is monomorphised per instruction
/// set and, run through [`Simd::vectorize`], inlined into a function compiled with that
/// set's target features. Implementations and everything they call on the vectors must
/// be `#[inline(always)]`, so no call leaves the target-feature function.
pub(crate) trait WithSimd {
    type Output;
    fn with_simd<S: Simd>(self, s: S) -> Self::Output;
}

/// One instruction set's f32 vectors (`LANES` wide) and the operations the kernels'
/// algorithms (`kernels`) use on them. A value of an implementing type is a token: it
/// exists only where the CPU runs the instruction set, so its safe methods may use
/// it. Every method is `#[inline(always)]`.
pub(crate) trait Simd: Copy + std::fmt::Debug {
    /// f32 lanes per vector (a divisor of 16).
    const LANES: usize;
    /// Vectors per column panel of the matrix product (the panel of B kept in L1).
    const PANEL_VECS: usize;
    /// A vector of `LANES` f32.
    type V: Copy;
    /// A lane mask.
    type M: Copy;

    /// `op` run in a function compiled with this instruction set's target features.
    fn vectorize<Op: WithSimd>(self, op: Op) -> Op::Output;

    /// Every lane `x`.
    fn splat(self, x: f32) -> Self::V;
    /// `LANES` floats from `p`.
    ///
    /// # Safety
    /// `p` is valid for `LANES` reads.
    unsafe fn load(self, p: *const f32) -> Self::V;
    /// `LANES` floats to `p`.
    ///
    /// # Safety
    /// `p` is valid for `LANES` writes.
    unsafe fn store(self, p: *mut f32, v: Self::V);
    /// The first `n < LANES` floats from `p`, the other lanes 0.
    ///
    /// # Safety
    /// `p` is valid for `n` reads.
    unsafe fn load_part(self, p: *const f32, n: usize) -> Self::V;
    /// The first `n < LANES` lanes of `v` to `p`.
    ///
    /// # Safety
    /// `p` is valid for `n` writes.
    unsafe fn store_part(self, p: *mut f32, n: usize, v: Self::V);
    /// The mask of the first `n < LANES` lanes.
    fn first(self, n: usize) -> Self::M;

    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    fn sub(self, a: Self::V, b: Self::V) -> Self::V;
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c` (fused where the instruction set has FMA).
    fn fma(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// Lane-wise `a > b ? a : b`: `b` where either is NaN (the x86 `max` rule).
    fn max(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a > b` (false where either is NaN).
    fn gt(self, a: Self::V, b: Self::V) -> Self::M;
    /// `a == b` (false where either is NaN).
    fn eq(self, a: Self::V, b: Self::V) -> Self::M;
    /// `a != b` (true where either is NaN).
    fn ne(self, a: Self::V, b: Self::V) -> Self::M;
    /// `m ? t : f` per lane.
    fn select(self, m: Self::M, t: Self::V, f: Self::V) -> Self::V;
    /// Whether any lane of `m` is set.
    fn any(self, m: Self::M) -> bool;
    /// Lane-wise `a < b ? a : b`: `b` where either is NaN (the x86 `min` rule).
    fn min(self, a: Self::V, b: Self::V) -> Self::V;
    /// Each lane's bits shifted left by 23 (into the exponent field), as f32.
    fn shl23(self, v: Self::V) -> Self::V;
    /// Sum of the lanes.
    fn reduce_add(self, v: Self::V) -> f32;
    /// Largest lane.
    fn reduce_max(self, v: Self::V) -> f32;
}
