//! AMX-BF16 forward of one piece (x86-64 with AMX-TILE and AMX-BF16, e.g. Sapphire
//! Rapids): bf16 `q·kᵀ` and `p·v` on the tile unit with f32 accumulation, the online
//! softmax in f32 with AVX-512. Only bf16 inputs take it; a piece holding a non-finite
//! value goes back to the f32 kernel, so NaN/Inf confinement is the f32 kernel's.
//!
//! Precision: products of bf16 values are exact in f32 and summed in f32, as in the
//! f32 kernel; the probabilities are rounded to bf16 for `p·v` (as GPU flash attention
//! does) and the output is normalised by the sum of the rounded probabilities, so each
//! output row stays a convex combination of value rows. The LSE uses the unrounded sum.
//!
//! Unsafe: the tile instructions (inline assembly on pointers into this module's own
//! scratch buffers, sized before use) and the AVX-512 softmax rows.
#![allow(unsafe_code)]

use attn_core::{DType, Element};

use crate::pack::PieceRows;

/// Queries per block (tile rows).
const QB: usize = 16;
/// Keys per softmax step (four 16-key score tiles).
const KS: usize = 64;
/// bf16 elements per tile row (64 bytes): keys per `p·v` chunk, dims per `q·k` chunk.
const KC: usize = 32;
/// u16 elements of one 16 x 64-byte tile.
const TILE: usize = 512;

/// Whether the CPU has AMX-TILE, AMX-BF16 and AVX-512F and the OS lets this process use
/// the tile registers (Linux `arch_prctl(ARCH_REQ_XCOMP_PERM)`); asked once.
pub(crate) fn supported() -> bool {
    static S: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *S.get_or_init(imp::detect)
}

/// Reusable buffers of the AMX forward (one per worker).
#[derive(Debug, Default)]
pub(crate) struct AmxScratch {
    kb: Vec<u16>,
    vb: Vec<u16>,
    q: Vec<u16>,
    s: Vec<f32>,
    p: Vec<u16>,
    o: Vec<f32>,
}

/// bf16 bits of an element known to be bf16 (`to_f32` of a bf16 is exact).
#[inline(always)]
fn bits<T: Element>(x: T) -> u16 {
    (x.to_f32().to_bits() >> 16) as u16
}

/// Whether every value of the rows is finite (bf16 exponent not all ones).
fn all_finite<T: Element>(rows: &PieceRows<'_, T>, n: usize, d: usize) -> bool {
    (0..n).all(|i| rows.row(i, d).iter().fold(true, |ok, &x| ok & (bits(x) & 0x7f80 != 0x7f80)))
}

/// The AMX forward of a bf16 piece, with [`crate::tile_forward::forward_piece`]'s
/// contract. Returns `false` (and writes nothing) when the piece is not bf16, holds a
/// non-finite value or AMX is unavailable: the caller then runs the f32 kernel.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_piece<T: Element>(
    scale: f32,
    d: usize,
    causal: bool,
    q: &PieceRows<'_, T>,
    k: &PieceRows<'_, T>,
    v: &PieceRows<'_, T>,
    ws: &mut AmxScratch,
    out: &mut [f32],
    lse: &mut [f32],
) -> bool {
    let nq = q.len();
    if T::DTYPE != DType::BF16 || !supported() || nq == 0 {
        return false;
    }
    let nk = crate::tile_forward::keys_needed(k.pos, causal, q.pos[nq - 1]);
    if !(all_finite(q, nq, d) && all_finite(k, nk, d) && all_finite(v, nk, d)) {
        return false;
    }
    assert!(out.len() >= nq * d && lse.len() >= nq, "amx forward: output too short");
    let g = Geometry::new(d, nk);
    pack_keys(k, nk, d, &g, &mut ws.kb);
    pack_values(v, nk, d, &g, &mut ws.vb);
    ws.q.resize(QB * g.dq, 0);
    ws.s.resize(QB * KS, 0.0);
    ws.p.resize(QB * KS, 0);
    ws.o.resize(QB * g.dv, 0.0);
    let c2 = scale * std::f32::consts::LOG2_E;
    imp::with_tiles(|| {
        for q0 in (0..nq).step_by(QB) {
            let qn = (nq - q0).min(QB);
            for i in 0..QB {
                let dst = &mut ws.q[i * g.dq..(i + 1) * g.dq];
                if i < qn {
                    dst.iter_mut().zip(q.row(q0 + i, d)).for_each(|(o, &x)| *o = bits(x));
                    dst[d..].fill(0);
                } else {
                    dst.fill(0);
                }
            }
            let qpos = &q.pos[q0..q0 + qn];
            let mut rows = [RowState::default(); QB];
            ws.o.fill(0.0);
            for t in 0..g.steps {
                let k0 = t * KS;
                let kn = (nk - k0).min(KS);
                let kpos = &k.pos[k0..k0 + kn];
                if causal && kpos[0] > qpos[qn - 1] {
                    break;
                }
                imp::scores(&g, t, &ws.q, &ws.kb, &mut ws.s);
                for (i, row) in rows.iter_mut().enumerate() {
                    let vis = if i >= qn {
                        0
                    } else if causal {
                        kpos.partition_point(|&p| p <= qpos[i])
                    } else {
                        kn
                    };
                    let p = &mut ws.p[i * KS..(i + 1) * KS];
                    let corr = imp::softmax_row(&ws.s[i * KS..(i + 1) * KS], vis, c2, row, p);
                    if corr != 1.0 {
                        ws.o[i * g.dv..(i + 1) * g.dv].iter_mut().for_each(|x| *x *= corr);
                    }
                }
                let chunks = kn.div_ceil(KC);
                imp::values(&g, t, chunks, &ws.p, &ws.vb, &mut ws.o);
            }
            for (i, row) in rows.iter().enumerate().take(qn) {
                let dst = &mut out[(q0 + i) * d..(q0 + i + 1) * d];
                if row.l_rounded == 0.0 {
                    dst.fill(0.0);
                    lse[q0 + i] = f32::NEG_INFINITY;
                } else {
                    let inv = 1.0 / row.l_rounded;
                    dst.iter_mut().zip(&ws.o[i * g.dv..]).for_each(|(a, b)| *a = b * inv);
                    lse[q0 + i] = (row.m + row.l.log2()) * std::f32::consts::LN_2;
                }
            }
        }
    });
    true
}

