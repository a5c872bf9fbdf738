//! The Dot engine's products: the tile layouts of the bf16 pair forward multiplied with
//! AVX512-BF16 `vdpbf16ps` (16 lanes, each summing one bf16 pair product into f32) in
//! register blocks of 4 query rows by up to 4 sixteen-wide column groups.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::super::{Geometry, KC, KS, QB, TILE};

/// Query rows per register block (QB is a multiple).
const R: usize = 4;

/// Scores of key step `t` (its first `kn` keys): `s[16 x 64] = q[16 x dq] · k_tᵀ` (raw
/// dot products) for the 16-key groups that hold those keys; columns past them are left
/// as they were (the softmax reads only visible keys).
pub(in super::super) fn scores(g: &Geometry, t: usize, kn: usize, q: &[u16], kb: &[u32], s: &mut [f32]) {
    assert!(q.len() >= QB * g.dq && s.len() >= QB * KS, "dot scores: buffers too short");
    assert!(kb.len() >= g.k_tile(t, g.qc() - 1, 3) + TILE, "dot scores: keys too short");
    assert!(kn <= KS && g.dq.is_multiple_of(KC), "dot scores: step too long");
    let groups = kn.div_ceil(16);
    let kt = kb[g.k_tile(t, 0, 0)..].as_ptr();
    for r0 in (0..QB).step_by(R) {
        let (qr, sr) = (q[r0 * g.dq..].as_ptr(), s[r0 * KS..].as_mut_ptr());
        // SAFETY: AVX-512F and AVX512-BF16 are present (the Dot engine is only chosen
        // when `detect_dot` holds). Reads: rows r0..r0+R of q (stride dq, pairs below
        // dq/2), the step's key tiles (t, c < qc, group < 4) inside `kb` (checked
        // above); writes: rows r0..r0+R of s, columns below 16 * groups <= KS.
        unsafe {
            match groups {
                0 => {}
                1 => scores_block::<1>(g.qc(), g.dq, qr, kt, sr),
                2 => scores_block::<2>(g.qc(), g.dq, qr, kt, sr),
                3 => scores_block::<3>(g.qc(), g.dq, qr, kt, sr),
                _ => scores_block::<4>(g.qc(), g.dq, qr, kt, sr),
            }
        }
    }
}

/// `o[16 x dv] += p[16 x 64] · v_t` over the step's first `chunks` 32-key chunks.
pub(in super::super) fn values(g: &Geometry, t: usize, chunks: usize, p: &[u16], vb: &[u32], o: &mut [f32]) {
    assert!(p.len() >= QB * KS && o.len() >= QB * g.dv, "dot values: buffers too short");
    assert!(chunks <= 2 && vb.len() >= g.v_tile(t, 1, g.ne() - 1) + TILE, "dot values: values too short");
    for e0 in (0..g.ne()).step_by(4) {
        let vt = vb[g.v_tile(t, 0, e0)..].as_ptr();
        for r0 in (0..QB).step_by(R) {
            let (pr, or) = (p[r0 * KS..].as_ptr(), o[r0 * g.dv + e0 * 16..].as_mut_ptr());
            let (ne, dv) = (g.ne(), g.dv);
            // SAFETY: AVX-512F and AVX512-BF16 are present (see `scores`). Reads: rows
            // r0..r0+R of p (stride KS, pairs below chunks * 16), value tiles (t, kc <
            // chunks, e0 + j < ne) inside `vb` (checked above); reads and writes rows
            // r0..r0+R of o (stride dv), columns 16 * (e0 + j) + 16 <= dv.
            unsafe {
                match g.ne() - e0 {
                    1 => values_block::<1>(ne, dv, chunks, pr, vt, or),
                    2 => values_block::<2>(ne, dv, chunks, pr, vt, or),
                    3 => values_block::<3>(ne, dv, chunks, pr, vt, or),
                    _ => values_block::<4>(ne, dv, chunks, pr, vt, or),
                }
            }
        }
    }
}

/// One bf16 pair (two adjacent u16) broadcast to every 32-bit lane.
///
/// # Safety
/// `p .. p + 2` is readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pair(p: *const u16) -> __m512bh {
    // SAFETY: by the function contract; __m512i and __m512bh are both 64 plain bytes.
    unsafe { std::mem::transmute(_mm512_set1_epi32(p.cast::<i32>().read_unaligned())) }
}

