//! The forward of one piece: its kernel chosen once, as a value ([`ForwardKernel`]),
//! from the flavour and what packing the piece found, then run on the flavour's
//! vectors (the one dispatch on the instruction set). Choosing packs what it reads (the
//! bf16 pairs, or the f32 value tiles both f32 kernels share), so the kernel that runs
//! reads nothing twice.

use attn_core::{Band, Element};

use crate::cpu::isa::Isa;
use crate::cpu::isa::ops::with_vectors;
use crate::cpu::isa::ops::{PairPacked, pair_pack, pair_run};
use crate::cpu::isa::rows::{Piece, PieceSpec};
use crate::cpu::tiles::forward_scratch::ForwardScratch;
use crate::cpu::tiles::lane_forward;
use crate::cpu::tiles::tile_forward::{forward_piece_rows, pack_values};

/// The kernel a piece's forward runs.
#[derive(Debug)]
pub(crate) enum ForwardKernel {
    /// bf16 pair products (AMX or AVX512-BF16) on the pairs packed in the scratch.
    Pairs(PairPacked),
    /// Queries in SIMD lanes (`lane_forward`), on the packed value tiles.
    Lanes,
    /// One query per score row (`tile_forward`), on the packed value tiles.
    Rows,
}

impl ForwardKernel {
    /// The kernel for the piece, packing into `ws` what it will read: the bf16 pairs
    /// where the flavour has a pair engine and the piece qualifies, else the f32 value
    /// tiles; then the lane kernel where the flavour runs it faster (measured) and every
    /// weight it forms is one the row kernel forms too (no masked pair, or all values
    /// finite), else the row kernel.
    pub(crate) fn choose<T: Element>(spec: PieceSpec, piece: &Piece<'_, '_, T>, ws: &mut ForwardScratch) -> Self {
        if let Some(packed) = pair_pack(spec, piece, &mut ws.pairs) {
            return ForwardKernel::Pairs(packed);
        }
        let finite = pack_values(spec, piece, ws);
        let lanes_first = matches!(spec.isa, Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx | Isa::Avx2);
        if lanes_first && (spec.band == Band::FULL || finite) { ForwardKernel::Lanes } else { ForwardKernel::Rows }
    }

    /// Runs this kernel on the piece [`ForwardKernel::choose`] packed into `ws`.
    pub(crate) fn run<T: Element>(
        &self,
        spec: PieceSpec,
        piece: &Piece<'_, '_, T>,
        ws: &mut ForwardScratch,
        out: &mut [f32],
        lse: &mut [f32],
    ) {
        match self {
            ForwardKernel::Pairs(packed) => pair_run(packed, spec, piece, &mut ws.pairs, out, lse),
            ForwardKernel::Lanes => {
                with_vectors!(spec.isa, |s| lane_forward::forward_piece(s, spec, piece, ws, out, lse))
            }
            ForwardKernel::Rows => with_vectors!(spec.isa, |s| forward_piece_rows(s, spec, piece, ws, out, lse)),
        }
    }
}

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
    ForwardKernel::choose(spec, piece, ws).run(spec, piece, ws, out, lse)
}

#[cfg(test)]
mod tests {
    //! The lane kernel (`lane_forward`) against the row kernel (`tile_forward`), and
    //! the choice between them.
    use super::*;
    use crate::cpu::isa::rows::PieceRows;

    /// `kernel` on the piece, its values packed first.
    fn on(kernel: ForwardKernel, spec: PieceSpec, piece: &Piece<'_, '_, f32>, o: &mut [f32], l: &mut [f32]) {
        let mut ws = ForwardScratch::default();
        pack_values(spec, piece, &mut ws);
        kernel.run(spec, piece, &mut ws, o, l)
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
                let (spec, piece) = (PieceSpec { isa, scale, d, band }, Piece { q: &q, k: &k, v: &v });
                on(ForwardKernel::Lanes, spec, &piece, &mut o1, &mut l1);
                on(ForwardKernel::Rows, spec, &piece, &mut o2, &mut l2);
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

    /// Causal with a non-finite value: the row kernel is chosen, and the queries before
    /// the poisoned key stay finite (the lane kernel's shared value product would spread
    /// `0 * Inf = NaN` to them); with no masked pair the lane kernel is chosen.
    #[test]
    fn causal_poisoned_values_choose_the_row_kernel() {
        let d = 16;
        let (qd, kd, mut vd) = (values(32 * d, 4), values(32 * d, 5), values(32 * d, 6));
        vd[7 * d] = f32::INFINITY;
        let off: Vec<usize> = (0..32).map(|i| i * d).collect();
        let pos: Vec<usize> = (0..32).collect();
        let rows = |x| PieceRows { data: x, offsets: &off, pos: &pos };
        let (q, k, v) = (rows(&qd), rows(&kd), rows(&vd));
        let piece = Piece { q: &q, k: &k, v: &v };
        let lane_flavours = [Isa::Avx512, Isa::Avx2];
        for isa in attn_testkit::isa_policy::runnable("poisoned_choice", lane_flavours, Isa::as_str, Isa::is_supported)
        {
            let mut ws = ForwardScratch::default();
            let spec = PieceSpec { isa, scale: 0.25, d, band: Band::CAUSAL };
            let kernel = ForwardKernel::choose(spec, &piece, &mut ws);
            assert!(matches!(kernel, ForwardKernel::Rows), "{isa:?}: {kernel:?}");
            let (mut o, mut l) = (vec![7.0; 32 * d], vec![7.0; 32]);
            kernel.run(spec, &piece, &mut ws, &mut o, &mut l);
            assert!(o[..7 * d].iter().chain(&l[..7]).all(|x| x.is_finite()), "{isa:?}: rows before key 7");
            let full = PieceSpec { band: Band::FULL, ..spec };
            let kernel = ForwardKernel::choose(full, &piece, &mut ws);
            assert!(matches!(kernel, ForwardKernel::Lanes), "{isa:?}: {kernel:?}");
        }
    }
}
