//! The Dot engine's products: the tile layouts of the bf16 pair forward multiplied with
//! AVX512-BF16 `vdpbf16ps` (16 lanes, each summing one bf16 pair product into f32) in
//! register blocks of 4 query rows by up to 4 sixteen-wide column tiles; `q·kᵀ` and
//! `p·v` are the same block product over different strides.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::super::layout::{Geometry, KC, KS, QB, TILE};

/// Query rows per register block (QB is a multiple).
const R: usize = 4;

/// Scores of key step `t` (its first `kn` keys): `s[16 x 64] = q[16 x dq] · k_tᵀ` (raw
/// dot products) for the 16-key groups that hold those keys; columns past them are left
/// as they were (the softmax reads only visible keys).
pub(in super::super) fn scores(g: &Geometry, t: usize, kn: usize, q: &[u16], kb: &[u32], s: &mut [f32]) {
    assert!(q.len() >= QB * g.dq && s.len() >= QB * KS, "dot scores: buffers too short");
    assert!(kb.len() >= g.k_tile(t, g.qc() - 1, 3) + TILE, "dot scores: keys too short");
    assert!(kn <= KS && g.dq.is_multiple_of(KC), "dot scores: step too long");
    let kt = kb[g.k_tile(t, 0, 0)..].as_ptr();
    for r0 in (0..QB).step_by(R) {
        let (qr, sr) = (q[r0 * g.dq..].as_ptr(), s[r0 * KS..].as_mut_ptr());
        // SAFETY: AVX-512F and AVX512-BF16 are present (the Dot engine is only chosen
        // when `detect_dot` holds). Reads: rows r0..r0+R of q (stride dq, chunks c < qc
        // of 32 bf16 below dq), key tiles (t, c, group < 4) at kt + c * 4 TILE + group
        // * TILE inside `kb` (checked above); writes: rows r0..r0+R of s, columns below
        // 16 * groups <= KS.
        unsafe { block(kn.div_ceil(16), g.qc(), qr, g.dq, kt, 4 * TILE, sr, KS, false) }
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
            // SAFETY: AVX-512F and AVX512-BF16 are present (see `scores`). Reads: rows
            // r0..r0+R of p (stride KS, chunks kc < chunks of 32 bf16 below KS), value
            // tiles (t, kc, e0 + j < ne) at vt + kc * ne TILE + j * TILE inside `vb`
            // (checked above); reads and writes rows r0..r0+R of o (stride dv), columns
            // 16 * (e0 + j) + 16 <= dv.
            unsafe { block((g.ne() - e0).min(4), chunks, pr, KS, vt, g.ne() * TILE, or, g.dv, true) }
        }
    }
}

/// [`block_n`] for `n` (0 to 4) column tiles.
///
/// # Safety
/// As for [`block_n`] with `N = n`.
// The vdpbf16ps register-block kernel: each argument is a pointer or stride of its loop.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn block(
    n: usize,
    chunks: usize,
    a: *const u16,
    lda: usize,
    b: *const u32,
    b_chunk: usize,
    c: *mut f32,
    ldc: usize,
    acc: bool,
) {
    // SAFETY: by the function contract.
    unsafe {
        match n {
            0 => {}
            1 => block_n::<1>(chunks, a, lda, b, b_chunk, c, ldc, acc),
            2 => block_n::<2>(chunks, a, lda, b, b_chunk, c, ldc, acc),
            3 => block_n::<3>(chunks, a, lda, b, b_chunk, c, ldc, acc),
            _ => block_n::<4>(chunks, a, lda, b, b_chunk, c, ldc, acc),
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

/// `C[r][16 j ..] (+)= Σ_ch Σ_p A[r][ch*32 + 2p ..= +1] · B(ch, j)[p][..]` for r < R,
/// j < N: one bf16 pair of A broadcast against a tile row of 16 pairs. A rows at stride
/// `lda` (u16), tile (ch, j) of B at `b + ch * b_chunk + j * TILE` (u32), C rows at
/// stride `ldc` (f32); with `acc` C is added to, else overwritten.
///
/// # Safety
/// AVX-512F and AVX512-BF16; A rows r < R readable for `32 * chunks` bf16; those tiles
/// of B readable (256 pairs each); C rows r < R readable (with `acc`) and writable for
/// `16 * N` floats.
// The vdpbf16ps register-block kernel: each argument is a pointer or stride of its loop.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn block_n<const N: usize>(
    chunks: usize,
    a: *const u16,
    lda: usize,
    b: *const u32,
    b_chunk: usize,
    c: *mut f32,
    ldc: usize,
    acc: bool,
) {
    let mut sum = [[_mm512_setzero_ps(); N]; R];
    if acc {
        for (r, sum_r) in sum.iter_mut().enumerate() {
            for (j, sv) in sum_r.iter_mut().enumerate() {
                // SAFETY: row r < R, columns 16 j .. 16 j + 16 <= 16 N (contract).
                *sv = unsafe { _mm512_loadu_ps(c.add(r * ldc + j * 16)) };
            }
        }
    }
    for ch in 0..chunks {
        // SAFETY: every offset stays inside the tiles and rows of the function contract.
        unsafe {
            let bc = b.add(ch * b_chunk);
            for p in 0..16 {
                let mut bv = [zero(); N];
                for (j, v) in bv.iter_mut().enumerate() {
                    *v = row(bc.add(j * TILE + p * 16));
                }
                for (r, sum_r) in sum.iter_mut().enumerate() {
                    let av = pair(a.add(r * lda + ch * KC + 2 * p));
                    for (sv, v) in sum_r.iter_mut().zip(&bv) {
                        *sv = _mm512_dpbf16_ps(*sv, av, *v);
                    }
                }
            }
        }
    }
    for (r, sum_r) in sum.iter().enumerate() {
        for (j, sv) in sum_r.iter().enumerate() {
            // SAFETY: as for the loads above.
            unsafe { _mm512_storeu_ps(c.add(r * ldc + j * 16), *sv) };
        }
    }
}
