//! Packing: gather rows (any dtype, any stride, dilation already resolved to row
//! offsets) into contiguous f32 tiles, optionally scaled and/or transposed. f16 rows
//! convert with F16C where the CPU has it (`ops::f16_row_to_f32`, detected at run
//! time); the conversion is exact, so every path packs the same bits.

use std::any::TypeId;

use attn_core::Element;

use crate::cpu::isa::rows::PieceRows;
use half::f16;

/// `out[e] = mul * row[e]` for `e < row.len()` (`out` at least as long).
#[inline]
fn convert_row<T: Element>(row: &[T], mul: f32, out: &mut [f32]) {
    if crate::cpu::isa::ops::f16_row_to_f32(row, mul, out) {
        return;
    }
    for (o, x) in out.iter_mut().zip(row) {
        *o = mul * x.to_f32();
    }
}

/// Rows ahead of the one being packed that [`pack_rows`] prefetches.
const PREFETCH_AHEAD: usize = 4;

/// Longest row [`pack_transposed`] converts through a stack buffer (f16 only).
const STACK_ROW: usize = 256;

/// `dst[i*dp + e] = mul * rows[start + i][e]` for `i < len`, zero for `d <= e < dp`.
pub(crate) fn pack_rows<T: Element>(
    rows: &PieceRows<'_, T>,
    start: usize,
    len: usize,
    d: usize,
    dp: usize,
    mul: f32,
    dst: &mut [f32],
) {
    for i in 0..len {
        if i + PREFETCH_AHEAD < len {
            crate::cpu::isa::ops::prefetch_row(rows.row(start + i + PREFETCH_AHEAD, d));
        }
        let out = &mut dst[i * dp..(i + 1) * dp];
        convert_row(rows.row(start + i, d), mul, out);
        out[d..].fill(0.0);
    }
}

/// `dst[e*width + j] = mul * rows[span.start + j][e]` for `j < span.len()`; zero for
/// `span.len() <= j < width` and for `d <= e < dp`. Works on groups of 8 rows so that
/// every store run is 8 contiguous floats.
pub(crate) fn pack_transposed<T: Element>(
    rows: &PieceRows<'_, T>,
    span: std::ops::Range<usize>,
    d: usize,
    dp: usize,
    width: usize,
    mul: f32,
    dst: &mut [f32],
) {
    let (start, len) = (span.start, span.len());
    const G: usize = 8;
    let dst = &mut dst[..dp * width];
    if len < width || d < dp {
        dst.fill(0.0);
    }
    let mut j0 = 0;
    while j0 + G <= len {
        for jj in j0 + G..(j0 + 2 * G).min(len) {
            crate::cpu::isa::ops::prefetch_row(rows.row(start + jj, d));
        }
        let src: [&[T]; G] = std::array::from_fn(|jj| rows.row(start + j0 + jj, d));
        if TypeId::of::<T>() == TypeId::of::<f16>() && d <= STACK_ROW {
            // Convert the 8 rows first (vector conversion), then transpose.
            let mut conv = [[0.0f32; STACK_ROW]; G];
            for (c, r) in conv.iter_mut().zip(&src) {
                convert_row(r, mul, c);
            }
            for (e, out) in dst.chunks_exact_mut(width).take(d).enumerate() {
                let out: &mut [f32; G] = (&mut out[j0..j0 + G]).try_into().expect("G floats");
                for jj in 0..G {
                    out[jj] = conv[jj][e];
                }
            }
        } else {
            for (e, out) in dst.chunks_exact_mut(width).take(d).enumerate() {
                let out: &mut [f32; G] = (&mut out[j0..j0 + G]).try_into().expect("G floats");
                for jj in 0..G {
                    out[jj] = mul * src[jj][e].to_f32();
                }
            }
        }
        j0 += G;
    }
    for j in j0..len {
        for (e, x) in rows.row(start + j, d).iter().enumerate() {
            dst[e * width + j] = mul * x.to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f16 packing (F16C where present) gives exactly `mul * to_f32` for every bit
    /// pattern class: normals, subnormals, zeros, infinities, NaN; ragged row lengths.
    #[test]
    fn f16_packing_is_exact() {
        let data: Vec<f16> = (0..=u16::MAX).step_by(7).map(f16::from_bits).collect();
        for d in [1, 7, 8, 13, 64, 72] {
            let n = data.len() / d;
            let offsets: Vec<usize> = (0..n).map(|i| i * d).collect();
            let rows = PieceRows { data: &data, offsets: &offsets, pos: &offsets };
            let dp = d.next_multiple_of(16);
            let (mut rowwise, mut trans) = (vec![0.0f32; n * dp], vec![0.0f32; dp * 16]);
            pack_rows(&rows, 0, n, d, dp, 0.5, &mut rowwise);
            pack_transposed(&rows, 0..n.min(16), d, dp, 16, 0.5, &mut trans);
            for i in 0..n {
                for e in 0..d {
                    let want = 0.5 * data[i * d + e].to_f32();
                    let got = rowwise[i * dp + e];
                    assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "d={d} {i},{e}");
                    if i < 16 {
                        let got = trans[e * 16 + i];
                        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "t d={d} {i},{e}");
                    }
                }
            }
        }
    }
}
