//! The TMA tensor maps of an sm_90a forward or backward launch (`dilated_fwd_wgmma.cu`,
//! `dilated_bwd_wgmma.cu`) as data: for each (batch, head) of the launch, q, k and v of
//! that head (and grad_out for the backward) as a 2-D tiled map whose rows are the
//! pattern's selected rows, `r * seq_stride` apart, so one TMA box is a tile of selected
//! rows. Mirrors `encode_maps` and `encode_bwd_maps` in
//! `kernels/emulation/hopper_plan.hpp`; an encoder
//! (the driver's `cuTensorMapEncodeTiled`, or the emulation's) turns each into the bytes
//! the kernel reads.

use super::params::AttnParams;
use super::source::WGMMA_HEAD_DIMS;

/// Swizzle of a tensor map's box in shared memory (`CU_TENSOR_MAP_SWIZZLE_*`); the kernel's
/// wgmma descriptors read the tiles in the same mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapSwizzle {
    /// 64-byte rows (head_dim 32).
    B64,
    /// 128-byte rows (panels of 64 columns).
    B128,
}

/// One 2-D tiled map over 16-bit elements: `dims[0]` columns (contiguous) by `dims[1]`
/// rows `row_stride` bytes apart from `base`, loaded in boxes of `box_dims` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TiledMap {
    pub base: u64,
    pub dims: [u64; 2],
    pub row_stride: u64,
    pub box_dims: [u32; 2],
    pub swizzle: MapSwizzle,
}

/// Rows a box of the sm_90a forward (its query block and key tile).
pub const BOX_ROWS: u32 = 64;

/// Bytes an element of the tensors the sm_90a forward reads (f16, bf16).
const ELEM: u64 = 2;

/// A pattern as the kernels see it (`Pattern` in `prelude.cu`).
#[derive(Debug, Clone, Copy)]
struct Pattern {
    w: i64,
    r: i64,
    off: i64,
    per_seg: i64,
}

impl Pattern {
    /// `make_pattern`: head `h`'s offset, selected positions a full segment.
    fn of(a: &AttnParams, h: i64) -> Self {
        let off = if a.fixed_off >= 0 { a.fixed_off } else { h % a.r };
        Pattern { w: a.w, r: a.r, off, per_seg: (a.w - off + a.r - 1) / a.r }
    }

    /// `sel_below`: selected positions below `x`.
    fn below(&self, x: i64) -> i64 {
        let (full, rem) = (x / self.w, x % self.w);
        let tail = if rem > self.off { (rem - self.off + self.r - 1) / self.r } else { 0 };
        full * self.per_seg + tail
    }

    /// `sel_pos`: the position of selected index `t`.
    fn pos(&self, t: i64) -> i64 {
        t / self.per_seg * self.w + self.off + t % self.per_seg * self.r
    }
}

/// Element addresses of a launch's q, k and v (their first element as launched), and of
/// grad_out for a backward launch (`None` for a forward one).
#[derive(Debug, Clone, Copy)]
pub struct MapBases {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub g: Option<u64>,
}

