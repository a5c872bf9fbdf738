//! Packing: gather rows (any dtype, any stride, dilation already resolved to row
//! offsets) into contiguous f32 tiles, optionally scaled and/or transposed.

use attn_core::Element;

/// Rows addressed by element offsets into `data`, with their global positions
/// (ascending inside a piece).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PieceRows<'a, T> {
    pub data: &'a [T],
    pub offsets: &'a [usize],
    pub pos: &'a [usize],
}

impl<T: Element> PieceRows<'_, T> {
    #[inline]
    pub fn len(&self) -> usize {
        self.offsets.len()
    }
    #[inline]
    pub fn row(&self, i: usize, d: usize) -> &[T] {
        &self.data[self.offsets[i]..self.offsets[i] + d]
    }
}

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
        let out = &mut dst[i * dp..(i + 1) * dp];
        for (o, x) in out.iter_mut().zip(rows.row(start + i, d)) {
            *o = mul * x.to_f32();
        }
        out[d..].fill(0.0);
    }
}

/// `dst[e*width + j] = mul * rows[start + j][e]` for `j < len`; zero for `len <= j < width`
/// and for `d <= e < dp`. Works on groups of 8 rows so that every store run is 8
/// contiguous floats.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pack_transposed<T: Element>(
    rows: &PieceRows<'_, T>,
    start: usize,
    len: usize,
    d: usize,
    dp: usize,
    width: usize,
    mul: f32,
    dst: &mut [f32],
) {
    const G: usize = 8;
    let dst = &mut dst[..dp * width];
    if len < width || d < dp {
        dst.fill(0.0);
    }
    let mut j0 = 0;
    while j0 + G <= len {
        let src: [&[T]; G] = std::array::from_fn(|jj| rows.row(start + j0 + jj, d));
        for (e, out) in dst.chunks_exact_mut(width).take(d).enumerate() {
            let out: &mut [f32; G] = (&mut out[j0..j0 + G]).try_into().expect("G floats");
            for jj in 0..G {
                out[jj] = mul * src[jj][e].to_f32();
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
