//! AMX-BF16 forward of one piece (x86-64 with AMX-TILE and AMX-BF16, e.g. Sapphire
//! Rapids): bf16 `q·kᵀ` and `p·v` on the tile unit with f32 accumulation, the online
//! softmax in f32 with AVX-512. Only bf16 inputs take it; a piece holding a non-finite
//! value goes back to the f32 kernel, so NaN/Inf confinement is the f32 kernel's.
//!
//! Precision: products of bf16 values are exact in f32 and summed in f32, as in the
//! f32 kernel; the probabilities are rounded to bf16 for `p·v` (as GPU flash attention
//! does); the normalising sum and the LSE use the unrounded probabilities.
//!
//! Unsafe: the tile instructions (inline assembly on pointers into this module's own
//! scratch buffers, sized before use) and the AVX-512 softmax rows.
#![allow(unsafe_code)]

use attn_core::{DType, Element};

use crate::pack::PieceRows;
use crate::tile_forward::keys_needed;

/// Queries per block (tile rows).
const QB: usize = 16;
/// Keys per softmax step (four 16-key score tiles).
const KS: usize = 64;
/// bf16 elements per tile row (64 bytes): keys per `p·v` chunk, dims per `q·k` chunk.
const KC: usize = 32;
/// Widest head the tile path takes (`pack_keys` stages one row of pairs on the stack);
/// wider heads run on the f32 kernel.
const MAX_HEAD_DIM: usize = 512;
/// bf16 pairs (u32) in one 16 x 64-byte tile.
const TILE: usize = 256;

/// Whether the CPU has AMX-TILE, AMX-BF16, AVX-512F and AVX512-BF16 and the OS lets this process use
/// the tile registers (Linux `arch_prctl(ARCH_REQ_XCOMP_PERM)`); asked once.
pub(crate) fn supported() -> bool {
    static S: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *S.get_or_init(imp::detect)
}

/// Upper bound of the bytes an [`AmxScratch`] grows to for pieces of at most `m` keys and
/// head dim `d` (packed keys and values, one query block, double-buffered scores and
/// probabilities, the output block), doubled for the slack a growing `Vec` may keep.
pub(crate) fn scratch_bytes(d: usize, m: usize) -> usize {
    let g = Geometry::new(d, m);
    let (keys, values) = (g.steps * g.qc() * 4 * TILE, g.steps * 2 * g.ne() * TILE);
    2 * (4 * (keys + values) + 2 * QB * g.dq + 4 * 2 * QB * KS + 2 * 2 * QB * KS + 4 * QB * g.dv)
}

/// Reusable buffers of the AMX forward (one per worker).
#[derive(Debug, Default)]
pub(crate) struct AmxScratch {
    kb: Vec<u32>,
    vb: Vec<u32>,
    q: Vec<u16>,
    s: Vec<f32>,
    p: Vec<u16>,
    o: Vec<f32>,
}

/// The 16 stored bits of an element known to be bf16.
#[inline(always)]
fn bits<T: Element>(x: T) -> u16 {
    x.to_bits() as u16
}