/// The maps of a launch of `params` over `batch` elements and `heads` heads (grid y; head
/// `head0 + i * head_step`), as the kernel indexes them: `[batch][head][q, k, v]`, and
/// grad_out after v where `bases.g` is set (the backward), `None` for a map no block reads
/// (the head's pattern selects no row of the block). `None` where the launch cannot take
/// the sm_90a kernel: a padded head dim it has no instance of, rows or strides off 16 bytes
/// (`params.vec`), or a pattern whose selected rows are not one stride (`r` does not
/// divide `w`).
pub fn launch_maps(
    a: &AttnParams,
    batch: usize,
    heads: usize,
    padded_d: usize,
    bases: MapBases,
) -> Option<Vec<Option<TiledMap>>> {
    let tensors = if bases.g.is_some() { 15 } else { 7 };
    if a.vec & tensors != tensors || !WGMMA_HEAD_DIMS.contains(&padded_d) || a.r <= 0 || a.w <= 0 {
        return None;
    }
    let panel = padded_d.min(64) as u32;
    let swizzle = if panel == 64 { MapSwizzle::B128 } else { MapSwizzle::B64 };
    let mut maps = Vec::with_capacity(batch * heads * 3);
    for b in 0..batch as i64 {
        for hh in 0..heads as i64 {
            let h = a.head0 + hh * a.head_step;
            let kvh = h / a.kv_group.max(1);
            let p = Pattern::of(a, h);
            if p.per_seg * p.r != p.w {
                return None;
            }
            // One map over the selected rows [lo, hi) of a block starting at position `start`.
            let map = |base: u64, start: i64, n: i64, ss: i64| -> Option<Option<TiledMap>> {
                let (lo, hi) = (p.below(start), p.below(start + n));
                if hi <= lo {
                    return Some(None);
                }
                let row0 = base.checked_add_signed((p.pos(lo) - start) * ss * ELEM as i64)?;
                let row_stride = u64::try_from(p.r * ss).ok()? * ELEM;
                if !row0.is_multiple_of(16) || !row_stride.is_multiple_of(16) || row_stride >= 1 << 40 {
                    return None;
                }
                let (dims, box_dims) = ([a.d as u64, (hi - lo) as u64], [panel, BOX_ROWS]);
                Some(Some(TiledMap { base: row0, dims, row_stride, box_dims, swizzle }))
            };
            let at = |base: u64, elems: i64| base.checked_add_signed(elems * ELEM as i64);
            maps.push(map(at(bases.q, b * a.q_sb + h * a.q_sh)?, a.q_start, a.nq, a.q_ss)?);
            maps.push(map(at(bases.k, b * a.k_sb + kvh * a.k_sh)?, a.k_start, a.nk, a.k_ss)?);
            maps.push(map(at(bases.v, b * a.v_sb + kvh * a.v_sh)?, a.k_start, a.nk, a.v_ss)?);
            if let Some(g) = bases.g {
                maps.push(map(at(g, b * a.g_sb + h * a.g_sh)?, a.q_start, a.nq, a.g_ss)?);
            }
        }
    }
    Some(maps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(w: i64, r: i64, d: i64) -> AttnParams {
        AttnParams {
            q_ss: 64,
            k_ss: 64,
            v_ss: 64,
            q_sh: 64 * 100,
            k_sh: 64 * 100,
            v_sh: 64 * 100,
            nq: 100,
            nk: 100,
            heads: 1,
            kv_heads: 1,
            kv_group: 1,
            head_step: 1,
            w,
            r,
            fixed_off: -1,
            d,
            vec: 15,
            ..AttnParams::default()
        }
    }

    #[test]
    fn a_stride_r_pattern_maps_its_selected_rows_r_rows_apart() {
        let bases = MapBases { q: 0x1000, k: 0x2000, v: 0x3000, g: None };
        let maps = launch_maps(&params(8, 2, 64), 1, 1, 64, bases).unwrap();
        let q = maps[0].unwrap();
        // Offset 0 (head 0): positions 0, 2, 4, .. of 100 rows: 50 rows 2 * 64 * 2 bytes apart.
        assert_eq!(
            q,
            TiledMap { base: 0x1000, dims: [64, 50], row_stride: 256, box_dims: [64, 64], swizzle: MapSwizzle::B128 }
        );
        assert_eq!(maps.len(), 3);
    }

    #[test]
    fn launches_the_kernel_cannot_take_have_no_maps() {
        let bases = MapBases { q: 0x1000, k: 0x2000, v: 0x3000, g: None };
        assert!(launch_maps(&params(6, 4, 64), 1, 1, 64, bases).is_none(), "r does not divide w");
        assert!(launch_maps(&params(8, 2, 64), 1, 1, 256, bases).is_none(), "no head_dim 256 instance");
        assert!(launch_maps(&AttnParams { vec: 3, ..params(8, 2, 64) }, 1, 1, 64, bases).is_none(), "unaligned");
        let odd = MapBases { q: 0x1008, ..bases };
        assert!(launch_maps(&params(8, 2, 64), 1, 1, 64, odd).is_none(), "q off 16 bytes");
        let d32 = launch_maps(&params(8, 1, 32), 1, 1, 32, bases).unwrap()[0].unwrap();
        assert_eq!((d32.box_dims, d32.swizzle), ([32, 64], MapSwizzle::B64));
        let bwd = MapBases { g: Some(0x4000), ..bases };
        assert!(launch_maps(&AttnParams { vec: 7, ..params(8, 2, 64) }, 1, 1, 64, bwd).is_none(), "grad_out unaligned");
    }

    #[test]
    fn a_backward_launch_maps_grad_out_after_v_as_q() {
        let bases = MapBases { q: 0x1000, k: 0x2000, v: 0x3000, g: Some(0x4000) };
        let a = AttnParams { g_ss: 64, g_sh: 64 * 100, ..params(8, 2, 64) };
        let maps = launch_maps(&a, 1, 1, 64, bases).unwrap();
        assert_eq!(maps.len(), 4);
        let (q, g) = (maps[0].unwrap(), maps[3].unwrap());
        assert_eq!(g, TiledMap { base: 0x4000, ..q });
    }
}
