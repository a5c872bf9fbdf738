//! AVX-512 packing into the pair layouts: 16 key rows at a time through a 16 x 16
//! transpose of bf16 pairs (one store per tile row instead of 16 scattered ones), and
//! two value rows at a time interleaved into pairs; each with the non-finite check.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use attn_core::Element;

use super::super::layout::{KC, TILE};

/// AVX-512F, BW and VL (every CPU with AVX512-BF16 has them; asked once).
pub(in super::super) fn available() -> bool {
    crate::cpu::isa::cpu_features::avx512bw_vl()
}

/// Keys `rows[j]` (j < 16, each at least `d` bf16) into the key tiles of one 16-key
/// group: pair `p` of tile `c` (at `dst[c * stride..]`), column `j`, holds
/// `rows[j][32c + 2p ..= 32c + 2p + 1]`, zero past `d` and for `j >= rows.len()`.
/// Returns whether every value read is finite.
pub(in super::super) fn key_group<T: Element>(
    rows: &[&[T]],
    d: usize,
    qc: usize,
    dst: &mut [u32],
    stride: usize,
) -> bool {
    assert!(available() && size_of::<T>() == 2, "pair packing: needs AVX512-BW/VL and 2-byte values");
    assert!(rows.len() <= 16 && rows.iter().all(|r| r.len() >= d), "pair packing: rows too short");
    assert!(qc >= 1 && d <= qc * KC && stride >= TILE, "pair packing: bad geometry");
    assert!(dst.len() >= (qc - 1) * stride + TILE, "pair packing: tiles too short");
    let mut src = [std::ptr::null::<u16>(); 16];
    for (s, r) in src.iter_mut().zip(rows) {
        *s = r.as_ptr().cast();
    }
    // SAFETY: AVX-512F/BW are present (checked); row j < rows.len() is readable for `d`
    // 2-byte values, and the loads are masked to columns below `d`; tile c's 256 pairs
    // start at c * stride inside `dst` (checked).
    unsafe { key_group_avx512(&src, rows.len(), d, qc, dst.as_mut_ptr(), stride) }
}

/// Value rows `r0` and (if present) `r1` into tile row `p` of the `ne` value tiles at
/// `dst[e * TILE..]`: pair `j` of tile `e` holds `(r0[16e + j], r1[16e + j])`, zero past
/// `d` (and for a missing `r1`). Returns whether every value read is finite.
pub(in super::super) fn value_pair<T: Element>(
    r0: &[T],
    r1: Option<&[T]>,
    d: usize,
    ne: usize,
    dst: &mut [u32],
) -> bool {
    assert!(available() && size_of::<T>() == 2, "pair packing: needs AVX512-BW/VL and 2-byte values");
    assert!(r0.len() >= d && r1.is_none_or(|r| r.len() >= d), "pair packing: rows too short");
    assert!(d <= ne * 16 && ne >= 1 && dst.len() >= (ne - 1) * TILE + 16, "pair packing: tiles too short");
    let p1 = r1.map_or(std::ptr::null(), |r| r.as_ptr().cast());
    // SAFETY: AVX-512F/BW/VL are present; both rows are readable for `d` values and the loads
    // are masked below `d`; 16 pairs at e * TILE are inside `dst` for e < ne (checked).
    unsafe { value_pair_avx512(r0.as_ptr().cast(), p1, d, ne, dst.as_mut_ptr()) }
}

/// Lanes (16-bit) of `v` that hold a NaN or infinite bf16 (exponent bits all ones).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn nonfinite(v: __m512i) -> __mmask32 {
    let exp = _mm512_set1_epi16(0x7f80);
    _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, exp), exp)
}

/// The lowest `n` (at most 32) lanes.
fn low_lanes(n: usize) -> u32 {
    if n >= 32 { u32::MAX } else { (1u32 << n) - 1 }
}