/// Whether every value of the rows is finite: a bf16 is NaN or infinite exactly when
/// its exponent bits are all ones, i.e. when `(bits & 0x7f80) + 0x80` reaches bit 15
/// (an OR over the rows, which the compiler vectorises).
fn all_finite<T: Element>(rows: &PieceRows<'_, T>, n: usize, d: usize) -> bool {
    let mut acc = 0u16;
    for i in 0..n {
        prefetch_row(rows, i + PREFETCH, d);
        for &x in rows.row(i, d) {
            acc |= nonfinite_flag(bits(x));
        }
    }
    acc & 0x8000 == 0
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
    // The softmax scales after the maximum (needs c2 > 0, which validation ensures).
    if T::DTYPE != DType::BF16
        || !supported()
        || nq == 0
        || d > MAX_HEAD_DIM
        || scale.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
    {
        return false;
    }
    let nk = keys_needed(k.pos, causal, q.pos[nq - 1]);
    let g = Geometry::new(d, nk);
    if !(all_finite(q, nq, d) && pack_keys(k, nk, d, &g, &mut ws.kb) && pack_values(v, nk, d, &g, &mut ws.vb)) {
        return false;
    }
    assert!(out.len() >= nq * d && lse.len() >= nq, "amx forward: output too short");
    ws.q.resize(QB * g.dq, 0);
    ws.s.resize(2 * QB * KS, 0.0);
    ws.p.resize(2 * QB * KS, 0);
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
            let mut corr = [1.0f32; QB];
            ws.o.fill(0.0);
            imp::load_output(&g, &ws.o);
            // Steps this block needs (causal: up to the first key after its last query).
            let steps = if causal { keys_needed(k.pos, true, qpos[qn - 1]).div_ceil(KS) } else { g.steps };
            let (s_len, p_len) = (QB * KS, QB * KS);
            // Software pipeline: the scores of step t+1 go to the other half of the
            // double-buffered `s` before the softmax of step t, so the tile unit works
            // while the vector units do the softmax.
            if steps > 0 {
                imp::scores(&g, 0, (nk).min(KS), &ws.q, &ws.kb, &mut ws.s[..s_len]);
            }
            for t in 0..steps {
                let k0 = t * KS;
                let kn = (nk - k0).min(KS);
                let kpos = &k.pos[k0..k0 + kn];
                let (cur, next) = if t % 2 == 0 { (0, s_len) } else { (s_len, 0) };
                if t + 1 < steps {
                    let kn_next = (nk - k0 - KS).min(KS);
                    imp::scores(&g, t + 1, kn_next, &ws.q, &ws.kb, &mut ws.s[next..next + s_len]);
                }
                let pb = &mut ws.p[(t % 2) * p_len..(t % 2 + 1) * p_len];
                for (i, row) in rows.iter_mut().enumerate() {
                    let vis = if i >= qn {
                        0
                    } else if causal && kpos[kn - 1] > qpos[i] {
                        kpos.partition_point(|&p| p <= qpos[i])
                    } else {
                        kn
                    };
                    let p = &mut pb[i * KS..(i + 1) * KS];
                    corr[i] = imp::softmax_row(&ws.s[cur + i * KS..cur + (i + 1) * KS], vis, c2, row, p);
                }
                if corr.iter().any(|&c| c != 1.0) {
                    // Rare (lazy rescaling): bring the accumulator out, scale its rows.
                    imp::store_output(&g, &mut ws.o);
                    for (i, &c) in corr.iter().enumerate() {
                        ws.o[i * g.dv..(i + 1) * g.dv].iter_mut().for_each(|x| *x *= c);
                    }
                    imp::load_output(&g, &ws.o);
                }
                imp::values(&g, t, kn.div_ceil(KC), pb, &ws.vb, &mut ws.o);
            }
            imp::store_output(&g, &mut ws.o);
            for (i, row) in rows.iter().enumerate().take(qn) {
                let dst = &mut out[(q0 + i) * d..(q0 + i + 1) * d];
                let l = row.sum();
                if l == 0.0 {
                    dst.fill(0.0);
                    lse[q0 + i] = f32::NEG_INFINITY;
                } else {
                    let inv = 1.0 / l;
                    dst.iter_mut().zip(&ws.o[i * g.dv..]).for_each(|(a, b)| *a = b * inv);
                    lse[q0 + i] = (row.m + l.log2()) * std::f32::consts::LN_2;
                }
            }
        }
    });
    true
}

/// Online-softmax state of one query row (base 2, scores already scaled).
#[derive(Debug, Clone, Copy)]
struct RowState {
    /// Running maximum (moved lazily, see `LAZY_RESCALE`).
    m: f32,
    /// Lane-wise partial sums of the probabilities (before their rounding to bf16).
    l: [f32; 16],
}

