//! Flash-style forward of one piece with its queries in SIMD lanes: scores are computed
//! transposed (keys are rows, a block of up to 64 queries are the columns), so the online
//! softmax's maxima, sums and rescales are lane-wise vector operations with no
//! horizontal reductions per row, and the value product reads the packed value rows in
//! place as Vᵀ. Runs when every weight it forms is one the row kernel would form too;
//! otherwise it hands the piece back (see [`forward_piece`]).

use attn_core::{Band, Element};

use crate::f32_tiles::{pack_rows, pack_transposed};
use crate::forward_scratch::ForwardScratch;
use crate::mat::{LaneState, MatMul};
use crate::ops::{self, padded, scratch};
use crate::rows::{Piece, PieceSpec, key_span};

/// Queries per block (the lanes of four 16-wide vectors: one micro-kernel row block).
pub(crate) const LANE_QUERIES: usize = 64;
/// Keys per score tile: whole 6-row register blocks, and a tile of scores (24 KB),
/// the block's scaled Qᵀ and its accumulators stay in L1 together.
pub(crate) const LANE_KEY_TILE: usize = 96;
/// A lane's running maximum is raised only when a tile's maximum exceeds it by more
/// than this (base 2): weights stay at most `2^8`, and most tiles rescale nothing.
const LAZY_MAX: f32 = 8.0;

/// Attention of the piece's queries over its keys, as `tile_forward::forward_piece`
/// (normalised output rows `out[i*d..]`, natural-log LSE, `-inf` where no key is
/// visible), or false with nothing written when the piece's band masks some pairs and a
/// value is non-finite: a masked weight is 0 here too, but one product serves all
/// lanes, so `0 * NaN` would reach queries that must not see that value.
pub(crate) fn forward_piece<T: Element>(
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    ws: &mut ForwardScratch,
    out: &mut [f32],
    lse: &mut [f32],
) -> bool {
    let PieceSpec { isa, scale, d, band } = spec;
    let Piece { q, k, v } = *piece;
    let (nq, dp) = (q.len(), padded(d));
    if nq == 0 {
        return true;
    }
    // Keys some query of the piece sees, packed from `k_lo`.
    let span = key_span(k.pos, band, q.pos[0], q.pos[nq - 1]);
    let (k_lo, nk) = (span.start, span.len());
    let kb = scratch(&mut ws.kt, nk * dp);
    pack_rows(k, k_lo, nk, d, dp, 1.0, kb);
    let vb = scratch(&mut ws.v, nk * dp);
    pack_rows(v, k_lo, nk, d, dp, 1.0, vb);
    if band != Band::FULL && !vb.iter().all(|x| x.is_finite()) {
        return false;
    }
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
        let s = scratch(&mut ws.s, LANE_KEY_TILE * lanes);
        // Keys some query of the block can see.
        let block = key_span(kpos_all, band, qpos[0], qpos[qn - 1]);
        for k0 in block.clone().step_by(LANE_KEY_TILE) {
            let kn = (block.end - k0).min(LANE_KEY_TILE);
            let kpos = &kpos_all[k0..k0 + kn];
            let tile = &mut s[..kn * lanes];
            ops::gemm(
                isa,
                &MatMul { m: kn, k: dp, n: lanes, a: &kb[k0 * dp..], lda: dp, b: qt, ldb: lanes },
                tile,
                lanes,
                false,
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
            ops::softmax_lanes(isa, tile, kn, lanes, LAZY_MAX, &mut LaneState { m, l, o: ot, dp });
            // Oᵀ += Vᵀ Pᵀ: the packed value rows read in place as a column-major A.
            ops::product::<true>(
                isa,
                &MatMul { m: dp, k: kn, n: lanes, a: &vb[k0 * dp..], lda: dp, b: tile, ldb: lanes },
                ot,
                lanes,
                true,
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
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;
    use crate::rows::PieceRows;

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

    /// The lane kernel equals the row kernel (`tile_forward`'s own path, run on the same
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
                assert!(forward_piece(
                    PieceSpec { isa, scale, d, band },
                    &Piece { q: &q, k: &k, v: &v },
                    &mut ws,
                    &mut o1,
                    &mut l1
                ));
                crate::tile_forward::forward_piece_rows(
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
        assert!(!forward_piece(
            PieceSpec { isa, scale: 0.25, d, band: Band::CAUSAL },
            &Piece { q: &rows(&qd), k: &rows(&kd), v: &rows(&vd) },
            &mut ws,
            &mut o,
            &mut l
        ));
        assert!(o.iter().chain(&l).all(|&x| x == 7.0), "nothing written");
        assert!(forward_piece(
            PieceSpec { isa, scale: 0.25, d, band: Band::FULL },
            &Piece { q: &rows(&qd), k: &rows(&kd), v: &rows(&vd) },
            &mut ws,
            &mut o,
            &mut l
        ));
    }
}
