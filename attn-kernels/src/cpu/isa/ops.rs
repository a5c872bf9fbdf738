//! The dispatch module: the one `match` on the instruction set, made where a piece
//! starts ([`with_vectors!`] on [`Isa::vectors`]: the token of `portable`, `avx2` or
//! `avx512` the piece's kernels are monomorphised for), and what the tile loops use
//! besides the primitives of `kernels`: the scalar `exp2`, row conversion and prefetch
//! and the score-bound scan (`row_io`), the bf16 pair forward of a piece and its engine
//! for a flavour (`bf16_pairs`), the tile sizes, and scratch sizing.

use attn_core::Element;

use super::{bf16_pairs, kernels, row_io};
use crate::cpu::isa::Isa;
use crate::cpu::isa::bf16_pairs::Engine;
use crate::cpu::isa::portable::Portable;
use crate::cpu::isa::rows::{Piece, PieceSpec};
#[cfg(target_arch = "x86_64")]
use crate::cpu::isa::{avx2::Avx2, avx512::Avx512};

/// The token of the instruction set a piece's f32 kernels run on.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Vectors {
    Portable(Portable),
    #[cfg(target_arch = "x86_64")]
    Avx2(Avx2),
    #[cfg(target_arch = "x86_64")]
    Avx512(Avx512),
}

impl Isa {
    /// The vectors this flavour's f32 kernels use (the bf16 flavours run them on
    /// AVX-512), or portable ones where the CPU lacks the instruction set.
    pub(crate) fn vectors(self) -> Vectors {
        #[cfg(target_arch = "x86_64")]
        match self {
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => {
                if let Some(s) = Avx512::new() {
                    return Vectors::Avx512(s);
                }
            }
            Isa::Avx2 => {
                if let Some(s) = Avx2::new() {
                    return Vectors::Avx2(s);
                }
            }
            Isa::Portable => {}
        }
        let _ = self;
        Vectors::Portable(Portable)
    }
}

/// `$body` with `$s` bound to the token of `$isa`'s vectors: the one `match` on the
/// instruction set, made where a piece starts; `$body` is monomorphised per set.
macro_rules! with_vectors {
    ($isa:expr, |$s:ident| $body:expr) => {
        match $isa.vectors() {
            $crate::cpu::isa::ops::Vectors::Portable($s) => $body,
            #[cfg(target_arch = "x86_64")]
            $crate::cpu::isa::ops::Vectors::Avx2($s) => $body,
            #[cfg(target_arch = "x86_64")]
            $crate::cpu::isa::ops::Vectors::Avx512($s) => $body,
        }
    };
}
pub(crate) use with_vectors;

/// The bf16 pair forward's per-thread scratch.
pub(crate) type PairScratch = bf16_pairs::PairScratch;

/// `2^x` (scalar).
#[inline]
pub(crate) fn exp2(x: f32) -> f32 {
    kernels::exp2_scalar(x)
}

/// `out[e] = mul * row[e]` with F16C for f16 rows where the CPU has it; false (nothing
/// converted) where this path does not apply.
#[inline]
pub(crate) fn f16_row_to_f32<T: Element>(row: &[T], mul: f32, out: &mut [f32]) -> bool {
    row_io::f16_row_to_f32(row, mul, out)
}

/// Prefetch the cache lines of `row` (a hint; nothing on other architectures).
#[inline]
pub(crate) fn prefetch_row<T>(row: &[T]) {
    row_io::prefetch_row(row)
}

/// The score-bound scan of one row (see `score_bound`): AVX2 where the CPU has it.
#[inline]
pub(crate) fn fold_row<T: Element>(row: &[T], abs_mask: i32, inf: i32, acc: &mut [i32; 16], acc16: &mut [i16; 32]) {
    row_io::fold_row(row, abs_mask, inf, acc, acc16)
}

/// The bf16 pair engine `isa` runs the bf16 forward on, if any.
#[inline]
pub(crate) fn pair_engine(isa: Isa) -> Option<Engine> {
    match isa {
        Isa::Amx => Some(Engine::Tiles),
        Isa::Avx512Bf16 => Some(Engine::Dot),
        _ => None,
    }
}

/// A piece packed for the bf16 pair forward (see [`pair_pack`]).
pub(crate) type PairPacked = bf16_pairs::Packed;

/// The piece packed for the bf16 pair forward on its flavour's engine, or `None` where
/// that forward does not apply and the f32 kernel must run the piece (see `bf16_pairs`).
#[inline]
pub(crate) fn pair_pack<T: Element>(
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    ws: &mut PairScratch,
) -> Option<PairPacked> {
    pair_engine(spec.isa).and_then(|e| bf16_pairs::pack(e, spec, piece, ws))
}

/// The bf16 pair forward of a piece [`pair_pack`] packed.
#[inline]
pub(crate) fn pair_run<T: Element>(
    packed: &PairPacked,
    spec: PieceSpec,
    piece: &Piece<'_, '_, T>,
    ws: &mut PairScratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    bf16_pairs::run(packed, spec, piece, ws, out, lse)
}

/// Bytes of the bf16 pair forward's scratch on `isa` for head dim `d` and `m` keys.
pub(crate) fn pair_scratch_bytes(isa: Isa, d: usize, m: usize) -> u128 {
    if pair_engine(isa).is_some() { bf16_pairs::scratch_bytes(d, m) } else { 0 }
}

