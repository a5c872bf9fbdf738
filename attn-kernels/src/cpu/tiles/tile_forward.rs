//! Flash-style forward of one piece (the selected queries and keys of one pattern
//! segment): packed key/value tiles, register-blocked score and value products,
//! online softmax in base 2, never more than a `6 x 64` score tile at a time.

use std::ops::Range;

use attn_core::Element;

use crate::cpu::isa::Isa;
use crate::cpu::isa::kernels;
use crate::cpu::isa::mat::MatMul;
use crate::cpu::isa::ops::{FORWARD_KEY_TILE as KEY_TILE, FORWARD_QUERY_CHUNK, ROW_BLOCK, padded, scratch};
use crate::cpu::isa::rows::{Piece, PieceSpec, key_span};
use crate::cpu::isa::simd::{Simd, with_vectors};
use crate::cpu::tiles::f32_tiles::{pack_rows, pack_transposed};
pub(crate) use crate::cpu::tiles::forward_scratch::ForwardScratch;

/// Query rows whose scores are computed together against one key tile: several
/// register blocks, so each 16-key panel of the tile is reused from L1 by all of them.
const ROW_GROUP: usize = 4 * ROW_BLOCK;

/// Attention of the piece's queries over its keys: writes the normalised output
/// (`out[i*d..]`, f32) and the natural-log LSE (`-inf` where no key is visible).
/// Queries and keys are selected rows of one segment, positions ascending; each query
/// sees the keys its band admits.
pub(crate) fn forward_piece<T: Element>(
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    ws: &mut ForwardScratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    if piece.q.len() == 0 {
        return;
    }
    if crate::cpu::isa::ops::pair_forward_piece(spec, piece, &mut ws.pairs, out, lse) {
        return;
    }
    with_vectors!(spec.isa, |s| {
        if lanes_first(spec.isa) && crate::cpu::tiles::lane_forward::forward_piece(s, spec, piece, ws, out, lse) {
            return;
        }
        forward_piece_rows(s, spec, piece, ws, out, lse)
    })
}

