//! The AVX-512F vectors ([`Avx512`]: 16 lanes, mask registers, four-vector column
//! panels) for the algorithms of `kernels`.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use crate::cpu::isa::cpu_features;
use crate::cpu::isa::simd::{Simd, WithSimd};

/// Token of AVX-512F: a value exists only where the CPU has it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512(());

impl Avx512 {
    /// The token, where the CPU has avx512f.
    pub(crate) fn new() -> Option<Avx512> {
        cpu_features::avx512f().then_some(Avx512(()))
    }
}

/// `unsafe { $($e)* }` in the methods below: intrinsics of this set, and the pointer
/// accesses whose bounds the trait's `# Safety` sections leave to the caller.
macro_rules! feat {
    ($($e:tt)*) => {
        // SAFETY: an `Avx512` token exists only where the CPU has avx512f (`Avx512::new`);
        // pointer arguments are valid as the calling `unsafe fn`'s contract requires.
        unsafe { $($e)* }
    };
}

impl Simd for Avx512 {
    const LANES: usize = 16;
    // 64-column panels: one panel of B stays in L1 while every row block passes over it.
    const PANEL_VECS: usize = 4;
    type V = __m512;
    type M = __mmask16;

    #[inline(always)]
    fn vectorize<Op: WithSimd>(self, op: Op) -> Op::Output {
        #[target_feature(enable = "avx512f")]
        unsafe fn run<Op: WithSimd>(s: Avx512, op: Op) -> Op::Output {
            op.with_simd(s)
        }
        feat!(run(self, op))
    }
    #[inline(always)]
    fn splat(self, x: f32) -> __m512 {
        feat!(_mm512_set1_ps(x))
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> __m512 {
        feat!(_mm512_loadu_ps(p))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: __m512) {
        feat!(_mm512_storeu_ps(p, v))
    }
    #[inline(always)]
    unsafe fn load_part(self, p: *const f32, n: usize) -> __m512 {
        feat!(_mm512_maskz_loadu_ps(self.first(n), p))
    }
    #[inline(always)]
    unsafe fn store_part(self, p: *mut f32, n: usize, v: __m512) {
        feat!(_mm512_mask_storeu_ps(p, self.first(n), v))
    }
    #[inline(always)]
    fn first(self, n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }
    #[inline(always)]
    fn add(self, a: __m512, b: __m512) -> __m512 {
        feat!(_mm512_add_ps(a, b))
    }
    #[inline(always)]
    fn sub(self, a: __m512, b: __m512) -> __m512 {
        feat!(_mm512_sub_ps(a, b))
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        feat!(_mm512_mul_ps(a, b))
    }
    #[inline(always)]
    fn fma(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        feat!(_mm512_fmadd_ps(a, b, c))
    }
    #[inline(always)]
    fn max(self, a: __m512, b: __m512) -> __m512 {
        feat!(_mm512_max_ps(a, b))
    }
    #[inline(always)]
    fn gt(self, a: __m512, b: __m512) -> __mmask16 {
        feat!(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b))
    }
    #[inline(always)]
    fn eq(self, a: __m512, b: __m512) -> __mmask16 {
        feat!(_mm512_cmp_ps_mask::<_CMP_EQ_OQ>(a, b))
    }
    #[inline(always)]
    fn ne(self, a: __m512, b: __m512) -> __mmask16 {
        feat!(_mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(a, b))
    }
    #[inline(always)]
    fn select(self, m: __mmask16, t: __m512, f: __m512) -> __m512 {
        feat!(_mm512_mask_mov_ps(f, m, t))
    }
    #[inline(always)]
    fn any(self, m: __mmask16) -> bool {
        m != 0
    }
    #[inline(always)]
    fn min(self, a: __m512, b: __m512) -> __m512 {
        feat!(_mm512_min_ps(a, b))
    }
    #[inline(always)]
    fn shl23(self, v: __m512) -> __m512 {
        feat!(_mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_castps_si512(v))))
    }
    #[inline(always)]
    fn reduce_add(self, v: __m512) -> f32 {
        feat!(_mm512_reduce_add_ps(v))
    }
    #[inline(always)]
    fn reduce_max(self, v: __m512) -> f32 {
        feat!(_mm512_reduce_max_ps(v))
    }
}