/// Keys per tile of the backward kernel.
pub(crate) const KEY_TILE: usize = 64;
/// Keys per tile of the f32 forward kernel: wider than the backward's, so each row's
/// softmax step (max, rescale, horizontal sums) is paid once per 128 keys. Measured
/// on AVX2 (seq 8192, one thread): 64 keys 330 ms, 128 keys 312 ms, 256 keys 320 ms;
/// the backward is faster with 64 (1,180 against 1,320 ms forward + backward).
pub(crate) const FORWARD_KEY_TILE: usize = 128;
pub(crate) use kernels::ROW_BLOCK;
/// Query rows whose accumulators are kept together (cache blocking).
pub(crate) const QUERY_CHUNK: usize = 128;
/// Query rows of one forward chunk: whole row blocks (a short block runs the
/// micro-kernel at a fraction of its rate, so only a piece's last chunk has one), and
/// twice the backward's, so each packed key tile is fetched from L3 half as often
/// (seq 65536, 2 threads: 132-134 GFLOP/s with 126 rows, 136-137 with 252).
pub(crate) const FORWARD_QUERY_CHUNK: usize = 2 * QUERY_CHUNK / ROW_BLOCK * ROW_BLOCK;

/// `head_dim` rounded up to the SIMD width.
#[inline]
pub(crate) fn padded(d: usize) -> usize {
    d.next_multiple_of(16)
}

/// Resize a scratch vector (contents unspecified) without shrinking its capacity.
#[inline]
pub(crate) fn scratch(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa::kernels::gemm;
    use crate::cpu::isa::mat::{Accumulate, MatMul};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / 16_777_216.0 - 0.5)
            .collect()
    }

    /// On every kernel flavour this CPU runs, the column-major product equals the
    /// row-major one on an explicit transpose bit for bit (the same multiply-adds in the
    /// same order), ragged row blocks and column panels included.
    #[test]
    fn column_major_product_equals_product_on_the_transpose() {
        for isa in attn_testkit::isa_policy::runnable("column_major_product", Isa::ALL, Isa::as_str, Isa::is_supported)
        {
            let (over, add) = (Accumulate::Overwrite, Accumulate::Add);
            for (m, k, n, acc) in [(1, 1, 16, over), (5, 7, 48, add), (13, 64, 64, over), (64, 130, 80, add)] {
                let (lda, ldb, ldc) = (m + 3, n + 16, n + 32);
                let a_cols = values(k * lda, 1);
                let mut a_rows = vec![0.0; m * k];
                for r in 0..m {
                    for kk in 0..k {
                        a_rows[r * k + kk] = a_cols[kk * lda + r];
                    }
                }
                let b = values(k * ldb, 2);
                let c0 = values(m * ldc, 3);
                let (mut want, mut got) = (c0.clone(), c0);
                with_vectors!(isa, |s| {
                    gemm::<_, false>(s, &MatMul { m, k, n, a: &a_rows, lda: k, b: &b, ldb }, &mut want, ldc, acc);
                    gemm::<_, true>(s, &MatMul { m, k, n, a: &a_cols, lda, b: &b, ldb }, &mut got, ldc, acc);
                });
                assert_eq!(got, want, "{isa:?} m={m} k={k} n={n}");
            }
        }
    }

    /// On every kernel flavour this CPU runs, `exp2_sub`, `max` and `ds_row` equal
    /// their scalar definitions at every length up to 40 (whole vectors and every
    /// partial tail): `-inf` gives weight 0, and `ds_row` is exactly 0 where `p == 0`
    /// whatever `dp` holds (NaN here) and exactly `p * (dp - delta)` elsewhere.
    #[test]
    fn row_primitives_equal_their_scalar_definitions() {
        let flavours = [Isa::Avx512, Isa::Avx2, Isa::Portable];
        for isa in attn_testkit::isa_policy::runnable("row_primitives", flavours, Isa::as_str, Isa::is_supported) {
            for len in 0..=40 {
                let x: Vec<f32> = values(len, 7)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| if i % 11 == 3 { f32::NEG_INFINITY } else { v * 16.0 })
                    .collect();
                let sv = values(len, 9);
                let mut got = x.clone();
                let sum = with_vectors!(isa, |s| kernels::exp2_sub(s, &mut got, 0.5, Some(&sv)));
                let want: Vec<f32> = x.iter().zip(&sv).map(|(x, t)| kernels::exp2_scalar(x - 0.5 - t)).collect();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!((g - w).abs() <= 1e-6 * w, "{isa:?} len {len}: exp2 {i}: {g} {w}");
                }
                let want_sum: f32 = want.iter().sum();
                assert!((sum - want_sum).abs() <= 1e-5 * want_sum, "{isa:?} len {len}: sum {sum} {want_sum}");
                let m = with_vectors!(isa, |s| kernels::max(s, &x));
                assert_eq!(m, x.iter().copied().fold(f32::NEG_INFINITY, f32::max), "{isa:?} len {len}: max");
                let p: Vec<f32> = got.iter().enumerate().map(|(i, &e)| if i % 5 == 0 { 0.0 } else { e }).collect();
                let dp0: Vec<f32> =
                    sv.iter().enumerate().map(|(i, &t)| if i % 5 == 0 { f32::NAN } else { t }).collect();
                let dv = values(len, 11);
                for delta in [None, Some(&dv[..])] {
                    let mut dp = dp0.clone();
                    with_vectors!(isa, |s| kernels::ds_row(s, &p, &mut dp, delta, 0.25));
                    for i in 0..len {
                        let d = delta.map_or(0.25, |v| v[i]);
                        let w = if p[i] == 0.0 { 0.0 } else { p[i] * (dp0[i] - d) };
                        assert_eq!(dp[i].to_bits(), w.to_bits(), "{isa:?} len {len}: ds {i}");
                    }
                }
            }
        }
    }
}
