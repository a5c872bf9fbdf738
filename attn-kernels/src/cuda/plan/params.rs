//! Kernel parameter structs passed by value to the CUDA kernels; `#[repr(C)]` mirrors of
//! `AttnParams` and `RowParams` in `kernels/prelude.cu` (same fields, same order).
#![allow(unsafe_code)]

use attn_core::{Band, DilatedConfig, Shape4};
use cudarc::driver::DeviceRepr;

use super::patterns::{PatternLaunch, out_scale, vec_loads_ok};

/// Parameters of the attention kernels (`AttnParams` in `prelude.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AttnParams {
    pub q_sb: i64,
    pub q_ss: i64,
    pub q_sh: i64,
    pub k_sb: i64,
    pub k_ss: i64,
    pub k_sh: i64,
    pub v_sb: i64,
    pub v_ss: i64,
    pub v_sh: i64,
    pub g_sb: i64,
    pub g_ss: i64,
    pub g_sh: i64,
    pub nq: i64,
    pub nk: i64,
    pub q_start: i64,
    pub k_start: i64,
    pub heads: i64,
    pub kv_heads: i64,
    pub kv_group: i64,
    pub head0: i64,
    pub head_step: i64,
    pub w: i64,
    pub r: i64,
    pub fixed_off: i64,
    pub d: i64,
    pub band_left: i64,
    pub band_right: i64,
    /// Device address of the key padding flag (u8) of k-block row 0, batch 0; 0 = none.
    pub kpad: u64,
    pub kpad_sb: i64,
    /// Device address of the block mask (u8, 1 = kept); 0 = none.
    pub bmask: u64,
    /// The block mask's batch and head strides (0 where one entry serves all).
    pub bm_sb: i64,
    pub bm_sh: i64,
    /// Key blocks a row of the block mask.
    pub bm_nbk: i64,
    /// Positions a block.
    pub bm_size: i64,
    pub scale: f32,
    pub out_scale: f32,
    pub vec: i32,
    /// 1: the forward writes the output and lse of its rows (`Signature::ForwardDirect`).
    pub out_direct: i32,
    /// The tensor-core forward: `> 0` = this launch runs the patterns `fuse[..fused]`.
    pub fused: i32,
    /// A persistent launch: batch elements, each with the fused table's blocks.
    pub work_batch: i32,
    pub fuse: [FusedPattern; MAX_FUSED],
    /// A persistent launch: device address of its work counter (two u32: next item, blocks
    /// done; zero before the launch, and zero again after it); 0 = none.
    pub work: u64,
    /// A persistent launch: work items (the fused table's blocks times `work_batch`).
    pub work_items: i64,
    /// The global index of local query head 0 (a [`HeadWindow`](super::head_window::HeadWindow)'s
    /// first head; 0 without one): a LongNet head's offset is its global index mod `r`.
    pub head_base: i64,
    /// The global index of local key/value head 0: query head `h` reads key/value head
    /// `(head_base + h) / kv_group - kv_base` of the tensors.
    pub kv_base: i64,
}

/// Patterns one fused forward launch runs at most (`MAX_FUSED` in `prelude.cu`).
pub const MAX_FUSED: usize = 8;

/// One pattern of a fused forward launch (`FusedPattern` in `prelude.cu`): its blocks are
/// grid x indices from `first` up to the next entry's, `blocks` row blocks for each of its
/// heads from `head0`; the other fields replace the launch's own.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FusedPattern {
    pub first: i64,
    pub blocks: i64,
    pub head0: i64,
    pub w: i64,
    pub r: i64,
    pub fixed_off: i64,
    pub band_left: i64,
    pub band_right: i64,
}

/// Parameters of the row-wise epilogue kernels (`RowParams` in `prelude.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RowParams {
    pub batch: i64,
    pub seq: i64,
    pub heads: i64,
    pub d: i64,
    pub a_sb: i64,
    pub a_ss: i64,
    pub a_sh: i64,
    pub b_sb: i64,
    pub b_ss: i64,
    pub b_sh: i64,
    pub scale: f32,
    pub pad: i32,
}

