//! Row helpers every flavour uses, on x86 features where the CPU has them (detected at
//! run time, whatever the kernel flavour): f16 rows to f32 with F16C, the score-bound
//! scan compiled for AVX2, and cache prefetch of rows about to be packed.
#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
use crate::cpu::isa::cpu_features;

/// `out[j] = mul * f32(h[j])` for the whole groups of 8 of `len` f16 bit patterns
/// (F16C, exact), returning the count done.
///
/// # Safety
/// The CPU supports avx2 and f16c; `h` is valid for `len` reads, `out` for `len` writes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_to_f32(h: *const u16, len: usize, mul: f32, out: *mut f32) -> usize {
    use std::arch::x86_64::*;
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
        let done = unsafe { f16_to_f32(row.as_ptr().cast(), row.len(), mul, out.as_mut_ptr()) };
        for (o, x) in out[done..row.len()].iter_mut().zip(&row[done..]) {
            *o = mul * x.to_f32();
        }
        return true;
    }
    let _ = (row, mul, out);
    false
}

/// [`fold`] compiled with AVX2 where the CPU has it (its plain
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
            fold(row, abs_mask, inf, acc, acc16)
        }
        if cpu_features::avx2_fma() {
            // SAFETY: the CPU has avx2 (checked on this line); `run` only calls the safe fold.
            return unsafe { run(row, abs_mask, inf, acc, acc16) };
        }
    }
    fold(row, abs_mask, inf, acc, acc16)
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

/// Folds one row into lane maxima of its sign-cleared bits (`& abs_mask`), counting
/// non-finite values (bits at or above `inf`) as 0: 32-bit formats into `acc`, 16-bit
/// ones into `acc16` (sign-cleared bits are non-negative as i32, and as i16 for the
/// 16-bit formats). Always inlined, so it vectorises for the caller's target features.
#[inline(always)]
fn fold<T: attn_core::Element>(row: &[T], abs_mask: i32, inf: i32, acc: &mut [i32; 16], acc16: &mut [i16; 32]) {
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
