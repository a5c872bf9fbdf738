//! bf16 forward of one piece on bf16 pairs with f32 accumulation: `q·kᵀ` and `p·v` on
//! the AMX tile unit ([`Engine::Tiles`], x86-64 with AMX-TILE and AMX-BF16, e.g.
//! Sapphire Rapids) or with AVX512-BF16 dot products ([`Engine::Dot`], `vdpbf16ps`, e.g.
//! Zen 4), the online softmax in f32 with AVX-512. Both engines read the same packed
//! layouts (pairs of bf16 along the products' inner dimension). Only bf16 inputs take
//! it; a piece holding a non-finite value goes back to the f32 kernel, so NaN/Inf
//! confinement is the f32 kernel's.
//!
//! Precision: products of bf16 values are exact in f32 and summed in f32, as in the
//! f32 kernel; the probabilities are rounded to bf16 for `p·v` (as GPU flash attention
//! does); the normalising sum and the LSE use the unrounded probabilities.
//!
//! Unsafe code lives only in `arch` (the tile instructions, as inline assembly on
//! pointers into this module's own scratch buffers, sized before use, the AVX-512
//! softmax rows) and `arch::dot` (the `vdpbf16ps` products); this file is safe Rust.

#[cfg(target_arch = "x86_64")]
mod arch;
#[cfg(not(target_arch = "x86_64"))]
#[path = "unsupported.rs"]
mod arch;
mod layout;
mod pair_tiles;

use std::ops::Range;

use attn_core::{DType, Element};

use crate::cpu::isa::rows::{Piece, PieceSpec, key_span};
use layout::{Geometry, KC, KS, MAX_HEAD_DIM, QB, RowState, TILE, bits};
use pair_tiles::{all_finite, pack_keys, pack_values};

/// What runs the bf16 pair products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Engine {
    /// The AMX tile unit (`tdpbf16ps`), output accumulator kept in tiles.
    Tiles,
    /// AVX512-BF16 `vdpbf16ps` in register blocks, output accumulator in memory.
    Dot,
}

impl Engine {
    /// Tiles: the CPU has AMX-TILE, AMX-BF16, AVX-512F and AVX512-BF16 and the OS lets
    /// this process use the tile registers (Linux `arch_prctl(ARCH_REQ_XCOMP_PERM)`).
    /// Dot: the CPU has AVX-512F and AVX512-BF16 (`cpu_features`, asked once).
    pub(crate) fn supported(self) -> bool {
        match self {
            Engine::Tiles => crate::cpu::isa::cpu_features::amx_bf16(),
            Engine::Dot => crate::cpu::isa::cpu_features::avx512_bf16(),
        }
    }

    /// Run `f` with this engine's state set up on this thread (the tile configuration).
    fn run<R>(self, f: impl FnOnce() -> R) -> R {
        match self {
            Engine::Tiles => arch::with_tiles(f),
            Engine::Dot => f(),
        }
    }

    /// Move the output accumulator into the engine (tiles only; Dot works in memory).
    fn load_output(self, g: &Geometry, o: &[f32]) {
        if self == Engine::Tiles {
            arch::load_output(g, o);
        }
    }

    /// Move the output accumulator back to memory (tiles only).
    fn store_output(self, g: &Geometry, o: &mut [f32]) {
        if self == Engine::Tiles {
            arch::store_output(g, o);
        }
    }

    /// Scores of key step `t`: see `arch::scores`.
    fn scores(self, g: &Geometry, t: usize, kn: usize, q: &[u16], kb: &[u32], s: &mut [f32]) {
        match self {
            Engine::Tiles => arch::scores(g, t, kn, q, kb, s),
            Engine::Dot => arch::dot::scores(g, t, kn, q, kb, s),
        }
    }

    /// `o += p · v_t`: see `arch::values`.
    fn values(self, g: &Geometry, t: usize, chunks: usize, p: &[u16], vb: &[u32], o: &mut [f32]) {
        match self {
            Engine::Tiles => arch::values(g, t, chunks, p, vb, o),
            Engine::Dot => arch::dot::values(g, t, chunks, p, vb, o),
        }
    }
}