impl Default for RowState {
    fn default() -> Self {
        RowState { m: f32::NEG_INFINITY, l: [0.0; 16] }
    }
}

impl RowState {
    /// The row's probability sum (fixed summation order).
    fn sum(&self) -> f32 {
        self.l.iter().sum()
    }
}

/// How far (log2) a score may pass the running maximum before the row is rescaled:
/// probabilities stay below `2^LAZY_RESCALE`, far inside f32 and bf16 range, and most
/// steps need no rescaling of the output accumulator.
const LAZY_RESCALE: f32 = 8.0;

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
    /// Offset (in bf16 pairs) of the key tile (step `t`, dim chunk `c`, 16-key group `g`).
    fn k_tile(&self, t: usize, c: usize, g: usize) -> usize {
        ((t * self.qc() + c) * 4 + g) * TILE
    }
    /// Offset (in bf16 pairs) of the value tile (step `t`, key chunk `kc`, output tile `e`).
    fn v_tile(&self, t: usize, kc: usize, e: usize) -> usize {
        ((t * 2 + kc) * self.ne() + e) * TILE
    }
}

/// Rows ahead that packing asks the cache for: dilated rows are strided (often a
/// kilobyte or more apart), which the hardware prefetchers follow poorly.
const PREFETCH: usize = 8;

/// Ask for row `i` (if it exists) to be brought into the cache.
#[inline(always)]
fn prefetch_row<T: Element>(rows: &PieceRows<'_, T>, i: usize, d: usize) {
    if let Some(&off) = rows.offsets.get(i) {
        let start = rows.data[off..].as_ptr();
        imp::prefetch(start.cast(), d * std::mem::size_of::<T>());
    }
}

/// `(bits & 0x7f80) + 0x80`: bit 15 is set exactly when the bf16 is NaN or infinite.
#[inline(always)]
fn nonfinite_flag(b: u16) -> u16 {
    (b & 0x7f80) + 0x80
}

/// Two bf16 as one pair (`lo` in the low half, as the tile unit reads them).
#[inline(always)]
fn pair(lo: u16, hi: u16) -> u32 {
    u32::from(lo) | (u32::from(hi) << 16)
}

/// Bit 15 or 31 set exactly when one of the pair's bf16 is NaN or infinite (see
/// [`nonfinite_flag`]; the low half's sum stays below `0x10000`, so no carry crosses).
#[inline(always)]
fn nonfinite_pair(x: u32) -> u32 {
    (x & 0x7f80_7f80) + 0x0080_0080
}

/// Keys in the tile unit's pair layout: pair `p` of tile (t, c, g), column `j` holds
/// `k[t*64 + g*16 + j][c*32 + 2p ..= c*32 + 2p + 1]` (zero past `nk` or `d`). Returns
/// whether every packed value is finite.
fn pack_keys<T: Element>(k: &PieceRows<'_, T>, nk: usize, d: usize, g: &Geometry, dst: &mut Vec<u32>) -> bool {
    dst.clear();
    dst.resize(g.steps * g.qc() * 4 * TILE, 0);
    let mut flags = 0u32;
    let mut row32 = [0u32; MAX_HEAD_DIM / 2];
    let pairs = d.div_ceil(2);
    for key in 0..nk {
        prefetch_row(k, key + PREFETCH, d);
        let (t, g16, j) = (key / KS, (key % KS) / 16, key % 16);
        let row = k.row(key, d);
        for (r, two) in row32.iter_mut().zip(row.chunks(2)) {
            *r = pair(bits(two[0]), two.get(1).map_or(0, |&x| bits(x)));
            flags |= nonfinite_pair(*r);
        }
        for c in 0..g.qc() {
            let tile = &mut dst[g.k_tile(t, c, g16) + j..];
            for p in 0..16.min(pairs.saturating_sub(16 * c)) {
                tile[p * 16] = row32[16 * c + p];
            }
        }
    }
    flags & 0x8000_8000 == 0
}