/// A vector of zero pairs.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
fn zero() -> __m512bh {
    // SAFETY: __m512i and __m512bh are both 64 plain bytes.
    unsafe { std::mem::transmute(_mm512_setzero_si512()) }
}

/// 16 bf16 pairs (one tile row) from `p`.
///
/// # Safety
/// `p .. p + 16` is readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn row(p: *const u32) -> __m512bh {
    // SAFETY: by the function contract; as in `pair`.
    unsafe { std::mem::transmute(_mm512_loadu_si512(p.cast())) }
}

/// `s[r][16 gi + j] = Σ_c Σ_p q[r][c*32 + 2p ..= +1] · k(c, gi)[p][j]` for r < R, gi < G.
///
/// # Safety
/// AVX-512F and AVX512-BF16; `q` rows r < R (stride `dq`) hold `qc * 32` bf16; `kt` is
/// key tile (t, 0, 0), followed by the step's tiles (c < qc, group < G); `s` rows r < R
/// (stride KS) are writable for `16 * G` floats.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn scores_block<const G: usize>(qc: usize, dq: usize, q: *const u16, kt: *const u32, s: *mut f32) {
    let mut acc = [[_mm512_setzero_ps(); G]; R];
    for c in 0..qc {
        // SAFETY: every offset stays inside the tiles and rows of the function contract.
        unsafe {
            let kc = kt.add(c * 4 * TILE);
            for p in 0..16 {
                let mut b = [zero(); G];
                for (gi, bv) in b.iter_mut().enumerate() {
                    *bv = row(kc.add(gi * TILE + p * 16));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let a = pair(q.add(r * dq + c * KC + 2 * p));
                    for (av, bv) in acc_r.iter_mut().zip(&b) {
                        *av = _mm512_dpbf16_ps(*av, a, *bv);
                    }
                }
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (gi, av) in acc_r.iter().enumerate() {
            // SAFETY: row r < R, columns 16 gi .. 16 gi + 16 <= 16 G (contract).
            unsafe { _mm512_storeu_ps(s.add(r * KS + gi * 16), *av) };
        }
    }
}

/// `o[r][16 j ..] += Σ_kc Σ_p p[r][kc*32 + 2p ..= +1] · v(kc, e0 + j)[p][..]` for
/// r < R, j < N.
///
/// # Safety
/// AVX-512F and AVX512-BF16; `p` rows r < R (stride KS) hold `chunks * 32` bf16; `vt`
/// is value tile (t, 0, e0), and tiles (t, kc < chunks, e0 + j) for j < N are readable
/// (tile (t, kc, e) sits `(kc * ne + e - e0) * TILE` after it); `o` rows r < R
/// (stride `dv`) are readable and writable for `16 * N` floats.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn values_block<const N: usize>(
    ne: usize,
    dv: usize,
    chunks: usize,
    p: *const u16,
    vt: *const u32,
    o: *mut f32,
) {
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    for (r, acc_r) in acc.iter_mut().enumerate() {
        for (j, av) in acc_r.iter_mut().enumerate() {
            // SAFETY: row r < R, columns 16 j .. 16 j + 16 <= 16 N (contract).
            *av = unsafe { _mm512_loadu_ps(o.add(r * dv + j * 16)) };
        }
    }
    for kc in 0..chunks {
        // SAFETY: every offset stays inside the tiles and rows of the function contract.
        unsafe {
            let vc = vt.add(kc * ne * TILE);
            for pp in 0..16 {
                let mut b = [zero(); N];
                for (j, bv) in b.iter_mut().enumerate() {
                    *bv = row(vc.add(j * TILE + pp * 16));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let a = pair(p.add(r * KS + kc * KC + 2 * pp));
                    for (av, bv) in acc_r.iter_mut().zip(&b) {
                        *av = _mm512_dpbf16_ps(*av, a, *bv);
                    }
                }
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (j, av) in acc_r.iter().enumerate() {
            // SAFETY: as for the loads above.
            unsafe { _mm512_storeu_ps(o.add(r * dv + j * 16), *av) };
        }
    }
}
