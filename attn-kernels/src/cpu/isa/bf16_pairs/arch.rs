//! The x86-64 half of the bf16 pair forward (CPU and OS detection: `cpu_features`): the
//! tile configuration, the tile instructions (inline assembly) behind bounds-checked safe
//! wrappers, and the AVX-512 softmax rows; the `vdpbf16ps` products live in `dot`, the
//! AVX-512 packing in `pair_tiles_avx512`.
#![allow(unsafe_code)]

pub(super) mod dot;
pub(super) mod pair_tiles_avx512;

use std::arch::asm;
use std::arch::x86_64::*;
use std::ops::Range;

use super::layout::{Geometry, KC, KS, QB, RowState, TILE};

/// Prefetch the cache lines of `bytes` bytes from `p` (a hint: never faults).
#[inline(always)]
pub(super) fn prefetch(p: *const i8, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        // SAFETY: SSE is part of x86-64; a prefetch is a hint that never faults and
        // reads nothing the program can observe.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line)) };
    }
}

/// The tile configuration: palette 1, tiles 0-7 of 16 rows x 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Run `f` with the tile registers configured on this thread, released after.
pub(super) fn with_tiles<R>(f: impl FnOnce() -> R) -> R {
    let mut cfg = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
    cfg.colsb[..8].fill(64);
    cfg.rows[..8].fill(16);
    // SAFETY: `supported()` was checked by the caller (AMX present, permission
    // granted); the configuration is a valid 64-byte palette-1 block.
    unsafe { asm!("ldtilecfg [{0}]", in(reg) &cfg as *const TileConfig, options(nostack, readonly)) };
    let r = f();
    // SAFETY: releases this thread's tile state; no tile is in use after `f`.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
    r
}

/// `tmm{t} = 0` (accumulator tiles 0-3 and 6-7).
///
/// # Safety
/// Tiles are configured on this thread.
unsafe fn zero(t: usize) {
    // SAFETY: by the function contract.
    unsafe {
        match t {
            0 => asm!("tilezero tmm0", options(nostack, nomem)),
            1 => asm!("tilezero tmm1", options(nostack, nomem)),
            2 => asm!("tilezero tmm2", options(nostack, nomem)),
            3 => asm!("tilezero tmm3", options(nostack, nomem)),
            6 => asm!("tilezero tmm6", options(nostack, nomem)),
            _ => asm!("tilezero tmm7", options(nostack, nomem)),
        }
    }
}