// SAFETY: plain `#[repr(C)]` structs of i64/u64/f32/i32 fields with the same field order
// and types as the CUDA structs, so the kernel reads exactly these bytes. `kpad`, `bmask`
// and `work` are device addresses (or 0) that the launching code keeps alive for the launch.
unsafe impl DeviceRepr for AttnParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for RowParams {}

/// Shapes, strides and global start positions of one (q block, k/v block) call.
#[derive(Debug, Clone, Copy)]
pub struct BlockLayout {
    pub q: (Shape4, [usize; 4]),
    pub k: (Shape4, [usize; 4]),
    pub v_strides: [usize; 4],
    /// grad_out strides (backward only).
    pub g_strides: Option<[usize; 4]>,
    /// Positions of row 0 of each block, relative to the start of their packed sequence.
    pub q_start: usize,
    pub k_start: usize,
    /// Which keys a query sees by distance (the config's band: window and causal).
    pub band: Band,
}

/// Positions, segment lengths and dilation rates the kernels take are at most this: their
/// index divisions run in 32 bits (`div32` in `prelude.cu`).
pub(crate) const MAX_INDEX: usize = i32::MAX as usize;

/// Largest band reach the kernels take: positions stay below
/// `i64::MAX / 2`, so a longer segment or reach is the same as an unbounded one.
const UNBOUNDED: usize = 1 << 62;

/// A band side as the kernels take it, in selected indices of a pattern of rate `r`
/// (selected positions of a segment are `r` apart, so a reach of `x` positions is `x / r`
/// indices); `-1` when unbounded.
fn band_side(x: usize, r: usize) -> i64 {
    if x == usize::MAX { -1 } else { (x / r.max(1)).min(UNBOUNDED) as i64 }
}

/// The kernel parameters of one pattern launch (what `cuda/exec/block.rs` passes).
pub fn attn_params(cfg: &DilatedConfig, l: &BlockLayout, launch: &PatternLaunch) -> AttnParams {
    let (qs, ks) = (l.q.0, l.k.0);
    let kv_heads = ks.heads.max(1);
    let d = qs.head_dim;
    let [q_sb, q_ss, q_sh] = strides3(l.q.1);
    let [k_sb, k_ss, k_sh] = strides3(l.k.1);
    let [v_sb, v_ss, v_sh] = strides3(l.v_strides);
    let [g_sb, g_ss, g_sh] = l.g_strides.map_or([0; 3], strides3);
    let mut vec = 0;
    let strides = [l.q.1, l.k.1, l.v_strides].into_iter().chain(l.g_strides);
    for (bit, (s, shape)) in strides.zip([qs, ks, ks, qs]).enumerate() {
        vec |= i32::from(vec_loads_ok(shape, s)) << bit;
    }
    AttnParams {
        q_sb,
        q_ss,
        q_sh,
        k_sb,
        k_ss,
        k_sh,
        v_sb,
        v_ss,
        v_sh,
        g_sb,
        g_ss,
        g_sh,
        nq: qs.seq as i64,
        nk: ks.seq as i64,
        q_start: l.q_start as i64,
        k_start: l.k_start as i64,
        heads: qs.heads as i64,
        kv_heads: kv_heads as i64,
        kv_group: (qs.heads / kv_heads).max(1) as i64,
        head0: launch.heads.start as i64,
        head_step: 1,
        // Window mode's whole-sequence pattern has w = usize::MAX; positions are below
        // MAX_INDEX, so a longer segment is the same as one of MAX_INDEX.
        w: launch.w.min(MAX_INDEX) as i64,
        r: launch.r as i64,
        fixed_off: launch.fixed_off.map_or(-1, |o| o as i64),
        d: d as i64,
        band_left: band_side(l.band.left, launch.r),
        band_right: band_side(l.band.right, launch.r),
        kpad: 0,
        kpad_sb: 0,
        bmask: 0,
        bm_sb: 0,
        bm_sh: 0,
        bm_nbk: 0,
        bm_size: 1,
        scale: cfg.scale_for(d) as f32,
        out_scale: out_scale(cfg),
        vec,
        out_direct: 0,
        fused: 0,
        work_batch: 0,
        fuse: [FusedPattern::default(); MAX_FUSED],
        work: 0,
        work_items: 0,
        head_base: launch.head_base as i64,
        kv_base: 0,
    }
}

