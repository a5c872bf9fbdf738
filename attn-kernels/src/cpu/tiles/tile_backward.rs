//! Flash-style backward of one piece, recomputing scores from the final LSE (no
//! `n x n` storage). Two deterministic kernels: [`dq_piece`] walks key tiles for a set
//! of queries, [`dkv_piece`] walks query tiles for a set of keys, so every gradient row
//! is owned by one caller and accumulated in a fixed order; both run the same step on a
//! row group and a tile ([`tile_step`]), with the roles of queries and keys swapped.

use attn_core::Element;

use crate::cpu::isa::kernels::{self, ds_row, exp2_sub, gemm_ranges};
use crate::cpu::isa::mat::{Accumulate, MatMul};
use crate::cpu::isa::ops::with_vectors;
use crate::cpu::isa::ops::{KEY_TILE, QUERY_CHUNK, ROW_BLOCK, padded, scratch};
use crate::cpu::isa::simd::Simd;

/// Rows whose products against one tile run together: several register blocks, so each
/// 16-column panel of the tile is reused from L1 by all of them (as in the forward).
const ROW_GROUP: usize = 4 * ROW_BLOCK;
/// Rows per query chunk (dq) or key chunk (dk, dv): whole register blocks, so no
/// latency-bound 2-row block in the middle of a piece (buffers stay `QUERY_CHUNK` wide).
const CHUNK: usize = QUERY_CHUNK / ROW_BLOCK * ROW_BLOCK;
use crate::cpu::isa::rows::{Piece, PieceRows, PieceSpec, key_span, query_span};
use crate::cpu::tiles::f32_tiles::{pack_rows, pack_transposed};

/// Per-query inputs of the backward: upstream gradient rows (multiplied by `go_scale`
/// on load, i.e. `grad_out_eff = out_scale * grad_out`), the head's final LSE (natural
/// log) and `delta = dot(grad_out, out) - grad_lse`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QueryGrads<'a, G> {
    pub go: PieceRows<'a, G>,
    pub go_scale: f32,
    pub lse: &'a [f32],
    pub delta: &'a [f32],
}

/// Reusable buffers of the backward kernels (one per worker).
#[derive(Debug, Default)]
pub(crate) struct BackwardScratch {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    e: Vec<f32>,
    f: Vec<f32>,
    acc1: Vec<f32>,
    acc2: Vec<f32>,
    s: Vec<f32>,
    dp: Vec<f32>,
    sub: Vec<f32>,
}

/// LSE in base 2, with "no keys" (`-inf`) turned into `+inf` so that `exp2(s - sub) = 0`.
#[inline]
fn lse2(l: f32) -> f32 {
    if l == f32::NEG_INFINITY { f32::INFINITY } else { l * std::f32::consts::LOG2_E }
}

/// The softmax statistics a tile step's scores need.
#[derive(Debug, Clone, Copy)]
enum Stats<'a> {
    /// Rows are queries (dq): row `i` has the natural-log LSE `lse[i]` and `delta[i]`.
    PerRow { lse: &'a [f32], delta: &'a [f32] },
    /// Rows are keys (dk, dv) and columns the tile's first `delta.len()` queries: column
    /// `j` has the base-2 LSE `sub[j]` (see [`lse2`]) and `delta[j]`.
    PerColumn { sub: &'a [f32], delta: &'a [f32] },
}

/// A tile step's operands: rows of `a` against the transposed tile `bt` give the scores
/// (base 2), rows of `c` against the transposed tile `dt` give `dP`; rows have stride
/// `dp`, tiles `KEY_TILE`.
#[derive(Debug, Clone, Copy)]
struct TileOperands<'a> {
    a: &'a [f32],
    bt: &'a [f32],
    c: &'a [f32],
    dt: &'a [f32],
}