/// Upper bound of the bytes a [`PairScratch`] grows to for pieces of at most `m` keys and
/// head dim `d` (packed keys and values, one query block, double-buffered scores and
/// probabilities, the output block), doubled for the slack a growing `Vec` may keep.
/// In u128: `d` and `m` come from a caller's shape and may be huge.
pub(crate) fn scratch_bytes(d: usize, m: usize) -> u128 {
    let g = Geometry::new(d, m);
    let [steps, qc, ne, dq, dv] = [g.steps, g.qc(), g.ne(), g.dq, g.dv].map(|x| x as u128);
    let [qb, ks, tile] = [QB, KS, TILE].map(|x| x as u128);
    let (keys, values) = (steps * qc * 4 * tile, steps * 2 * ne * tile);
    2 * (4 * (keys + values) + 2 * qb * dq + 4 * 2 * qb * ks + 2 * 2 * qb * ks + 4 * qb * dv)
}

/// Reusable buffers of the bf16 pair forward (one per worker).
#[derive(Debug, Default)]
pub(crate) struct PairScratch {
    kb: Vec<u32>,
    vb: Vec<u32>,
    q: Vec<u16>,
    s: Vec<f32>,
    p: Vec<u16>,
    o: Vec<f32>,
}

/// A piece packed for the bf16 pair forward on `engine` (see [`pack`]): the span of its
/// keys some query sees, and the padded sizes of the packed layouts.
#[derive(Debug, Clone)]
pub(crate) struct Packed {
    engine: Engine,
    span: Range<usize>,
    g: Geometry,
}

/// Packs a bf16 piece's keys and values for the pair forward on `engine` (into `ws`),
/// or `None` when the piece is not bf16, holds a non-finite value, its head dim or
/// scale is out of the engine's range, or the engine is unavailable: the caller then
/// runs the f32 kernel.
pub(crate) fn pack<T: Element>(
    engine: Engine,
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    ws: &mut PairScratch,
) -> Option<Packed> {
    let PieceSpec { scale, d, band, .. } = spec;
    let Piece { q, k, v } = *piece;
    let nq = q.len();
    // The softmax scales after the maximum (needs c2 > 0, which validation ensures).
    if T::DTYPE != DType::BF16
        || !engine.supported()
        || nq == 0
        || d > MAX_HEAD_DIM
        || scale.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
    {
        return None;
    }
    // Only the keys some query of the piece sees are packed.
    let span = key_span(k.pos, band, q.pos[0], q.pos[nq - 1]);
    let (k, v) = (k.slice(span.clone()), v.slice(span.clone()));
    let g = Geometry::new(d, k.len());
    let vector = arch::pair_tiles_avx512::available();
    let finite = all_finite(q, nq, d)
        && pack_keys(vector, &k, k.len(), d, &g, &mut ws.kb)
        && pack_values(vector, &v, v.len(), d, &g, &mut ws.vb);
    finite.then_some(Packed { engine, span, g })
}