/// Strides as the i64 triple (batch, seq, head) the kernels take.
pub fn strides3(s: [usize; 4]) -> [i64; 3] {
    [s[0] as i64, s[1] as i64, s[2] as i64]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_cuda_structs() {
        // 38 8-byte fields + 2 f32 + 4 i32 + 8 fused patterns of 8 i64 = 840 bytes;
        // 10 i64 + f32 + i32 = 88 bytes (no padding).
        assert_eq!(std::mem::size_of::<FusedPattern>(), 64);
        assert_eq!(std::mem::size_of::<AttnParams>(), 840);
        assert_eq!(std::mem::size_of::<RowParams>(), 88);
        assert_eq!(std::mem::align_of::<AttnParams>(), 8);
    }

    #[test]
    fn params_of_a_fused_qkv_longnet_launch() {
        let cfg = DilatedConfig::builder()
            .segments(&[8, 16])
            .dilations(&[1, 2])
            .mixing(attn_core::Mixing::LongNet)
            .causal()
            .build()
            .unwrap();
        let q = Shape4::new(2, 10, 3, 16).unwrap();
        let k = q.with_seq(6).unwrap();
        let fused = [10 * 3 * 3 * 16, 3 * 3 * 16, 16, 1];
        let layout = BlockLayout {
            q: (q, fused),
            k: (k, k.contiguous_strides()),
            v_strides: [6 * 3 * 17, 3 * 17, 17, 1],
            g_strides: Some(q.contiguous_strides()),
            q_start: 4,
            k_start: 20,
            band: cfg.band(),
        };
        let launches = crate::cuda::plan::patterns::pattern_launches(&cfg, 3);
        let p = attn_params(&cfg, &layout, &launches[1]);
        assert_eq!((p.q_sb, p.q_ss, p.q_sh, p.k_ss, p.v_ss, p.g_ss), (1440, 144, 16, 48, 51, 48));
        assert_eq!((p.nq, p.nk, p.q_start, p.k_start, p.heads, p.head0), (10, 6, 4, 20, 3, 0));
        assert_eq!((p.w, p.r, p.fixed_off, p.d, p.band_left, p.band_right), (16, 2, -1, 16, -1, 0));
        assert_eq!((p.kv_heads, p.kv_group, p.head_step, p.kpad), (3, 1, 1, 0));
        assert_eq!((p.scale, p.out_scale), (0.25, 1.0));
        // v rows are 17 elements apart: no 16-byte loads for v (bit 2).
        assert_eq!(p.vec, 0b1011);
        let hg = DilatedConfig::new(&[8, 16], &[1, 2]).unwrap();
        let launches = crate::cuda::plan::patterns::pattern_launches(&hg, 3);
        let p = attn_params(&hg, &BlockLayout { band: hg.band(), ..layout }, &launches[1]);
        assert_eq!((p.head0, p.fixed_off, p.out_scale, p.band_left, p.band_right), (2, 1, 0.5, -1, -1));
    }

    #[test]
    fn params_of_a_grouped_window_launch() {
        let cfg = DilatedConfig::builder().window(7, 3).causal().build().unwrap();
        let q = Shape4::new(1, 10, 8, 16).unwrap();
        let k = Shape4::new(1, 10, 2, 16).unwrap();
        let layout = BlockLayout {
            q: (q, q.contiguous_strides()),
            k: (k, k.contiguous_strides()),
            v_strides: k.contiguous_strides(),
            g_strides: None,
            q_start: 0,
            k_start: 0,
            band: cfg.band(),
        };
        let launches = crate::cuda::plan::patterns::pattern_launches(&cfg, 8);
        let p = attn_params(&cfg, &layout, &launches[0]);
        assert_eq!((p.heads, p.kv_heads, p.kv_group, p.k_sh), (8, 2, 4, 16));
        // The window's one pattern: every position in one segment; causal cuts the right side.
        assert_eq!((p.w, p.r, p.fixed_off, p.band_left, p.band_right), (MAX_INDEX as i64, 1, 0, 7, 0));
        assert_eq!(p.out_scale, 1.0);
    }
}