/// [`forward_piece`] with one query per score row (the lane kernel's fallback, and the
/// portable path).
pub(crate) fn forward_piece_rows<S: Simd, T: Element>(
    s: S,
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    ws: &mut ForwardScratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let PieceSpec { scale, d, band, .. } = spec;
    let Piece { q, k, v } = *piece;
    let (nq, dp) = (q.len(), padded(d));
    if nq == 0 {
        return;
    }
    // Keys some query of the piece sees: tile `t` holds keys `k_lo + t * KEY_TILE ..`.
    let span = key_span(k.pos, band, q.pos[0], q.pos[nq - 1]);
    let (k_lo, nk) = (span.start, span.len());
    let tiles = nk.div_ceil(KEY_TILE);
    // Pack every needed key tile once (transposed K, row-major V).
    let kt = scratch(&mut ws.kt, tiles * dp * KEY_TILE);
    let vt = scratch(&mut ws.v, tiles * KEY_TILE * dp);
    // Whether each value tile is all finite: then a masked weight (exactly 0) times a
    // value adds exactly 0, and rows can share one product over the widest range.
    ws.finite.clear();
    for t in 0..tiles {
        let (k0, kn) = (k_lo + t * KEY_TILE, (nk - t * KEY_TILE).min(KEY_TILE));
        pack_transposed(k, k0..k0 + kn, d, dp, KEY_TILE, 1.0, &mut kt[t * dp * KEY_TILE..]);
        let vtile = &mut vt[t * KEY_TILE * dp..(t + 1) * KEY_TILE * dp];
        pack_rows(v, k0, kn, d, dp, 1.0, vtile);
        ws.finite.push(vtile[..kn * dp].iter().all(|x| x.is_finite()));
    }
    let c2 = scale * std::f32::consts::LOG2_E;
    let chunk = FORWARD_QUERY_CHUNK;
    for q0 in (0..nq).step_by(chunk) {
        let qn = (nq - q0).min(chunk);
        let qbuf = scratch(&mut ws.q, qn * dp);
        pack_rows(q, q0, qn, d, dp, c2, qbuf);
        let o = scratch(&mut ws.o, qn * dp);
        o.fill(0.0);
        let m = scratch(&mut ws.m, qn);
        m.fill(f32::NEG_INFINITY);
        let l = scratch(&mut ws.l, qn);
        l.fill(0.0);
        let sc = scratch(&mut ws.s, ROW_GROUP * KEY_TILE);
        let qpos = &q.pos[q0..q0 + qn];
        for t in 0..tiles {
            let (k0, kn) = (k_lo + t * KEY_TILE, (nk - t * KEY_TILE).min(KEY_TILE));
            let kpos = &k.pos[k0..k0 + kn];
            if kpos[0] > qpos[qn - 1].saturating_add(band.right) {
                break; // this and later tiles come after every key the chunk sees
            }
            let ktile = &kt[t * dp * KEY_TILE..(t + 1) * dp * KEY_TILE];
            let vtile = &vt[t * KEY_TILE * dp..(t + 1) * KEY_TILE * dp];
            for r0 in (0..qn).step_by(ROW_GROUP) {
                let rn = (qn - r0).min(ROW_GROUP);
                let rows = &qpos[r0..r0 + rn];
                let cols = key_span(kpos, band, rows[0], rows[rn - 1]);
                if cols.is_empty() {
                    continue; // no row of this block sees a key of this tile
                }
                // Score columns any row of the block can see, in whole 16-column panels.
                let cols = cols.end.next_multiple_of(16).min(KEY_TILE);
                kernels::gemm::<S, false>(
                    s,
                    &MatMul { m: rn, k: dp, n: cols, a: &qbuf[r0 * dp..], lda: dp, b: ktile, ldb: KEY_TILE },
                    sc,
                    KEY_TILE,
                    false,
                );
                let mut ranges = [(0, 0); ROW_GROUP];
                for i in 0..rn {
                    let row = &mut sc[i * KEY_TILE..i * KEY_TILE + cols];
                    let visible = band.visible(kpos, rows[i]);
                    ranges[i] = (visible.start, visible.end);
                    let (mi, li) = (&mut m[r0 + i], &mut l[r0 + i]);
                    let orow = &mut o[(r0 + i) * dp..(r0 + i + 1) * dp];
                    softmax_row(s, row, visible, mi, li, orow);
                }
                if ws.finite[t] {
                    // Finite values: masked weights (0) add exactly 0, so one product over
                    // the widest row's range gives every row the same sums as its own range.
                    let widest = ranges[..rn].iter().map(|r| r.1).max().unwrap_or(0);
                    kernels::gemm::<S, false>(
                        s,
                        &MatMul { m: rn, k: widest, n: dp, a: sc, lda: KEY_TILE, b: vtile, ldb: dp },
                        &mut o[r0 * dp..],
                        dp,
                        true,
                    );
                } else {
                    // Each row reads only the values it sees (a masked NaN/Inf value stays out).
                    kernels::gemm_ranges::<S, false>(
                        s,
                        &ranges[..rn],
                        (sc, KEY_TILE),
                        (vtile, dp),
                        dp,
                        &mut o[r0 * dp..],
                        dp,
                    );
                }
            }
        }
        for i in 0..qn {
            let dst = &mut out[(q0 + i) * d..(q0 + i + 1) * d];
            if l[i] == 0.0 {
                // No visible key (a NaN-poisoned row has l = NaN and falls through).
                dst.fill(0.0);
                lse[q0 + i] = f32::NEG_INFINITY;
            } else {
                let inv = 1.0 / l[i];
                dst.iter_mut().zip(&o[i * dp..]).for_each(|(a, b)| *a = b * inv);
                lse[q0 + i] = (m[i] + l[i].log2()) * std::f32::consts::LN_2;
            }
        }
    }
}

