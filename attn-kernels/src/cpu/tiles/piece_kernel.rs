//! The forward kernel of one piece, chosen once per piece as a value ([`PieceKernel`])
//! and run by one match: bf16 pairs, queries in SIMD lanes, or one query per score row.

use attn_core::Element;

use crate::cpu::isa::Isa;
use crate::cpu::isa::ops::{self, PairEngine};
use crate::cpu::isa::rows::{Piece, PieceSpec};
use crate::cpu::tiles::forward_scratch::ForwardScratch;
use crate::cpu::tiles::{lane_forward, tile_forward};

/// The kernel that runs a piece's forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PieceKernel {
    /// `q·kᵀ` and `p·v` on bf16 pairs on this engine (`bf16_pairs`, through `ops`).
    Pairs(PairEngine),
    /// Queries in SIMD lanes (`lane_forward`).
    Lanes,
    /// One query per score row (`tile_forward`): the portable path, and every piece the
    /// others refuse.
    Rows,
}

impl PieceKernel {
    /// The kernel for `piece`: the bf16 pairs where the flavour has an engine and the
    /// engine takes the piece (bf16, finite), else the lanes where the flavour has them
    /// and they take the piece (finite values under a band that masks pairs), else rows.
    pub(crate) fn choose<T: Element>(spec: PieceSpec, piece: &Piece<'_, '_, T>) -> PieceKernel {
        match ops::pair_engine(spec.isa) {
            Some(engine) if ops::pair_takes(engine, spec, piece) => PieceKernel::Pairs(engine),
            _ if lanes_first(spec.isa) && lane_forward::takes(spec, piece) => PieceKernel::Lanes,
            _ => PieceKernel::Rows,
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
    match PieceKernel::choose(spec, piece) {
        PieceKernel::Pairs(engine) => ops::pair_forward_piece(engine, spec, piece, &mut ws.pairs, out, lse),
        PieceKernel::Lanes => lane_forward::forward_piece(spec, piece, ws, out, lse),
        PieceKernel::Rows => tile_forward::forward_piece_rows(spec, piece, ws, out, lse),
    }
}

/// Whether the lane kernel runs first on this flavour (measured faster there).
fn lanes_first(isa: Isa) -> bool {
    matches!(isa, Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx | Isa::Avx2)
}

#[cfg(test)]
mod tests {
    use attn_core::Band;

    use super::*;
    use crate::cpu::isa::rows::PieceRows;
    use crate::cpu::tiles::lane_forward::takes as lane_takes;

    /// `n` values in [-2, 2), different for each `seed`.
    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 + seed * 104_729) % 1000) as f32 / 250.0 - 2.0).collect()
    }

    /// Causal with a non-finite value: the lane kernel refuses the piece and the choice
    /// is the row kernel; under the full band the lanes take it.
    #[test]
    fn causal_poisoned_values_go_to_the_row_kernel() {
        let d = 16;
        let (qd, kd, mut vd) = (values(32 * d, 4), values(32 * d, 5), values(32 * d, 6));
        vd[7 * d] = f32::INFINITY;
        let off: Vec<usize> = (0..32).map(|i| i * d).collect();
        let pos: Vec<usize> = (0..32).collect();
        let rows = |x| PieceRows { data: x, offsets: &off, pos: &pos };
        let (q, k, v) = (rows(&qd), rows(&kd), rows(&vd));
        let piece = Piece { q: &q, k: &k, v: &v };
        let isa = Isa::detect();
        let causal = PieceSpec { isa, scale: 0.25, d, band: Band::CAUSAL };
        let full = PieceSpec { band: Band::FULL, ..causal };
        assert!(!lane_takes(causal, &piece));
        assert!(lane_takes(full, &piece));
        assert_eq!(PieceKernel::choose(causal, &piece), PieceKernel::Rows);
        let lanes = matches!(isa, Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx | Isa::Avx2);
        let want = if lanes { PieceKernel::Lanes } else { PieceKernel::Rows };
        assert_eq!(PieceKernel::choose(full, &piece), want);
    }

    /// A finite bf16 piece goes to the bf16 pairs where the flavour has an engine; one
    /// non-finite key the piece packs sends it to the lanes (a key no query sees does not).
    #[test]
    fn bf16_pieces_go_to_the_pairs_only_when_finite() {
        use half::bf16;
        let isa = Isa::Avx512Bf16;
        if !isa.is_supported() {
            println!("skipped: no AVX512-BF16");
            return;
        }
        let d = 16;
        let data = |seed| values(32 * d, seed).into_iter().map(bf16::from_f32).collect::<Vec<_>>();
        let (qd, mut kd, vd) = (data(1), data(2), data(3));
        let off: Vec<usize> = (0..32).map(|i| i * d).collect();
        let pos: Vec<usize> = (0..32).collect();
        // Queries 0..16 see keys 0..16 under the causal band.
        let qpos: Vec<usize> = (0..16).collect();
        let spec = PieceSpec { isa, scale: 0.25, d, band: Band::CAUSAL };
        let choose = |kd: &[bf16]| {
            let q = PieceRows { data: &qd, offsets: &off[..16], pos: &qpos };
            let (k, v) =
                (PieceRows { data: kd, offsets: &off, pos: &pos }, PieceRows { data: &vd, offsets: &off, pos: &pos });
            PieceKernel::choose(spec, &Piece { q: &q, k: &k, v: &v })
        };
        assert!(matches!(choose(&kd), PieceKernel::Pairs(_)));
        kd[20 * d] = bf16::NAN;
        assert!(matches!(choose(&kd), PieceKernel::Pairs(_)), "key 20 is outside every query's band");
        kd[3 * d + 1] = bf16::INFINITY;
        assert_eq!(choose(&kd), PieceKernel::Lanes);
    }
}