/// In place: `r[p]` lane `j` becomes the old `r[j]` lane `p` (16 x 16 of 32-bit lanes).
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: &mut [__m512i; 16]) {
    let mut t = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for b in (0..16).step_by(4) {
        r[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
        r[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
        r[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
        r[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
    }
    for h in [0, 8] {
        for k in 0..4 {
            t[h + k] = _mm512_shuffle_i32x4::<0x88>(r[h + k], r[h + k + 4]);
            t[h + k + 4] = _mm512_shuffle_i32x4::<0xdd>(r[h + k], r[h + k + 4]);
        }
    }
    for k in 0..8 {
        r[k] = _mm512_shuffle_i32x4::<0x88>(t[k], t[k + 8]);
        r[k + 8] = _mm512_shuffle_i32x4::<0xdd>(t[k], t[k + 8]);
    }
}

/// # Safety
/// AVX-512F/BW; `src[j]` for j < n readable for `d` u16; tiles at `dst + c * stride`
/// writable for 256 u32 (c < qc); d <= 32 qc.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn key_group_avx512(
    src: &[*const u16; 16],
    n: usize,
    d: usize,
    qc: usize,
    dst: *mut u32,
    stride: usize,
) -> bool {
    let mut bad = 0u32;
    for c in 0..qc {
        let m = low_lanes(d - (c * KC).min(d));
        let mut r = [_mm512_setzero_si512(); 16];
        for (rj, s) in r.iter_mut().zip(&src[..n]) {
            // SAFETY: masked to columns c*32 + i < d of a row readable for d values.
            *rj = unsafe { _mm512_maskz_loadu_epi16(m, s.add(c * KC).cast()) };
            bad |= nonfinite(*rj);
        }
        transpose16(&mut r);
        for (p, rp) in r.iter().enumerate() {
            // SAFETY: tile c holds 16 rows of 16 pairs from dst + c * stride (contract).
            unsafe { _mm512_storeu_si512(dst.add(c * stride + p * 16).cast(), *rp) };
        }
    }
    bad == 0
}

/// # Safety
/// AVX-512F/BW/VL; `r0` (and `r1` unless null) readable for `d` u16; `dst + e * TILE`
/// writable for 16 u32 (e < ne); d <= 16 ne.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn value_pair_avx512(r0: *const u16, r1: *const u16, d: usize, ne: usize, dst: *mut u32) -> bool {
    let mut bad = 0u32;
    for e in 0..ne {
        let m = low_lanes(d - (16 * e).min(d)) as u16;
        // SAFETY: masked to columns 16e + i < d of rows readable for d values.
        let a = unsafe { _mm256_maskz_loadu_epi16(m, r0.add(16 * e).cast()) };
        let b = if r1.is_null() {
            _mm256_setzero_si256()
        } else {
            // SAFETY: as above.
            unsafe { _mm256_maskz_loadu_epi16(m, r1.add(16 * e).cast()) }
        };
        let (a, b) = (_mm512_cvtepu16_epi32(a), _mm512_cvtepu16_epi32(b));
        let v = _mm512_or_si512(a, _mm512_slli_epi32::<16>(b));
        bad |= nonfinite(v);
        // SAFETY: 16 pairs at dst + e * TILE (contract).
        unsafe { _mm512_storeu_si512(dst.add(e * TILE).cast(), v) };
    }
    bad == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX-512 transpose is a transpose, bit for bit.
    #[test]
    fn transpose16_transposes() {
        if !available() {
            return;
        }
        let m: Vec<u32> = (0..256u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let mut out = [0u32; 256];
        // SAFETY: AVX-512F/BW checked; 16 loads and stores of 16 u32 inside `m` and `out`.
        unsafe {
            let mut r = [_mm512_setzero_si512(); 16];
            for (j, rj) in r.iter_mut().enumerate() {
                *rj = _mm512_loadu_si512(m[16 * j..].as_ptr().cast());
            }
            transpose16(&mut r);
            for (p, rp) in r.iter().enumerate() {
                _mm512_storeu_si512(out[16 * p..].as_mut_ptr().cast(), *rp);
            }
        }
        for p in 0..16 {
            for j in 0..16 {
                assert_eq!(out[16 * p + j], m[16 * j + p], "({p}, {j})");
            }
        }
    }
}
