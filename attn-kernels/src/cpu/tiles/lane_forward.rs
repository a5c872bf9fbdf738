//! Flash-style forward of one piece with its queries in SIMD lanes: scores are computed
//! transposed (keys are rows, a block of up to 64 queries are the columns), so the online
//! softmax's maxima, sums and rescales are lane-wise vector operations with no
//! horizontal reductions per row, and the value product reads the packed value rows in
//! place as Vᵀ. Runs when every weight it forms is one the row kernel would form too
//! (see [`forward_piece`]).

use attn_core::Element;

use crate::cpu::isa::kernels;
use crate::cpu::isa::mat::{Accumulate, LaneState, MatMul};
use crate::cpu::isa::ops::{padded, scratch};
use crate::cpu::isa::rows::{Piece, PieceSpec, key_span};
use crate::cpu::isa::simd::Simd;
use crate::cpu::tiles::f32_tiles::{pack_rows, pack_transposed};
use crate::cpu::tiles::forward_scratch::ForwardScratch;

/// Queries per block (the lanes of four 16-wide vectors: one micro-kernel row block).
pub(crate) const LANE_QUERIES: usize = 64;
/// Keys per score tile: whole 6-row register blocks, and a tile of scores (24 KB),
/// the block's scaled Qᵀ and its accumulators stay in L1 together.
pub(crate) const LANE_KEY_TILE: usize = 96;
/// A lane's running maximum is raised only when a tile's maximum exceeds it by more
/// than this (base 2): weights stay at most `2^8`, and most tiles rescale nothing.
const LAZY_MAX: f32 = 8.0;

/// Attention of the piece's queries over its keys, as `tile_forward::forward_piece_rows`
/// (normalised output rows `out[i*d..]`, natural-log LSE, `-inf` where no key is
/// visible), on the values `tile_forward::pack_values` packed into `ws`. Only for a
/// piece whose band masks no pair or whose values are all finite: a masked weight is 0
/// here too, but one product serves all lanes, so `0 * NaN` would reach queries that
/// must not see that value (`piece_forward` chooses accordingly).
pub(crate) fn forward_piece<S: Simd, T: Element>(
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
    // Keys some query of the piece sees, packed from `k_lo`.
    let span = key_span(k.pos, band, q.pos[0], q.pos[nq - 1]);
    let (k_lo, nk) = (span.start, span.len());
    let kb = scratch(&mut ws.kt, nk * dp);
    pack_rows(k, k_lo, nk, d, dp, 1.0, kb);
    let vb = &ws.v[..nk * dp];
    let kpos_all = &k.pos[k_lo..k_lo + nk];
    let c2 = scale * std::f32::consts::LOG2_E;
    for q0 in (0..nq).step_by(LANE_QUERIES) {
        let qn = (nq - q0).min(LANE_QUERIES);
        let lanes = qn.next_multiple_of(16);
        let qpos = &q.pos[q0..q0 + qn];
        // Qᵀ in base-2 score units; lanes past `qn` are zero (their results are dropped).
        let qt = scratch(&mut ws.q, dp * lanes);
        pack_transposed(q, q0..q0 + qn, d, dp, lanes, c2, qt);
        let ot = scratch(&mut ws.o, dp * lanes);
        ot.fill(0.0);
        let m = scratch(&mut ws.m, lanes);
        m.fill(f32::NEG_INFINITY);
        let l = scratch(&mut ws.l, lanes);
        l.fill(0.0);
        let sc = scratch(&mut ws.s, LANE_KEY_TILE * lanes);
        // Keys some query of the block can see.
        let block = key_span(kpos_all, band, qpos[0], qpos[qn - 1]);
        for k0 in block.clone().step_by(LANE_KEY_TILE) {
            let kn = (block.end - k0).min(LANE_KEY_TILE);
            let kpos = &kpos_all[k0..k0 + kn];
            let tile = &mut sc[..kn * lanes];
            kernels::gemm::<S, false>(
                s,
                &MatMul { m: kn, k: dp, n: lanes, a: &kb[k0 * dp..], lda: dp, b: qt, ldb: lanes },
                tile,
                lanes,
                Accumulate::Overwrite,
            );
            if !(band.admits(qpos[0], kpos[kn - 1]) && band.admits(qpos[qn - 1], kpos[0])) {
                // Some pair is outside the band: each key row hides the lanes whose query
                // does not see it.
                for (row, &kp) in tile.chunks_exact_mut(lanes).zip(kpos) {
                    let seen = band.seen_by(qpos, kp);
                    row[..seen.start].fill(f32::NEG_INFINITY);
                    row[seen.end..qn].fill(f32::NEG_INFINITY);
                }
            }
            kernels::softmax_lanes(s, tile, kn, lanes, LAZY_MAX, &mut LaneState { m, l, o: ot, dp });
            // Oᵀ += Vᵀ Pᵀ: the packed value rows read in place as a column-major A.
            kernels::gemm::<S, true>(
                s,
                &MatMul { m: dp, k: kn, n: lanes, a: &vb[k0 * dp..], lda: dp, b: tile, ldb: lanes },
                ot,
                lanes,
                Accumulate::Add,
            );
        }
        for (i, &li) in l[..qn].iter().enumerate() {
            let dst = &mut out[(q0 + i) * d..(q0 + i + 1) * d];
            if li == 0.0 {
                // No visible key (a NaN-poisoned lane has l = NaN and falls through).
                dst.fill(0.0);
                lse[q0 + i] = f32::NEG_INFINITY;
            } else {
                let inv = 1.0 / li;
                for (e, x) in dst.iter_mut().enumerate() {
                    *x = ot[e * lanes + i] * inv;
                }
                lse[q0 + i] = (m[i] + li.log2()) * std::f32::consts::LN_2;
            }
        }
    }
}