/// One step of the dq and the dk/dv tile loops (their shared body): for `rn` rows
/// against one tile, the probabilities `P` into `p` and `dS = P * (dP - delta)` into
/// `ds` (rows `KEY_TILE` wide); row `i`'s entries outside `visible(i)` are masked
/// (weight exactly 0, so a NaN/Inf behind a mask never reaches a gradient). Returns
/// each row's visible range, for products that read only those.
fn tile_step<S: Simd>(
    s: S,
    (rn, dp): (usize, usize),
    x: TileOperands<'_>,
    stats: Stats<'_>,
    visible: impl Fn(usize) -> std::ops::Range<usize>,
    p: &mut [f32],
    ds: &mut [f32],
) -> [(usize, usize); ROW_GROUP] {
    let scores = MatMul { m: rn, k: dp, n: KEY_TILE, a: x.a, lda: dp, b: x.bt, ldb: KEY_TILE };
    kernels::gemm::<S, false>(s, &scores, p, KEY_TILE, Accumulate::Overwrite);
    let grads = MatMul { m: rn, k: dp, n: KEY_TILE, a: x.c, lda: dp, b: x.dt, ldb: KEY_TILE };
    kernels::gemm::<S, false>(s, &grads, ds, KEY_TILE, Accumulate::Overwrite);
    let mut ranges = [(0, 0); ROW_GROUP];
    for (i, range) in ranges.iter_mut().enumerate().take(rn) {
        let row = &mut p[i * KEY_TILE..(i + 1) * KEY_TILE];
        let vis = visible(i);
        *range = (vis.start, vis.end);
        row[vis.end..].fill(f32::NEG_INFINITY);
        row[..vis.start].fill(f32::NEG_INFINITY);
        let dsrow = &mut ds[i * KEY_TILE..(i + 1) * KEY_TILE];
        match stats {
            Stats::PerRow { lse, delta } => {
                exp2_sub(s, row, lse2(lse[i]), None);
                ds_row(s, row, dsrow, None, delta[i]);
            }
            Stats::PerColumn { sub, delta } => {
                exp2_sub(s, row, 0.0, Some(sub));
                ds_row(s, row, &mut dsrow[..delta.len()], Some(delta), 0.0);
            }
        }
    }
    ranges
}

/// `dq[i*d..] += scale * sum_j dS_ij k_j` for the piece's queries (all keys of the piece).
pub(crate) fn dq_piece<T: Element, G: Element>(
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    g: &QueryGrads<'_, G>,
    ws: &mut BackwardScratch,
    dq: &mut [f32],
) {
    with_vectors!(spec.isa, |s| dq_piece_on(s, spec, piece, g, ws, dq))
}

/// [`dq_piece`] on the vectors `s`.
fn dq_piece_on<S: Simd, T: Element, G: Element>(
    s: S,
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    g: &QueryGrads<'_, G>,
    ws: &mut BackwardScratch,
    dq: &mut [f32],
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
    let tile = dp * KEY_TILE;
    let kt = scratch(&mut ws.a, tiles * tile);
    let vt = scratch(&mut ws.b, tiles * tile);
    let kr = scratch(&mut ws.c, tiles * tile);
    for t in 0..tiles {
        let (k0, kn) = (k_lo + t * KEY_TILE, (nk - t * KEY_TILE).min(KEY_TILE));
        pack_transposed(k, k0..k0 + kn, d, dp, KEY_TILE, 1.0, &mut kt[t * tile..]);
        pack_transposed(v, k0..k0 + kn, d, dp, KEY_TILE, 1.0, &mut vt[t * tile..]);
        pack_rows(k, k0, kn, d, dp, 1.0, &mut kr[t * tile..]);
    }
    let c2 = scale * std::f32::consts::LOG2_E;
    for q0 in (0..nq).step_by(CHUNK) {
        let qn = (nq - q0).min(CHUNK);
        let qbuf = scratch(&mut ws.e, qn * dp);
        pack_rows(q, q0, qn, d, dp, c2, qbuf);
        let gbuf = scratch(&mut ws.f, qn * dp);
        pack_rows(&g.go, q0, qn, d, dp, g.go_scale, gbuf);
        let acc = scratch(&mut ws.acc1, qn * dp);
        acc.fill(0.0);
        let sc = scratch(&mut ws.s, ROW_GROUP * KEY_TILE);
        let dpb = scratch(&mut ws.dp, ROW_GROUP * KEY_TILE);
        let qpos = &q.pos[q0..q0 + qn];
        for t in 0..tiles {
            let (k0, kn) = (k_lo + t * KEY_TILE, (nk - t * KEY_TILE).min(KEY_TILE));
            let kpos = &k.pos[k0..k0 + kn];
            if kpos[0] > qpos[qn - 1].saturating_add(band.right) {
                break; // this and later tiles come after every key the chunk sees
            }
            for r0 in (0..qn).step_by(ROW_GROUP) {
                let rn = (qn - r0).min(ROW_GROUP);
                if key_span(kpos, band, qpos[r0], qpos[r0 + rn - 1]).is_empty() {
                    continue; // no row of this block sees a key of this tile
                }
                let operands =
                    TileOperands { a: &qbuf[r0 * dp..], bt: &kt[t * tile..], c: &gbuf[r0 * dp..], dt: &vt[t * tile..] };
                let stats = Stats::PerRow { lse: &g.lse[q0 + r0..], delta: &g.delta[q0 + r0..] };
                let visible = |i: usize| band.visible(kpos, qpos[r0 + i]);
                let ranges = tile_step(s, (rn, dp), operands, stats, visible, sc, dpb);
                // dQ += dS K over each row's visible keys.
                gemm_ranges::<S, false>(
                    s,
                    &ranges[..rn],
                    (dpb, KEY_TILE),
                    (&kr[t * tile..], dp),
                    dp,
                    &mut acc[r0 * dp..],
                    dp,
                );
            }
        }
        for i in 0..qn {
            let dst = &mut dq[(q0 + i) * d..(q0 + i + 1) * d];
            dst.iter_mut().zip(&acc[i * dp..]).for_each(|(a, b)| *a += scale * b);
        }
    }
}