/// Whether the lane kernel runs first on this flavour (measured faster there).
fn lanes_first(isa: Isa) -> bool {
    matches!(isa, Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx | Isa::Avx2)
}

/// One online-softmax step on a score row: columns outside `visible` are masked, the
/// running maximum `m` and sum `l` advance, the row becomes its weights and the row's
/// accumulators `o` are rescaled.
fn softmax_row<S: Simd>(s: S, row: &mut [f32], visible: Range<usize>, m: &mut f32, l: &mut f32, o: &mut [f32]) {
    let end = visible.end.min(row.len());
    row[end..].fill(f32::NEG_INFINITY);
    row[..visible.start.min(end)].fill(f32::NEG_INFINITY);
    let m_new = m.max(kernels::max(s, row));
    if m_new == f32::NEG_INFINITY {
        return nothing_visible(row, visible, l);
    }
    let corr = if m_new == *m { 1.0 } else { crate::cpu::isa::ops::exp2(*m - m_new) };
    let sum = kernels::exp2_sub(s, row, m_new, None);
    *l = *l * corr + sum;
    *m = m_new;
    if corr != 1.0 {
        o.iter_mut().for_each(|x| *x *= corr);
    }
}

/// The row's maximum is still `-inf`: nothing visible yet, or only NaN scores (a NaN
/// poisons the row). The row's weights are all zero.
fn nothing_visible(row: &mut [f32], visible: Range<usize>, l: &mut f32) {
    let end = visible.end.min(row.len());
    if row[visible.start.min(end)..end].iter().any(|x| x.is_nan()) {
        *l = f32::NAN;
    }
    row.fill(0.0);
}

#[cfg(test)]
mod lane_tests {
    //! The lane kernel (`lane_forward`) against this file's row kernel.
    use attn_core::Band;

    use super::*;
    use crate::cpu::isa::rows::PieceRows;
    use crate::cpu::tiles::lane_forward::forward_piece as lane_piece;

    /// The lane kernel on `spec.isa`'s vectors.
    fn on_lanes(spec: PieceSpec, piece: &Piece<'_, '_, f32>, ws: &mut ForwardScratch, o: &mut [f32], l: &mut [f32]) -> bool {
        with_vectors!(spec.isa, |s| lane_piece(s, spec, piece, ws, o, l))
    }