/// Online-softmax state of one query row (base 2, scores already scaled).
#[derive(Debug, Clone, Copy)]
struct RowState {
    m: f32,
    /// Sum of the unrounded probabilities (for the LSE).
    l: f32,
    /// Sum of the bf16-rounded probabilities that `p·v` used (for the output).
    l_rounded: f32,
}

impl Default for RowState {
    fn default() -> Self {
        RowState { m: f32::NEG_INFINITY, l: 0.0, l_rounded: 0.0 }
    }
}

/// Padded sizes of one piece.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    /// `d` rounded up to 32 (the `q·k` inner dimension, in `KC` chunks).
    dq: usize,
    /// `d` rounded up to 16 (output columns, in 16-wide tiles).
    dv: usize,
    /// Key steps of `KS` keys.
    steps: usize,
}

impl Geometry {
    fn new(d: usize, nk: usize) -> Self {
        Geometry { dq: d.next_multiple_of(KC), dv: d.next_multiple_of(16), steps: nk.div_ceil(KS) }
    }
    /// Inner-dimension chunks of `q·k`.
    fn qc(&self) -> usize {
        self.dq / KC
    }
    /// 16-wide output tiles.
    fn ne(&self) -> usize {
        self.dv / 16
    }
    /// Offset of the key tile (step `t`, dim chunk `c`, 16-key group `g`).
    fn k_tile(&self, t: usize, c: usize, g: usize) -> usize {
        ((t * self.qc() + c) * 4 + g) * TILE
    }
    /// Offset of the value tile (step `t`, key chunk `kc`, output tile `e`).
    fn v_tile(&self, t: usize, kc: usize, e: usize) -> usize {
        ((t * 2 + kc) * self.ne() + e) * TILE
    }
}

/// Keys in the tile unit's pair layout: tile (t, c, g) row `p`, column `2j + s` holds
/// `k[t*64 + g*16 + j][c*32 + 2p + s]` (zero past `nk` or `d`).
fn pack_keys<T: Element>(k: &PieceRows<'_, T>, nk: usize, d: usize, g: &Geometry, dst: &mut Vec<u16>) {
    dst.clear();
    dst.resize(g.steps * g.qc() * 4 * TILE, 0);
    for key in 0..nk {
        let (t, g16, j) = (key / KS, (key % KS) / 16, key % 16);
        for (e, &x) in k.row(key, d).iter().enumerate() {
            let (c, p, s) = (e / KC, (e % KC) / 2, e % 2);
            dst[g.k_tile(t, c, g16) + p * 32 + j * 2 + s] = bits(x);
        }
    }
}

