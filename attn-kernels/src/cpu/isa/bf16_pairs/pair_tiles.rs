//! Packing a piece's bf16 rows into the pair layouts both engines read (keys: pairs
//! along the head dim, tiles of 16 keys; values: pairs along the keys), with the check
//! that every value is finite. AVX-512 (`arch::pack`) where present, else scalar.

use attn_core::Element;

use super::arch;
use super::layout::{Geometry, KC, KS, MAX_HEAD_DIM, TILE, bits};
use crate::cpu::isa::rows::PieceRows;

/// Whether every value of the rows is finite: a bf16 is NaN or infinite exactly when
/// its exponent bits are all ones, i.e. when `(bits & 0x7f80) + 0x80` reaches bit 15
/// (an OR over the rows, which the compiler vectorises).
pub(super) fn all_finite<T: Element>(rows: &PieceRows<'_, T>, n: usize, d: usize) -> bool {
    let mut acc = 0u16;
    for i in 0..n {
        prefetch_row(rows, i + PREFETCH, d);
        for &x in rows.row(i, d) {
            acc |= nonfinite_flag(bits(x));
        }
    }
    acc & 0x8000 == 0
}

/// Rows ahead that packing asks the cache for: dilated rows are strided (often a
/// kilobyte or more apart), which the hardware prefetchers follow poorly.
const PREFETCH: usize = 8;

/// Ask for row `i` (if it exists) to be brought into the cache.
#[inline(always)]
fn prefetch_row<T: Element>(rows: &PieceRows<'_, T>, i: usize, d: usize) {
    if let Some(&off) = rows.offsets.get(i) {
        let start = rows.data[off..].as_ptr();
        arch::prefetch(start.cast(), d * std::mem::size_of::<T>());
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
/// whether every packed value is finite. `vector`: AVX-512 (only where
/// `arch::pair_tiles_avx512::available()`), else scalar code.
pub(super) fn pack_keys<T: Element>(
    vector: bool,
    k: &PieceRows<'_, T>,
    nk: usize,
    d: usize,
    g: &Geometry,
    dst: &mut Vec<u32>,
) -> bool {
    dst.clear();
    dst.resize(g.steps * g.qc() * 4 * TILE, 0);
    if vector {
        let mut finite = true;
        for key0 in (0..nk).step_by(16) {
            let n = (nk - key0).min(16);
            for j in 0..n {
                prefetch_row(k, key0 + 16 + j, d);
            }
            let rows: [&[T]; 16] = std::array::from_fn(|j| if j < n { k.row(key0 + j, d) } else { &[] });
            let at = g.k_tile(key0 / KS, 0, (key0 % KS) / 16);
            finite &= arch::pair_tiles_avx512::key_group(&rows[..n], d, g.qc(), &mut dst[at..], 4 * TILE);
        }
        return finite;
    }
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
/// or `d`). Returns whether every packed value is finite. `vector` as in [`pack_keys`].
pub(super) fn pack_values<T: Element>(
    vector: bool,
    v: &PieceRows<'_, T>,
    nk: usize,
    d: usize,
    g: &Geometry,
    dst: &mut Vec<u32>,
) -> bool {
    dst.clear();
    dst.resize(g.steps * 2 * g.ne() * TILE, 0);
    if vector {
        let mut finite = true;
        for key in (0..nk).step_by(2) {
            prefetch_row(v, key + PREFETCH, d);
            prefetch_row(v, key + PREFETCH + 1, d);
            let (t, kc, p) = (key / KS, (key % KS) / KC, (key % KC) / 2);
            let r1 = if key + 1 < nk { Some(v.row(key + 1, d)) } else { None };
            let at = g.v_tile(t, kc, 0) + p * 16;
            finite &= arch::pair_tiles_avx512::value_pair(v.row(key, d), r1, d, g.ne(), &mut dst[at..]);
        }
        return finite;
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// The AVX-512 packing equals the scalar packing bit for bit, finite flag included,
    /// for ragged head dims and key counts (odd d, d past one 32-wide chunk, partial
    /// 16-key groups and steps) and for a NaN or an infinity anywhere in the rows.
    #[test]
    fn vector_packing_equals_scalar() {
        if !arch::pair_tiles_avx512::available() {
            println!("skipped: no AVX512-BW/VL");
            return;
        }
        for (d, nk) in [(1, 1), (7, 17), (40, 70), (64, 64), (72, 130), (33, 5), (130, 100), (512, 20)] {
            let g = Geometry::new(d, nk);
            let stride = d + 3;
            let mut data: Vec<bf16> =
                (0..nk * stride).map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 7.0)).collect();
            let (offsets, pos): (Vec<usize>, Vec<usize>) = (0..nk).map(|j| (j * stride, j)).unzip();
            for poison in [None, Some((nk - 1, d - 1, bf16::NAN)), Some((nk / 2, d / 2, bf16::INFINITY))] {
                if let Some((row, col, x)) = poison {
                    data[row * stride + col] = x;
                }
                let rows = PieceRows { data: &data, offsets: &offsets, pos: &pos };
                let (mut a, mut b) = (Vec::new(), Vec::new());
                let (fa, fb) = (pack_keys(true, &rows, nk, d, &g, &mut a), pack_keys(false, &rows, nk, d, &g, &mut b));
                assert_eq!((fa, &a), (fb, &b), "keys d={d} nk={nk} poison={poison:?}");
                assert_eq!(fa, poison.is_none());
                let (fa, fb) =
                    (pack_values(true, &rows, nk, d, &g, &mut a), pack_values(false, &rows, nk, d, &g, &mut b));
                assert_eq!((fa, &a), (fb, &b), "values d={d} nk={nk} poison={poison:?}");
                assert_eq!(fa, poison.is_none());
            }
        }
    }
}