/// The bf16 pair forward of a piece [`pack`] packed, with
/// [`crate::cpu::tiles::piece_forward::forward_piece`]'s contract.
pub(crate) fn run<T: Element>(
    packed: &Packed,
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    ws: &mut PairScratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let PieceSpec { scale, d, band, .. } = spec;
    let Piece { q, k, .. } = *piece;
    let Packed { engine, span, g } = packed.clone();
    let (nq, k) = (q.len(), k.slice(span));
    let nk = k.len();
    assert!(out.len() >= nq * d && lse.len() >= nq, "bf16 pair forward: output too short");
    ws.q.resize(QB * g.dq, 0);
    ws.s.resize(2 * QB * KS, 0.0);
    ws.p.resize(2 * QB * KS, 0);
    ws.o.resize(QB * g.dv, 0.0);
    let c2 = scale * std::f32::consts::LOG2_E;
    engine.run(|| {
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
            engine.load_output(&g, &ws.o);
            // Steps this block needs: those holding a key some query of the block sees.
            let block = key_span(k.pos, band, qpos[0], qpos[qn - 1]);
            let steps = if block.is_empty() { 0..0 } else { block.start / KS..block.end.div_ceil(KS) };
            let (s_len, p_len) = (QB * KS, QB * KS);
            // Software pipeline: the scores of step t+1 go to the other half of the
            // double-buffered `s` before the softmax of step t, so the tile unit works
            // while the vector units do the softmax (with Dot, the same order).
            if !steps.is_empty() {
                let t = steps.start;
                engine.scores(&g, t, (nk - t * KS).min(KS), &ws.q, &ws.kb, &mut ws.s[..s_len]);
            }
            for t in steps.clone() {
                let k0 = t * KS;
                let kn = (nk - k0).min(KS);
                let kpos = &k.pos[k0..k0 + kn];
                let (cur, next) = if (t - steps.start) % 2 == 0 { (0, s_len) } else { (s_len, 0) };
                if t + 1 < steps.end {
                    let kn_next = (nk - k0 - KS).min(KS);
                    engine.scores(&g, t + 1, kn_next, &ws.q, &ws.kb, &mut ws.s[next..next + s_len]);
                }
                let pb = &mut ws.p[(t % 2) * p_len..(t % 2 + 1) * p_len];
                for (i, row) in rows.iter_mut().enumerate() {
                    let vis = if i < qn { band.visible(kpos, qpos[i]) } else { 0..0 };
                    let p = &mut pb[i * KS..(i + 1) * KS];
                    corr[i] = arch::softmax_row(&ws.s[cur + i * KS..cur + (i + 1) * KS], vis, c2, row, p);
                }
                if corr.iter().any(|&c| c != 1.0) {
                    // Rare (lazy rescaling): bring the accumulator out, scale its rows.
                    engine.store_output(&g, &mut ws.o);
                    for (i, &c) in corr.iter().enumerate() {
                        ws.o[i * g.dv..(i + 1) * g.dv].iter_mut().for_each(|x| *x *= c);
                    }
                    engine.load_output(&g, &ws.o);
                }
                engine.values(&g, t, kn.div_ceil(KC), pb, &ws.vb, &mut ws.o);
            }
            engine.store_output(&g, &mut ws.o);
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa::rows::PieceRows;
    use half::bf16;

    fn bf(n: usize, seed: u32) -> Vec<bf16> {
        (0..n)
            .map(|i| bf16::from_f32((((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 500.0 - 2.0))
            .collect()
    }

    /// The Dot engine's scores and value products on the packed layouts equal the same
    /// sums in scalar f32 (products of bf16 are exact in f32; only the summation order
    /// differs), for head dims whose chunks and output tiles are ragged.
    #[test]
    fn dot_products_equal_scalar_sums() {
        if !Engine::Dot.supported() {
            println!("skipped: no AVX512-BF16");
            return;
        }
        for (d, nk) in [(40, 70), (72, 128), (16, 5), (128, 64)] {
            let g = Geometry::new(d, nk);
            let (kd, vd, qd) = (bf(nk * d, 1), bf(nk * d, 2), bf(QB * d, 3));
            let (off, pos): (Vec<usize>, Vec<usize>) = (0..nk).map(|j| (j * d, j)).unzip();
            let rows = |x| PieceRows { data: x, offsets: &off, pos: &pos };
            let (mut kb, mut vb) = (Vec::new(), Vec::new());
            let vector = arch::pair_tiles_avx512::available();
            assert!(
                pack_keys(vector, &rows(&kd), nk, d, &g, &mut kb)
                    && pack_values(vector, &rows(&vd), nk, d, &g, &mut vb)
            );
            let mut q = vec![0u16; QB * g.dq];
            for i in 0..QB {
                for e in 0..d {
                    q[i * g.dq + e] = qd[i * d + e].to_bits();
                }
            }
            let p: Vec<u16> = bf(QB * KS, 4).iter().map(|x| bf16::from_f32(x.to_f32().abs()).to_bits()).collect();
            let close = |a: f32, b: f32, mag: f32| (a - b).abs() <= 1e-5 * mag.max(1.0);
            for t in 0..g.steps {
                let kn = (nk - t * KS).min(KS);
                let mut s = vec![f32::NAN; QB * KS];
                Engine::Dot.scores(&g, t, kn, &q, &kb, &mut s);
                for i in 0..QB {
                    for j in 0..kn {
                        let terms = (0..d).map(|e| qd[i * d + e].to_f32() * kd[(t * KS + j) * d + e].to_f32());
                        let (want, mag) = terms.fold((0.0, 0.0), |(s, m), x| (s + x, m + x.abs()));
                        assert!(close(s[i * KS + j], want, mag), "d={d} t={t} score {i},{j}");
                    }
                }
                let mut o = vec![0.5f32; QB * g.dv];
                Engine::Dot.values(&g, t, kn.div_ceil(KC), &p, &vb, &mut o);
                for i in 0..QB {
                    for e in 0..d {
                        let terms = (0..kn)
                            .map(|j| bf16::from_bits(p[i * KS + j]).to_f32() * vd[(t * KS + j) * d + e].to_f32());
                        let (want, mag) = terms.fold((0.5, 0.5), |(s, m), x| (s + x, m + x.abs()));
                        assert!(close(o[i * g.dv + e], want, mag), "d={d} t={t} value {i},{e}");
                    }
                }
            }
        }
    }
}