    /// The row kernel on `spec.isa`'s vectors.
    fn on_rows(spec: PieceSpec, piece: &Piece<'_, '_, f32>, ws: &mut ForwardScratch, o: &mut [f32], l: &mut [f32]) {
        with_vectors!(spec.isa, |s| forward_piece_rows(s, spec, piece, ws, o, l))
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    /// The lane kernel equals the row kernel (this file's own path, run on the same
    /// flavour) within f32 rounding on every supported flavour: query blocks with padded
    /// lanes, several key tiles, causal pieces with interleaved positions (some queries
    /// see no key), sliding windows (both edges, and causal), and a query row poisoned
    /// with NaN (its own output only).
    #[test]
    fn lanes_equal_rows() {
        let d = 40;
        let flavours = Isa::ALL.into_iter().filter(|i| *i != Isa::Amx);
        for isa in attn_testkit::isa_policy::runnable("lanes_equal_rows", flavours, Isa::as_str, Isa::is_supported) {
            // Scale 10: base-2 scores spread over hundreds, so the lazy maximum must rise.
            let (full, causal) = (Band::FULL, Band::CAUSAL);
            for (nq, nk, band, qstep, kstep, scale) in [
                (130, 250, full, 1, 1, 0.3),
                (7, 300, full, 2, 2, 0.3),
                (150, 260, causal, 2, 3, 0.3),
                (64, 97, causal, 1, 1, 0.3),
                (100, 400, full, 1, 1, 10.0),
                (80, 200, causal, 1, 1, 10.0),
                (120, 300, Band::new(20, 5), 2, 1, 0.3),
                (90, 200, Band::new(0, 40), 1, 2, 10.0),
                (100, 300, Band::new(3, 0), 1, 1, 0.3),
            ] {
                let (qd, kd, vd) = (values(nq * d, 1), values(nk * d, 2), values(nk * d, 3));
                let qoff: Vec<usize> = (0..nq).map(|i| i * d).collect();
                let koff: Vec<usize> = (0..nk).map(|j| j * d).collect();
                // Keys start after the first queries, so causal rows 0..qstep see nothing.
                let qpos: Vec<usize> = (0..nq).map(|i| i * qstep).collect();
                let kpos: Vec<usize> = (0..nk).map(|j| 2 + j * kstep).collect();
                let mut qd = qd;
                qd[5 * d + 1] = f32::NAN;
                let q = PieceRows { data: &qd, offsets: &qoff, pos: &qpos };
                let k = PieceRows { data: &kd, offsets: &koff, pos: &kpos };
                let v = PieceRows { data: &vd, offsets: &koff, pos: &kpos };
                let (mut o1, mut l1) = (vec![0.0; nq * d], vec![0.0; nq]);
                let (mut o2, mut l2) = (vec![0.0; nq * d], vec![0.0; nq]);
                let mut ws = ForwardScratch::default();
                assert!(on_lanes(
                    PieceSpec { isa, scale, d, band },
                    &Piece { q: &q, k: &k, v: &v },
                    &mut ws,
                    &mut o1,
                    &mut l1
                ));
                on_rows(
                    PieceSpec { isa, scale, d, band },
                    &Piece { q: &q, k: &k, v: &v },
                    &mut ws,
                    &mut o2,
                    &mut l2,
                );
                let case = format!("{} nq={nq} nk={nk} {band:?}", isa.as_str());
                for i in 0..nq {
                    let (a, b) = (&o1[i * d..(i + 1) * d], &o2[i * d..(i + 1) * d]);
                    if i == 5 {
                        assert!(a.iter().all(|x| x.is_nan()) && b.iter().all(|x| x.is_nan()), "{case}: NaN row");
                        continue;
                    }
                    let (la, lb) = (l1[i], l2[i]);
                    assert!(la == lb || (la - lb).abs() <= 1e-5 * lb.abs().max(1.0), "{case}: lse {i}: {la} {lb}");
                    for (x, y) in a.iter().zip(b) {
                        assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "{case}: out {i}: {x} {y}");
                    }
                }
                if band == causal {
                    assert_eq!(l1[0], f32::NEG_INFINITY, "{case}: query 0 precedes every key");
                    assert!(o1[..d].iter().all(|&x| x == 0.0), "{case}: an unseen row is 0");
                }
            }
        }
    }

    /// Causal with a non-finite value: the piece goes back to the row kernel untouched.
    #[test]
    fn causal_poisoned_values_are_handed_back() {
        let d = 16;
        let (qd, kd, mut vd) = (values(32 * d, 4), values(32 * d, 5), values(32 * d, 6));
        vd[7 * d] = f32::INFINITY;
        let off: Vec<usize> = (0..32).map(|i| i * d).collect();
        let pos: Vec<usize> = (0..32).collect();
        let rows = |x| PieceRows { data: x, offsets: &off, pos: &pos };
        let (mut o, mut l) = (vec![7.0; 32 * d], vec![7.0; 32]);
        let mut ws = ForwardScratch::default();
        let isa = Isa::detect();
        assert!(!on_lanes(
            PieceSpec { isa, scale: 0.25, d, band: Band::CAUSAL },
            &Piece { q: &rows(&qd), k: &rows(&kd), v: &rows(&vd) },
            &mut ws,
            &mut o,
            &mut l
        ));
        assert!(o.iter().chain(&l).all(|&x| x == 7.0), "nothing written");
        assert!(on_lanes(
            PieceSpec { isa, scale: 0.25, d, band: Band::FULL },
            &Piece { q: &rows(&qd), k: &rows(&kd), v: &rows(&vd) },
            &mut ws,
            &mut o,
            &mut l
        ));
    }
}
