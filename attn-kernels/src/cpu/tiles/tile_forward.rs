//! Flash-style forward of one piece (the selected queries and keys of one pattern
//! segment) with one query per score row: packed key/value tiles, register-blocked
//! score and value products, online softmax in base 2, never more than a `24 x 128`
//! score tile at a time. Also the value packing both f32 kernels share ([`pack_values`]).

use std::ops::Range;

use attn_core::Element;

use crate::cpu::isa::kernels;
use crate::cpu::isa::mat::{Accumulate, MatMul};
use crate::cpu::isa::ops::{FORWARD_KEY_TILE as KEY_TILE, FORWARD_QUERY_CHUNK, ROW_BLOCK, padded, scratch};
use crate::cpu::isa::rows::{Piece, PieceSpec, key_span};
use crate::cpu::isa::simd::Simd;
use crate::cpu::tiles::f32_tiles::{pack_rows, pack_transposed};
pub(crate) use crate::cpu::tiles::forward_scratch::ForwardScratch;

/// Query rows whose scores are computed together against one key tile: several
/// register blocks, so each 16-key panel of the tile is reused from L1 by all of them.
const ROW_GROUP: usize = 4 * ROW_BLOCK;

/// The forward of a piece with one query per score row (see `piece_forward`), on the
/// value tiles [`pack_values`] packed into `ws`: writes the normalised output
/// (`out[i*d..]`, f32) and the natural-log LSE (`-inf` where no key is visible).
pub(crate) fn forward_piece_rows<S: Simd, T: Element>(
    s: S,
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    ws: &mut ForwardScratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let PieceSpec { scale, d, band, .. } = spec;
    let Piece { q, k, .. } = *piece;
    let (nq, dp) = (q.len(), padded(d));
    if nq == 0 {
        return;
    }
    // Keys some query of the piece sees: tile `t` holds keys `k_lo + t * KEY_TILE ..`.
    let span = key_span(k.pos, band, q.pos[0], q.pos[nq - 1]);
    let (k_lo, nk) = (span.start, span.len());
    let tiles = nk.div_ceil(KEY_TILE);
    // Pack every needed key tile once (transposed K); the value tiles are packed already.
    let kt = scratch(&mut ws.kt, tiles * dp * KEY_TILE);
    for t in 0..tiles {
        let (k0, kn) = (k_lo + t * KEY_TILE, (nk - t * KEY_TILE).min(KEY_TILE));
        pack_transposed(k, k0..k0 + kn, d, dp, KEY_TILE, 1.0, &mut kt[t * dp * KEY_TILE..]);
    }
    let vt = &ws.v[..tiles * KEY_TILE * dp];
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
                    Accumulate::Overwrite,
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
                        Accumulate::Add,
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

/// Packs the values of the keys some query of the piece sees into `ws.v` (row-major,
/// stride `padded(d)`, from the first such key; the row kernel reads them as tiles of
/// [`KEY_TILE`] rows) and records in `ws.finite` whether each tile is all finite.
/// Returns whether every packed value is finite.
pub(crate) fn pack_values<T: Element>(spec: PieceSpec, piece: &Piece<'_, '_, T>, ws: &mut ForwardScratch) -> bool {
    let PieceSpec { d, band, .. } = spec;
    let Piece { q, k, v } = *piece;
    let (nq, dp) = (q.len(), padded(d));
    let span = key_span(k.pos, band, q.pos[0], q.pos[nq - 1]);
    let (k_lo, nk) = (span.start, span.len());
    let tiles = nk.div_ceil(KEY_TILE);
    // One packing pass (its prefetch runs ahead across tile edges); tile `t` is rows
    // `t * KEY_TILE..` of it.
    let vt = scratch(&mut ws.v, tiles * KEY_TILE * dp);
    pack_rows(v, k_lo, nk, d, dp, 1.0, vt);
    // Whether each value tile is all finite: then a masked weight (exactly 0) times a
    // value adds exactly 0, and rows can share one product over the widest range.
    ws.finite.clear();
    ws.finite.extend(vt[..nk * dp].chunks(KEY_TILE * dp).map(|tile| tile.iter().all(|x| x.is_finite())));
    ws.finite.iter().all(|&f| f)
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