/// Values in the pair layout: pair `j` of row `p` of tile (t, kc, e) holds
/// `v[k][e*16 + j]` and `v[k+1][e*16 + j]` for `k = t*64 + kc*32 + 2p` (zero past `nk`
/// or `d`). Returns whether every packed value is finite.
fn pack_values<T: Element>(v: &PieceRows<'_, T>, nk: usize, d: usize, g: &Geometry, dst: &mut Vec<u32>) -> bool {
    dst.clear();
    dst.resize(g.steps * 2 * g.ne() * TILE, 0);
    let mut flags = 0u32;
    for key in (0..nk).step_by(2) {
        prefetch_row(v, key + PREFETCH, d);
        prefetch_row(v, key + PREFETCH + 1, d);
        let (t, kc, p) = (key / KS, (key % KS) / KC, (key % KC) / 2);
        let r0 = v.row(key, d);
        let r1 = if key + 1 < nk { Some(v.row(key + 1, d)) } else { None };
        for e in 0..g.ne() {
            let cols = 16 * e..(16 * e + 16).min(d);
            let tile = &mut dst[g.v_tile(t, kc, e) + p * 16..][..cols.len()];
            match r1 {
                Some(r1) => {
                    for ((o, &a), &b) in tile.iter_mut().zip(&r0[cols.clone()]).zip(&r1[cols]) {
                        *o = pair(bits(a), bits(b));
                        flags |= nonfinite_pair(*o);
                    }
                }
                None => {
                    for (o, &a) in tile.iter_mut().zip(&r0[cols]) {
                        *o = pair(bits(a), 0);
                        flags |= nonfinite_pair(*o);
                    }
                }
            }
        }
    }
    flags & 0x8000_8000 == 0
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod imp {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::{Geometry, KC, KS, QB, RowState, TILE};

    pub(super) fn detect() -> bool {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        if !(std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")) {
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

    /// One row of a step: scaled, masked past `vis`, online-softmax update of `st`, the
    /// probabilities written as bf16 to `p` (zero past `vis`). Returns the factor the
    /// row's output accumulator must be multiplied by.
    pub(super) fn softmax_row(s: &[f32], vis: usize, c2: f32, st: &mut RowState, p: &mut [u16]) -> f32 {
        assert!(s.len() >= KS && p.len() >= KS && vis <= KS, "amx softmax: row too short");
        // SAFETY: AVX-512F and AVX512-BF16 are present (part of `supported()`); the slices
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
    /// elements; `vis <= KS`.
    #[target_feature(enable = "avx512f,avx512bf16")]
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
        let limit = if st.m == f32::NEG_INFINITY { f32::NEG_INFINITY } else { (st.m + super::LAZY_RESCALE) / c2 };
        if _mm512_cmp_ps_mask::<_CMP_GT_OQ>(mx, _mm512_set1_ps(limit)) != 0 {
            let step_max = c2 * _mm512_reduce_max_ps(mx);
            if st.m != f32::NEG_INFINITY {
                corr = crate::portable::exp2(st.m - step_max);
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
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod imp {
    use super::{Geometry, RowState};

    pub(super) fn detect() -> bool {
        false
    }
    pub(super) fn prefetch(_: *const i8, _: usize) {}
    pub(super) fn with_tiles<R>(_f: impl FnOnce() -> R) -> R {
        unreachable!("AMX is never reported as supported on this target")
    }
    pub(super) fn scores(_: &Geometry, _: usize, _: usize, _: &[u16], _: &[u32], _: &mut [f32]) {}
    pub(super) fn load_output(_: &Geometry, _: &[f32]) {}
    pub(super) fn store_output(_: &Geometry, _: &mut [f32]) {}
    pub(super) fn values(_: &Geometry, _: usize, _: usize, _: &[u16], _: &[u32], _: &mut [f32]) {}
    pub(super) fn softmax_row(_: &[f32], _: usize, _: f32, _: &mut RowState, _: &mut [u16]) -> f32 {
        1.0
    }
}
