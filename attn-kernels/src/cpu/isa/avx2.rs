//! The AVX2+FMA vectors ([`Avx2`]: 8 lanes, two-vector column panels) for the
//! algorithms of `kernels`, on x86-64 CPUs without AVX-512.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use crate::cpu::isa::cpu_features;
use crate::cpu::isa::simd::{Simd, WithSimd};

/// Token of AVX2 with FMA: a value exists only where the CPU has both.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// The token, where the CPU has avx2 and fma.
    pub(crate) fn new() -> Option<Avx2> {
        cpu_features::avx2_fma().then_some(Avx2(()))
    }
}

/// `unsafe { $($e)* }` in the methods below: intrinsics of this set, and the pointer
/// accesses whose bounds the trait's `# Safety` sections leave to the caller.
macro_rules! feat {
    ($($e:tt)*) => {
        // SAFETY: an `Avx2` token exists only where the CPU has avx2 and fma (`Avx2::new`);
        // pointer arguments are valid as the calling `unsafe fn`'s contract requires.
        unsafe { $($e)* }
    };
}

impl Simd for Avx2 {
    const LANES: usize = 8;
    // 16-column panels: one panel of B stays in L1 while every row block passes over it.
    const PANEL_VECS: usize = 2;
    type V = __m256;
    type M = __m256;

    #[inline(always)]
    fn vectorize<Op: WithSimd>(self, op: Op) -> Op::Output {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run<Op: WithSimd>(s: Avx2, op: Op) -> Op::Output {
            op.with_simd(s)
        }
        feat!(run(self, op))
    }
    #[inline(always)]
    fn splat(self, x: f32) -> __m256 {
        feat!(_mm256_set1_ps(x))
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> __m256 {
        feat!(_mm256_loadu_ps(p))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: __m256) {
        feat!(_mm256_storeu_ps(p, v))
    }
    #[inline(always)]
    unsafe fn load_part(self, p: *const f32, n: usize) -> __m256 {
        feat!(_mm256_maskload_ps(p, _mm256_castps_si256(self.first(n))))
    }
    #[inline(always)]
    unsafe fn store_part(self, p: *mut f32, n: usize, v: __m256) {
        feat!(_mm256_maskstore_ps(p, _mm256_castps_si256(self.first(n)), v))
    }
    #[inline(always)]
    fn first(self, n: usize) -> __m256 {
        feat! {
            let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lane))
        }
    }
    #[inline(always)]
    fn add(self, a: __m256, b: __m256) -> __m256 {
        feat!(_mm256_add_ps(a, b))
    }
    #[inline(always)]
    fn sub(self, a: __m256, b: __m256) -> __m256 {
        feat!(_mm256_sub_ps(a, b))
    }
    #[inline(always)]
    fn mul(self, a: __m256, b: __m256) -> __m256 {
        feat!(_mm256_mul_ps(a, b))
    }
    #[inline(always)]
    fn fma(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        feat!(_mm256_fmadd_ps(a, b, c))
    }
    #[inline(always)]
    fn max(self, a: __m256, b: __m256) -> __m256 {
        feat!(_mm256_max_ps(a, b))
    }
    #[inline(always)]
    fn min(self, a: __m256, b: __m256) -> __m256 {
        feat!(_mm256_min_ps(a, b))
    }
    #[inline(always)]
    fn gt(self, a: __m256, b: __m256) -> __m256 {
        feat!(_mm256_cmp_ps::<_CMP_GT_OQ>(a, b))
    }
    #[inline(always)]
    fn eq(self, a: __m256, b: __m256) -> __m256 {
        feat!(_mm256_cmp_ps::<_CMP_EQ_OQ>(a, b))
    }
    #[inline(always)]
    fn ne(self, a: __m256, b: __m256) -> __m256 {
        feat!(_mm256_cmp_ps::<_CMP_NEQ_UQ>(a, b))
    }
    #[inline(always)]
    fn select(self, m: __m256, t: __m256, f: __m256) -> __m256 {
        feat!(_mm256_blendv_ps(f, t, m))
    }
    #[inline(always)]
    fn any(self, m: __m256) -> bool {
        feat!(_mm256_movemask_ps(m) != 0)
    }
    #[inline(always)]
    fn shl23(self, v: __m256) -> __m256 {
        feat!(_mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_castps_si256(v))))
    }
    #[inline(always)]
    fn reduce_add(self, v: __m256) -> f32 {
        feat! {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
        }
    }
    #[inline(always)]
    fn reduce_max(self, v: __m256) -> f32 {
        feat! {
            let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)))
        }
    }
}
