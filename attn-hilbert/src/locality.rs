//! Locality metrics: how compact the segments of a token order are in space.
//!
//! Segments follow SPEC.md: segment `s` holds sequence positions
//! `[s*w, min((s+1)*w, n))`. Two numbers summarise an order for a segment length:
//! - **neighbour-in-segment fraction**: for each token, the fraction of its face
//!   neighbours in the grid (4 in 2D, 6 in 3D, fewer at the border) that lie in
//!   the same segment, averaged over all tokens that have a neighbour;
//! - **mean segment diameter**: the spatial diameter of each segment in the
//!   Chebyshev (max-axis) metric, i.e. the largest extent of its bounding box
//!   along any axis minus one (exact for that metric), averaged over segments.

use attn_core::error::{AttnError, Result};

use crate::order::TokenOrder;

/// Both locality numbers for one order and segment length.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Locality {
    /// Mean fraction of each token's grid neighbours inside its own segment, in `[0, 1]`.
    pub neighbour_in_segment: f64,
    /// Mean Chebyshev diameter of a segment, in cells.
    pub mean_segment_diameter: f64,
    /// Number of segments.
    pub segments: usize,
}

fn check_segment(segment_len: usize) -> Result<()> {
    if segment_len == 0 {
        return Err(AttnError::ZeroSegmentLength { index: 0 });
    }
    Ok(())
}

/// Mean fraction of each token's grid neighbours that share its segment
/// (1.0 for a single-cell grid, which has no neighbours).
pub fn neighbour_in_segment_fraction(order: &TokenOrder, segment_len: usize) -> Result<f64> {
    check_segment(segment_len)?;
    let grid = order.grid();
    let pos = order.permutation().inverse_order();
    let (mut sum, mut counted) = (0.0f64, 0usize);
    for (t, &p) in pos.iter().enumerate() {
        let seg = p / segment_len;
        let (mut inside, mut total) = (0u32, 0u32);
        grid.for_each_neighbour(t, |u| {
            total += 1;
            inside += u32::from(pos[u] / segment_len == seg);
        });
        if total > 0 {
            sum += f64::from(inside) / f64::from(total);
            counted += 1;
        }
    }
    Ok(if counted == 0 { 1.0 } else { sum / counted as f64 })
}

/// [`neighbour_in_segment_fraction`] averaged over every segment offset: for each
/// `o` in `0..segment_len` the segments are `[o + s*w, o + (s+1)*w)` (plus the head
/// `[0, o)`), as when ring chunks, dilation offsets or a prefix shift where the
/// segments fall on the curve. Aligned segments favour any order whose blocks
/// happen to match them (Z-order on power-of-two tiles); this average rewards an
/// order whose every window of `w` consecutive tokens is compact.
pub fn shifted_neighbour_in_segment_fraction(order: &TokenOrder, segment_len: usize) -> Result<f64> {
    check_segment(segment_len)?;
    let grid = order.grid();
    let pos = order.permutation().inverse_order();
    let w = segment_len;
    // An offset at or past the last position puts every token in the head `[0, offset)`:
    // every neighbour is inside (fraction 1). Only the first `len` offsets need a walk,
    // so a huge `segment_len` costs `O(len^2)`, not `O(segment_len * len)`.
    let walked = w.min(pos.len());
    let mut total = (w - walked) as f64;
    for offset in 0..walked {
        // `(p + w - offset) / w` without overflow: 0 in the head, then 1, 2, ...
        let seg = |p: usize| if p < offset { 0 } else { (p - offset) / w + 1 };
        let (mut sum, mut counted) = (0.0f64, 0usize);
        for (t, &p) in pos.iter().enumerate() {
            let (mut inside, mut all) = (0u32, 0u32);
            grid.for_each_neighbour(t, |u| {
                all += 1;
                inside += u32::from(seg(pos[u]) == seg(p));
            });
            if all > 0 {
                sum += f64::from(inside) / f64::from(all);
                counted += 1;
            }
        }
        total += if counted == 0 { 1.0 } else { sum / counted as f64 };
    }
    Ok(total / w as f64)
}

/// Mean Chebyshev diameter of the segments, in cells.
pub fn mean_segment_diameter(order: &TokenOrder, segment_len: usize) -> Result<f64> {
    check_segment(segment_len)?;
    let grid = order.grid();
    let tokens = order.permutation().order();
    let mut total = 0.0f64;
    let mut segments = 0usize;
    for seg in tokens.chunks(segment_len) {
        let (mut lo, mut hi) = ([usize::MAX; 3], [0usize; 3]);
        for &t in seg {
            let c = grid.coords_of(t);
            for a in 0..3 {
                lo[a] = lo[a].min(c[a]);
                hi[a] = hi[a].max(c[a]);
            }
        }
        total += (0..3).map(|a| hi[a] - lo[a]).max().unwrap_or(0) as f64;
        segments += 1;
    }
    Ok(total / segments as f64)
}

/// Both metrics for one order and segment length.
pub fn locality(order: &TokenOrder, segment_len: usize) -> Result<Locality> {
    Ok(Locality {
        neighbour_in_segment: neighbour_in_segment_fraction(order, segment_len)?,
        mean_segment_diameter: mean_segment_diameter(order, segment_len)?,
        segments: order.len().div_ceil(segment_len),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_major_values_are_exact() {
        // 4x8 grid, segments of one row: each row is a segment.
        let o = TokenOrder::row_major_2d(4, 8).unwrap();
        let m = locality(&o, 8).unwrap();
        assert_eq!(m.segments, 4);
        assert_eq!(m.mean_segment_diameter, 7.0);
        // Per token: horizontal neighbours are inside, vertical ones outside.
        let mut want = 0.0;
        for y in 0..4 {
            for x in 0..8 {
                let h = (x > 0) as u32 + (x < 7) as u32;
                let v = (y > 0) as u32 + (y < 3) as u32;
                want += f64::from(h) / f64::from(h + v);
            }
        }
        assert!((m.neighbour_in_segment - want / 32.0).abs() < 1e-15);
        // One segment covering everything: every neighbour is inside.
        assert_eq!(neighbour_in_segment_fraction(&o, 1000).unwrap(), 1.0);
        assert!(matches!(locality(&o, 0), Err(AttnError::ZeroSegmentLength { .. })));
        assert_eq!(neighbour_in_segment_fraction(&TokenOrder::hilbert_2d(1, 1).unwrap(), 4).unwrap(), 1.0);
        // Offset 0 of the shifted average is the aligned metric; one segment of the
        // whole grid at every offset still cuts at the offset.
        let aligned = neighbour_in_segment_fraction(&o, 1).unwrap();
        assert_eq!(shifted_neighbour_in_segment_fraction(&o, 1).unwrap(), aligned);
        assert!(shifted_neighbour_in_segment_fraction(&o, 8).unwrap() < m.neighbour_in_segment);
        assert!(matches!(shifted_neighbour_in_segment_fraction(&o, 0), Err(AttnError::ZeroSegmentLength { .. })));
    }
}