/// Values in the pair layout: tile (t, kc, e) row `p`, column `2j + s` holds
/// `v[t*64 + kc*32 + 2p + s][e*16 + j]` (zero past `nk` or `d`).
fn pack_values<T: Element>(v: &PieceRows<'_, T>, nk: usize, d: usize, g: &Geometry, dst: &mut Vec<u16>) {
    dst.clear();
    dst.resize(g.steps * 2 * g.ne() * TILE, 0);
    for key in 0..nk {
        let (t, kc, p, s) = (key / KS, (key % KS) / KC, (key % KC) / 2, key % 2);
        for (col, &x) in v.row(key, d).iter().enumerate() {
            dst[g.v_tile(t, kc, col / 16) + p * 32 + (col % 16) * 2 + s] = bits(x);
        }
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod imp {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::{Geometry, KC, KS, QB, RowState, TILE};
    use crate::portable::EXP2_POLY;

    pub(super) fn detect() -> bool {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return false;
        }
        // CPUID leaf 7, sub-leaf 0, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE.
        let edx = __cpuid_count(7, 0).edx;
        if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
            return false;
        }
        // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and touches no
        // memory of ours; it fails (non-zero) where the kernel does not offer AMX.
        unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
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

    /// `tmm{t} = 0` for the four accumulator tiles.
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
                _ => asm!("tilezero tmm3", options(nostack, nomem)),
            }
        }
    }

    /// Load accumulator tile `t` (16 rows of 16 f32, row stride `stride` bytes).
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

    /// Store accumulator tile `t`.
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
                _ => asm!("tilestored [{p} + {s}*1], tmm3", p = in(reg) p, s = in(reg) stride, options(nostack)),
            }
        }
    }

    /// Load the left operand (tmm4) and the right operand (tmm5, 64-byte rows), then
    /// `tmm{t} += tmm4 · tmm5` in bf16 pairs with f32 accumulation.
    ///
    /// # Safety
    /// Tiles are configured; `a + r*lda .. + 64` and `b .. + 1024` are readable (r < 16).
    unsafe fn dot(t: usize, a: *const u16, lda: usize, b: *const u16) {
        // SAFETY: by the function contract.
        unsafe {
            asm!(
                "tileloadd tmm4, [{a} + {s}*1]",
                "tileloadd tmm5, [{b} + {w}*1]",
                a = in(reg) a, s = in(reg) lda, b = in(reg) b, w = in(reg) 64usize,
                options(nostack, readonly)
            );
            match t {
                0 => asm!("tdpbf16ps tmm0, tmm4, tmm5", options(nostack, nomem)),
                1 => asm!("tdpbf16ps tmm1, tmm4, tmm5", options(nostack, nomem)),
                2 => asm!("tdpbf16ps tmm2, tmm4, tmm5", options(nostack, nomem)),
                _ => asm!("tdpbf16ps tmm3, tmm4, tmm5", options(nostack, nomem)),
            }
        }
    }

    /// Scores of key step `t`: `s[16 x 64] = q[16 x dq] · k_tᵀ` (raw dot products).
    pub(super) fn scores(g: &Geometry, t: usize, q: &[u16], kb: &[u16], s: &mut [f32]) {
        assert!(q.len() >= QB * g.dq && s.len() >= QB * KS, "amx scores: buffers too short");
        assert!(kb.len() >= g.k_tile(t, g.qc() - 1, 3) + TILE, "amx scores: keys too short");
        // SAFETY: tiles are configured (we run inside `with_tiles`); every address is
        // inside the slices checked above: q rows r < 16 at stride 2*dq bytes with 64
        // bytes from column c*32 < dq, key tiles of 1024 bytes, score rows of 256 bytes.
        unsafe {
            for j in 0..4 {
                zero(j);
            }
            for c in 0..g.qc() {
                let a = q.as_ptr().add(c * KC);
                for j in 0..4 {
                    dot(j, a, g.dq * 2, kb.as_ptr().add(g.k_tile(t, c, j)));
                }
            }
            for j in 0..4 {
                store_acc(j, s.as_mut_ptr().add(j * 16), KS * 4);
            }
        }
    }

    /// `o[16 x dv] += p[16 x 64] · v_t` over the step's first `chunks` 32-key chunks.
    pub(super) fn values(g: &Geometry, t: usize, chunks: usize, p: &[u16], vb: &[u16], o: &mut [f32]) {
        assert!(p.len() >= QB * KS && o.len() >= QB * g.dv, "amx values: buffers too short");
        assert!(chunks <= 2 && vb.len() >= g.v_tile(t, 1, g.ne() - 1) + TILE, "amx values: values too short");
        for e0 in (0..g.ne()).step_by(4) {
            let n = (g.ne() - e0).min(4);
            // SAFETY: tiles are configured; o rows r < 16 at stride 4*dv bytes hold the 64
            // bytes from column (e0+j)*16 < dv; p rows at stride 128 bytes hold 64 bytes
            // from column kc*32 < 64; value tiles are 1024 bytes inside `vb`.
            unsafe {
                for j in 0..n {
                    load_acc(j, o.as_ptr().add((e0 + j) * 16), g.dv * 4);
                }
                for kc in 0..chunks {
                    let a = p.as_ptr().add(kc * KC);
                    for j in 0..n {
                        dot(j, a, KS * 2, vb.as_ptr().add(g.v_tile(t, kc, e0 + j)));
                    }
                }
                for j in 0..n {
                    store_acc(j, o.as_mut_ptr().add((e0 + j) * 16), g.dv * 4);
                }
            }
        }
    }

    /// One row of a step: scaled, masked past `vis`, online-softmax update of `st`, the
    /// probabilities written as bf16 to `p` (zero past `vis`). Returns the factor the
    /// row's output accumulator must be multiplied by.
    pub(super) fn softmax_row(s: &[f32], vis: usize, c2: f32, st: &mut RowState, p: &mut [u16]) -> f32 {
        assert!(s.len() >= KS && p.len() >= KS && vis <= KS, "amx softmax: row too short");
        // SAFETY: AVX-512F is present (part of `supported()`); the slices hold KS values.
        unsafe { softmax_row_avx512(s.as_ptr(), vis, c2, st, p.as_mut_ptr()) }
    }

    #[target_feature(enable = "avx512f")]
    fn exp2_vec(x: __m512) -> __m512 {
        let x = _mm512_max_ps(_mm512_set1_ps(-150.0), x);
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm512_sub_ps(x, n);
        let mut p = _mm512_set1_ps(EXP2_POLY[0]);
        for c in EXP2_POLY[1..].iter().copied() {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    /// # Safety
    /// AVX-512F is present; `s` readable and `p` writable for `KS` elements; `vis <= KS`.
    #[target_feature(enable = "avx512f")]
    unsafe fn softmax_row_avx512(s: *const f32, vis: usize, c2: f32, st: &mut RowState, p: *mut u16) -> f32 {
        const V: usize = KS / 16;
        let lane_mask = |v: usize| -> __mmask16 {
            let lo = 16 * v;
            if vis >= lo + 16 {
                0xffff
            } else if vis <= lo {
                0
            } else {
                (1u16 << (vis - lo)) - 1
            }
        };
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let scale = _mm512_set1_ps(c2);
        let mut x = [ninf; V];
        let mut mx = ninf;
        for (v, xv) in x.iter_mut().enumerate() {
            let mask = lane_mask(v);
            // SAFETY: lanes below KS, inside `s`.
            let raw = unsafe { _mm512_maskz_loadu_ps(mask, s.add(16 * v)) };
            *xv = _mm512_mask_mul_ps(ninf, mask, raw, scale);
            mx = _mm512_max_ps(mx, *xv);
        }
        let m_new = st.m.max(_mm512_reduce_max_ps(mx));
        if m_new == f32::NEG_INFINITY {
            for v in 0..V {
                // SAFETY: 16 u16 lanes below KS, inside `p`.
                unsafe { _mm256_storeu_si256(p.add(16 * v).cast(), _mm256_setzero_si256()) };
            }
            return 1.0;
        }
        let corr = if st.m == m_new { 1.0 } else { crate::portable::exp2(st.m - m_new) };
        let sub = _mm512_set1_ps(m_new);
        let (mut sum, mut sum_rounded) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let round = _mm512_set1_epi32(0x7fff);
        let one = _mm512_set1_epi32(1);
        for (v, xv) in x.iter().enumerate() {
            let e = _mm512_maskz_mov_ps(lane_mask(v), exp2_vec(_mm512_sub_ps(*xv, sub)));
            sum = _mm512_add_ps(sum, e);
            // Round to nearest even bf16 (e is finite and non-negative).
            let b = _mm512_castps_si512(e);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), one);
            let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, _mm512_add_epi32(round, lsb)));
            sum_rounded = _mm512_add_ps(sum_rounded, _mm512_castsi512_ps(_mm512_slli_epi32::<16>(r)));
            // SAFETY: 16 u16 lanes below KS, inside `p`.
            unsafe { _mm256_storeu_si256(p.add(16 * v).cast(), _mm512_cvtepi32_epi16(r)) };
        }
        st.l = st.l * corr + _mm512_reduce_add_ps(sum);
        st.l_rounded = st.l_rounded * corr + _mm512_reduce_add_ps(sum_rounded);
        st.m = m_new;
        corr
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod imp {
    use super::{Geometry, RowState};

    pub(super) fn detect() -> bool {
        false
    }
    pub(super) fn with_tiles<R>(_f: impl FnOnce() -> R) -> R {
        unreachable!("AMX is never reported as supported on this target")
    }
    pub(super) fn scores(_: &Geometry, _: usize, _: &[u16], _: &[u16], _: &mut [f32]) {}
    pub(super) fn values(_: &Geometry, _: usize, _: usize, _: &[u16], _: &[u16], _: &mut [f32]) {}
    pub(super) fn softmax_row(_: &[f32], _: usize, _: f32, _: &mut RowState, _: &mut [u16]) -> f32 {
        1.0
    }
}