/// Load accumulator tile `t` (0-3): 16 rows of 16 f32 at row stride `stride` bytes.
///
/// # Safety
/// Tiles are configured; `p + r*stride .. + 64` is readable for r < 16.
unsafe fn load_acc(t: usize, p: *const f32, stride: usize) {
    // SAFETY: by the function contract.
    unsafe {
        match t {
            0 => {
                asm!("tileloadd tmm0, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly))
            }
            1 => {
                asm!("tileloadd tmm1, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly))
            }
            2 => {
                asm!("tileloadd tmm2, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly))
            }
            _ => {
                asm!("tileloadd tmm3, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly))
            }
        }
    }
}

/// Store accumulator tile `t` (0-3 and 6-7).
///
/// # Safety
/// Tiles are configured; `p + r*stride .. + 64` is writable for r < 16.
unsafe fn store_acc(t: usize, p: *mut f32, stride: usize) {
    // SAFETY: by the function contract.
    unsafe {
        match t {
            0 => asm!("tilestored [{p} + {s}*1], tmm0", p = in(reg) p, s = in(reg) stride, options(nostack)),
            1 => asm!("tilestored [{p} + {s}*1], tmm1", p = in(reg) p, s = in(reg) stride, options(nostack)),
            2 => asm!("tilestored [{p} + {s}*1], tmm2", p = in(reg) p, s = in(reg) stride, options(nostack)),
            3 => asm!("tilestored [{p} + {s}*1], tmm3", p = in(reg) p, s = in(reg) stride, options(nostack)),
            6 => asm!("tilestored [{p} + {s}*1], tmm6", p = in(reg) p, s = in(reg) stride, options(nostack)),
            _ => asm!("tilestored [{p} + {s}*1], tmm7", p = in(reg) p, s = in(reg) stride, options(nostack)),
        }
    }
}

/// Load the left operand tile (tmm4): 16 rows of 64 bytes at stride `lda` bytes.
///
/// # Safety
/// Tiles are configured; `a + r*lda .. + 64` is readable for r < 16.
unsafe fn load_a(a: *const u16, lda: usize) {
    // SAFETY: by the function contract.
    unsafe { asm!("tileloadd tmm4, [{a} + {s}*1]", a = in(reg) a, s = in(reg) lda, options(nostack, readonly)) };
}

/// Load the right operand (tmm5, 16 rows of 64 bytes, contiguous), then
/// `tmm{t} += tmm4 · tmm5` (t in 0-3, 6-7) in bf16 pairs with f32 accumulation.
///
/// # Safety
/// Tiles are configured and tmm4 loaded; `b .. + 1024` is readable.
unsafe fn dot(t: usize, b: *const u32) {
    // SAFETY: by the function contract.
    unsafe {
        asm!("tileloadd tmm5, [{b} + {w}*1]", b = in(reg) b, w = in(reg) 64usize, options(nostack, readonly));
        match t {
            0 => asm!("tdpbf16ps tmm0, tmm4, tmm5", options(nostack, nomem)),
            1 => asm!("tdpbf16ps tmm1, tmm4, tmm5", options(nostack, nomem)),
            2 => asm!("tdpbf16ps tmm2, tmm4, tmm5", options(nostack, nomem)),
            3 => asm!("tdpbf16ps tmm3, tmm4, tmm5", options(nostack, nomem)),
            6 => asm!("tdpbf16ps tmm6, tmm4, tmm5", options(nostack, nomem)),
            _ => asm!("tdpbf16ps tmm7, tmm4, tmm5", options(nostack, nomem)),
        }
    }
}

/// Whether the output accumulator lives in tiles 0-3 for the whole query block
/// (`d <= 64`); wider heads keep it in memory and pass it through the tiles per step.
fn resident(g: &Geometry) -> bool {
    g.ne() <= 4
}

/// Load the output accumulator `o[16 x dv]` into tiles 0-3 (resident layout only).
pub(super) fn load_output(g: &Geometry, o: &[f32]) {
    assert!(o.len() >= QB * g.dv, "amx output: buffer too short");
    if resident(g) {
        for j in 0..g.ne() {
            // SAFETY: tiles are configured; rows r < 16 at stride 4*dv bytes hold the
            // 64 bytes from column 16*j < dv, inside `o` (checked above).
            unsafe { load_acc(j, o.as_ptr().add(j * 16), g.dv * 4) };
        }
    }
}

/// Store tiles 0-3 back to the output accumulator (resident layout only).
pub(super) fn store_output(g: &Geometry, o: &mut [f32]) {
    assert!(o.len() >= QB * g.dv, "amx output: buffer too short");
    if resident(g) {
        for j in 0..g.ne() {
            // SAFETY: as in `load_output`, writable.
            unsafe { store_acc(j, o.as_mut_ptr().add(j * 16), g.dv * 4) };
        }
    }
}

/// Scores of key step `t` (its first `kn` keys): `s[16 x 64] = q[16 x dq] · k_tᵀ`
/// (raw dot products), in two halves of 32 keys through tiles 6-7.
pub(super) fn scores(g: &Geometry, t: usize, kn: usize, q: &[u16], kb: &[u32], s: &mut [f32]) {
    assert!(q.len() >= QB * g.dq && s.len() >= QB * KS, "amx scores: buffers too short");
    assert!(kb.len() >= g.k_tile(t, g.qc() - 1, 3) + TILE, "amx scores: keys too short");
    // SAFETY: tiles are configured (we run inside `with_tiles`); every address is
    // inside the slices checked above: q rows r < 16 at stride 2*dq bytes with 64
    // bytes from column c*32 < dq, key tiles of 1024 bytes, score rows of 256 bytes.
    unsafe {
        for half in 0..kn.div_ceil(KC) {
            zero(6);
            zero(7);
            for c in 0..g.qc() {
                load_a(q.as_ptr().add(c * KC), g.dq * 2);
                dot(6, kb.as_ptr().add(g.k_tile(t, c, 2 * half)));
                dot(7, kb.as_ptr().add(g.k_tile(t, c, 2 * half + 1)));
            }
            store_acc(6, s.as_mut_ptr().add(half * KC), KS * 4);
            store_acc(7, s.as_mut_ptr().add(half * KC + 16), KS * 4);
        }
    }
}

/// `o[16 x dv] += p[16 x 64] · v_t` over the step's first `chunks` 32-key chunks:
/// into the resident tiles 0-3, or through them from memory for wide heads.
pub(super) fn values(g: &Geometry, t: usize, chunks: usize, p: &[u16], vb: &[u32], o: &mut [f32]) {
    assert!(p.len() >= QB * KS && o.len() >= QB * g.dv, "amx values: buffers too short");
    assert!(chunks <= 2 && vb.len() >= g.v_tile(t, 1, g.ne() - 1) + TILE, "amx values: values too short");
    let resident = resident(g);
    for e0 in (0..g.ne()).step_by(4) {
        let n = (g.ne() - e0).min(4);
        // SAFETY: tiles are configured; o rows r < 16 at stride 4*dv bytes hold the 64
        // bytes from column (e0+j)*16 < dv; p rows at stride 128 bytes hold 64 bytes
        // from column kc*32 < 64; value tiles are 1024 bytes inside `vb`.
        unsafe {
            if !resident {
                for j in 0..n {
                    load_acc(j, o.as_ptr().add((e0 + j) * 16), g.dv * 4);
                }
            }
            for kc in 0..chunks {
                load_a(p.as_ptr().add(kc * KC), KS * 2);
                for j in 0..n {
                    dot(j, vb.as_ptr().add(g.v_tile(t, kc, e0 + j)));
                }
            }
            if !resident {
                for j in 0..n {
                    store_acc(j, o.as_mut_ptr().add((e0 + j) * 16), g.dv * 4);
                }
            }
        }
    }
}

/// One row of a step: scaled, masked outside `vis`, online-softmax update of `st`, the
/// probabilities written as bf16 to `p` (zero outside `vis`). Returns the factor the
/// row's output accumulator must be multiplied by.
pub(super) fn softmax_row(s: &[f32], vis: Range<usize>, c2: f32, st: &mut RowState, p: &mut [u16]) -> f32 {
    assert!(s.len() >= KS && p.len() >= KS && vis.end <= KS, "amx softmax: row too short");
    // SAFETY: AVX-512F and AVX512-BF16 are present (both engines' `supported()`); the slices
    // hold KS values.
    unsafe { softmax_row_avx512(s.as_ptr(), vis, c2, st, p.as_mut_ptr()) }
}

/// `2^x` for `x <= LAZY_RESCALE` (degree-4 polynomial on the fraction: relative error
/// below 4e-6, far under the bf16 rounding of the probabilities). Inputs below
/// -125 give 0: never a subnormal, whose handling costs the CPU a microcode assist
/// (next to a running maximum of 1, nothing below 2^-125 is visible).
#[target_feature(enable = "avx512f")]
fn exp2_vec(x: __m512) -> __m512 {
    // Chebyshev fit of 2^f on [-0.5, 0.5] (relative error 3.5e-6).
    const C: [f32; 5] = [9.666_368e-3, 5.592_197_6e-2, 0.240_223_5, 0.693_121_1, 1.0];
    let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(-125.0));
    let x = _mm512_max_ps(_mm512_set1_ps(-125.0), x);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let f = _mm512_sub_ps(x, n);
    let mut p = _mm512_set1_ps(C[0]);
    for c in C[1..].iter().copied() {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    _mm512_maskz_scalef_ps(keep, p, n)
}

/// # Safety
/// AVX-512F and AVX512-BF16 are present; `s` readable and `p` writable for `KS`
/// elements; `vis.end <= KS`.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn softmax_row_avx512(s: *const f32, vis: Range<usize>, c2: f32, st: &mut RowState, p: *mut u16) -> f32 {
    const V: usize = KS / 16;
    // Lanes of vector `v` inside `vis`: the bits from `vis.start` up to `vis.end`.
    let below = |x: usize, lo: usize| -> u32 {
        if x >= lo + 16 {
            0xffff
        } else if x <= lo {
            0
        } else {
            (1 << (x - lo)) - 1
        }
    };
    let lane_mask = |v: usize| -> __mmask16 { (below(vis.end, 16 * v) & !below(vis.start, 16 * v)) as __mmask16 };
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    // Raw scores, -inf past `vis`; scaled later (c2 > 0, so max(c2 x) = c2 max(x)).
    let mut x = [ninf; V];
    let mut mx = ninf;
    for (v, xv) in x.iter_mut().enumerate() {
        // SAFETY: lanes below KS, inside `s`.
        *xv = unsafe { _mm512_mask_loadu_ps(ninf, lane_mask(v), s.add(16 * v)) };
        mx = _mm512_max_ps(mx, *xv);
    }
    // Lazy rescaling: the running maximum moves only on the first visible key or when
    // a score passes it by more than LAZY_RESCALE, so `exp2(c2 x - m) <= 2^LAZY`; the
    // common case needs no horizontal maximum.
    let mut corr = 1.0;
    let limit = if st.m == f32::NEG_INFINITY { f32::NEG_INFINITY } else { (st.m + super::layout::LAZY_RESCALE) / c2 };
    if _mm512_cmp_ps_mask::<_CMP_GT_OQ>(mx, _mm512_set1_ps(limit)) != 0 {
        let step_max = c2 * _mm512_reduce_max_ps(mx);
        if st.m != f32::NEG_INFINITY {
            corr = crate::cpu::isa::kernels::exp2_scalar(st.m - step_max);
        }
        st.m = step_max;
    }
    if st.m == f32::NEG_INFINITY {
        // Nothing visible yet: no probabilities.
        for v in 0..V / 2 {
            // SAFETY: 32 u16 lanes below KS, inside `p`.
            unsafe { _mm512_storeu_si512(p.add(32 * v).cast(), _mm512_setzero_si512()) };
        }
        return 1.0;
    }
    let (scale, neg_m) = (_mm512_set1_ps(c2), _mm512_set1_ps(-st.m));
    let mut sum = _mm512_setzero_ps();
    let mut e = [_mm512_setzero_ps(); V];
    for (v, (ev, xv)) in e.iter_mut().zip(&x).enumerate() {
        // Masked lanes are set to exactly 0 (exp2_vec never returns a subnormal).
        *ev = _mm512_maskz_mov_ps(lane_mask(v), exp2_vec(_mm512_fmadd_ps(*xv, scale, neg_m)));
        sum = _mm512_add_ps(sum, *ev);
    }
    for v in 0..V / 2 {
        // Round to nearest even bf16: lanes 0-15 from e[2v], 16-31 from e[2v+1].
        let pair = _mm512_cvtne2ps_pbh(e[2 * v + 1], e[2 * v]);
        // SAFETY: __m512bh and __m512i are both 64 plain bytes.
        let bitsv: __m512i = unsafe { std::mem::transmute(pair) };
        // SAFETY: 32 u16 lanes below KS, inside `p`.
        unsafe { _mm512_storeu_si512(p.add(32 * v).cast(), bitsv) };
    }
    // SAFETY: `st.l` holds 16 f32.
    let l = unsafe { _mm512_loadu_ps(st.l.as_ptr()) };
    let l = _mm512_fmadd_ps(l, _mm512_set1_ps(corr), sum);
    // SAFETY: as above.
    unsafe { _mm512_storeu_ps(st.l.as_mut_ptr(), l) };
    corr
}