/// `dk[j*d..] += scale * sum_i dS_ij q_i` and `dv[j*d..] += sum_i P_ij go_i` for the
/// piece's keys (all queries of the piece). With `dq`, also `dq[i*d..] += scale * sum_j
/// dS_ij k_j` for the piece's queries (fused backward: valid when the caller owns all
/// keys the queries see, i.e. the piece is a whole segment of a single-pattern head).
pub(crate) fn dkv_piece<T: Element, G: Element>(
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    g: &QueryGrads<'_, G>,
    ws: &mut BackwardScratch,
    dk: &mut [f32],
    dv: &mut [f32],
    dq: Option<&mut [f32]>,
) {
    with_vectors!(spec.isa, |s| dkv_piece_on(s, spec, piece, g, ws, [dk, dv], dq))
}

/// [`dkv_piece`] on the vectors `s`.
fn dkv_piece_on<S: Simd, T: Element, G: Element>(
    s: S,
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    g: &QueryGrads<'_, G>,
    ws: &mut BackwardScratch,
    [dk, dv]: [&mut [f32]; 2],
    dq: Option<&mut [f32]>,
) {
    let PieceSpec { scale, d, band, .. } = spec;
    let Piece { q, k, v } = *piece;
    let (nk, dp) = (k.len(), padded(d));
    if nk == 0 {
        return;
    }
    // Queries that can see some key of the piece (causal: those at or after the first key).
    let span = query_span(q.pos, band, k.pos[0], k.pos[nk - 1]);
    let (first_q, nq) = (span.start, span.len());
    let tiles = nq.div_ceil(KEY_TILE);
    let tile = dp * KEY_TILE;
    let c2 = scale * std::f32::consts::LOG2_E;
    // Query tiles: Q^T (scaled to base-2 scores), GO^T, Q rows, GO rows, LSE, delta.
    let qt = scratch(&mut ws.a, tiles * tile);
    let gt = scratch(&mut ws.b, tiles * tile);
    let qr = scratch(&mut ws.c, tiles * tile);
    let gr = scratch(&mut ws.e, tiles * tile);
    let sub = scratch(&mut ws.sub, tiles * KEY_TILE);
    sub.fill(f32::INFINITY);
    for t in 0..tiles {
        let (i0, n) = (first_q + t * KEY_TILE, (nq - t * KEY_TILE).min(KEY_TILE));
        pack_transposed(q, i0..i0 + n, d, dp, KEY_TILE, c2, &mut qt[t * tile..]);
        pack_transposed(&g.go, i0..i0 + n, d, dp, KEY_TILE, g.go_scale, &mut gt[t * tile..]);
        pack_rows(q, i0, n, d, dp, 1.0, &mut qr[t * tile..]);
        pack_rows(&g.go, i0, n, d, dp, g.go_scale, &mut gr[t * tile..]);
        for j in 0..n {
            sub[t * KEY_TILE + j] = lse2(g.lse[i0 + j]);
        }
    }
    let sc = scratch(&mut ws.s, ROW_GROUP * KEY_TILE);
    // dS^T of a whole key chunk x query tile (rows are keys).
    let ds_all = scratch(&mut ws.dp, QUERY_CHUNK * KEY_TILE);
    let dq_acc = scratch(&mut ws.acc2, if dq.is_some() { nq * dp } else { 0 });
    let mut q_ranges = [(0, 0); KEY_TILE];
    dq_acc.fill(0.0);
    for k0 in (0..nk).step_by(CHUNK) {
        let kn = (nk - k0).min(CHUNK);
        let kbuf = scratch(&mut ws.f, 2 * kn * dp);
        let (kbuf, vbuf) = kbuf.split_at_mut(kn * dp);
        pack_rows(k, k0, kn, d, dp, 1.0, kbuf);
        pack_rows(v, k0, kn, d, dp, 1.0, vbuf);
        let acc = scratch(&mut ws.acc1, 2 * kn * dp);
        acc.fill(0.0);
        let (dk_acc, dv_acc) = acc.split_at_mut(kn * dp);
        let kpos = &k.pos[k0..k0 + kn];
        for t in 0..tiles {
            let (i0, n) = (first_q + t * KEY_TILE, (nq - t * KEY_TILE).min(KEY_TILE));
            let qpos = &q.pos[i0..i0 + n];
            if query_span(qpos, band, kpos[0], kpos[kn - 1]).is_empty() {
                continue; // no query of this tile sees a key of this chunk
            }
            let mut rows_done = 0;
            for r0 in (0..kn).step_by(ROW_GROUP) {
                let rn = (kn - r0).min(ROW_GROUP);
                if qpos[n - 1].saturating_add(band.right) < kpos[r0] {
                    break; // this and later key rows come after every query of the tile
                }
                rows_done = r0 + rn;
                let dpb = &mut ds_all[r0 * KEY_TILE..(r0 + rn) * KEY_TILE];
                let operands =
                    TileOperands { a: &kbuf[r0 * dp..], bt: &qt[t * tile..], c: &vbuf[r0 * dp..], dt: &gt[t * tile..] };
                let stats =
                    Stats::PerColumn { sub: &sub[t * KEY_TILE..(t + 1) * KEY_TILE], delta: &g.delta[i0..i0 + n] };
                let seen = |i: usize| band.seen_by(qpos, kpos[r0 + i]);
                let ranges = tile_step(s, (rn, dp), operands, stats, seen, sc, dpb);
                // dV += P^T GO, dK += dS^T Q (rows here are keys), each key row over the
                // queries that see it only.
                let rg = &ranges[..rn];
                gemm_ranges::<S, false>(s, rg, (sc, KEY_TILE), (&gr[t * tile..], dp), dp, &mut dv_acc[r0 * dp..], dp);
                gemm_ranges::<S, false>(s, rg, (dpb, KEY_TILE), (&qr[t * tile..], dp), dp, &mut dk_acc[r0 * dp..], dp);
            }
            if dq.is_some() && rows_done > 0 {
                // dQ[tile] += dS (queries x keys) * K[chunk], one product of depth `rows_done`.
                // Query j reads only the keys it sees.
                for (j, r) in q_ranges[..n].iter_mut().enumerate() {
                    let visible = band.visible(&kpos[..rows_done], qpos[j]);
                    *r = (visible.start, visible.end);
                }
                let c = &mut dq_acc[t * KEY_TILE * dp..];
                // dS^T read in place (its rows are keys): no transposed copy.
                gemm_ranges::<S, true>(s, &q_ranges[..n], (ds_all, KEY_TILE), (kbuf, dp), dp, c, dp);
            }
        }
        for j in 0..kn {
            let (dkr, dvr) = (&mut dk[(k0 + j) * d..(k0 + j + 1) * d], &mut dv[(k0 + j) * d..(k0 + j + 1) * d]);
            dkr.iter_mut().zip(&dk_acc[j * dp..]).for_each(|(a, b)| *a += scale * b);
            dvr.iter_mut().zip(&dv_acc[j * dp..]).for_each(|(a, b)| *a += b);
        }
    }
    if let Some(dq) = dq {
        for i in 0..nq {
            let dst = &mut dq[(first_q + i) * d..(first_q + i + 1) * d];
            dst.iter_mut().zip(&dq_acc[i * dp..]).for_each(|(a, b)| *a += scale * b);
        }
    }
}
