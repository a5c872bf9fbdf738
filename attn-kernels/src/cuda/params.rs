//! Kernel parameter structs passed by value to the CUDA kernels; `#[repr(C)]` mirrors of
//! `AttnParams` and `RowParams` in `kernels/prelude.cu` (same fields, same order).
#![allow(unsafe_code)]

use attn_core::{DilatedConfig, Shape4};
use cudarc::driver::DeviceRepr;

use super::plan::{PatternLaunch, out_scale, vec_loads_ok};

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
    pub head0: i64,
    pub w: i64,
    pub r: i64,
    pub fixed_off: i64,
    pub d: i64,
    pub scale: f32,
    pub out_scale: f32,
    pub causal: i32,
    pub vec: i32,
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

// SAFETY: plain `#[repr(C)]` structs of i64/f32/i32 fields with the same field order and
// types as the CUDA structs, so the kernel reads exactly these bytes; no pointers inside.
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
    pub q_start: usize,
    pub k_start: usize,
}

/// The kernel parameters of one pattern launch (what `src/cuda/block.rs` passes).
pub fn attn_params(cfg: &DilatedConfig, l: &BlockLayout, launch: &PatternLaunch) -> AttnParams {
    let (qs, ks) = (l.q.0, l.k.0);
    let d = qs.head_dim;
    let [q_sb, q_ss, q_sh] = strides3(l.q.1);
    let [k_sb, k_ss, k_sh] = strides3(l.k.1);
    let [v_sb, v_ss, v_sh] = strides3(l.v_strides);
    let [g_sb, g_ss, g_sh] = l.g_strides.map_or([0; 3], strides3);
    let mut vec = 0;
    for (bit, s) in [l.q.1, l.k.1, l.v_strides].into_iter().chain(l.g_strides).enumerate() {
        vec |= i32::from(vec_loads_ok(d, s)) << bit;
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
        head0: launch.heads.start as i64,
        w: launch.w as i64,
        r: launch.r as i64,
        fixed_off: launch.fixed_off.map_or(-1, |o| o as i64),
        d: d as i64,
        scale: cfg.scale_for(d) as f32,
        out_scale: out_scale(cfg),
        causal: i32::from(cfg.causal()),
        vec,
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
        // 22 i64 + 2 f32 + 2 i32 = 192 bytes; 10 i64 + f32 + i32 = 88 bytes (no padding).
        assert_eq!(std::mem::size_of::<AttnParams>(), 192);
        assert_eq!(std::mem::size_of::<RowParams>(), 88);
        assert_eq!(std::mem::align_of::<AttnParams>(), 8);
    }

    #[test]
    fn params_of_a_fused_qkv_longnet_launch() {
        let cfg = DilatedConfig::builder()
            .segments(&[8, 16])
            .dilations(&[1, 2])
            .mixing(attn_core::Mixing::LongNet)
            .causal(true)
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
        };
        let launches = super::super::plan::pattern_launches(&cfg, 3);
        let p = attn_params(&cfg, &layout, &launches[1]);
        assert_eq!((p.q_sb, p.q_ss, p.q_sh, p.k_ss, p.v_ss, p.g_ss), (1440, 144, 16, 48, 51, 48));
        assert_eq!((p.nq, p.nk, p.q_start, p.k_start, p.heads, p.head0), (10, 6, 4, 20, 3, 0));
        assert_eq!((p.w, p.r, p.fixed_off, p.d, p.causal), (16, 2, -1, 16, 1));
        assert_eq!((p.scale, p.out_scale), (0.25, 1.0));
        // v rows are 17 elements apart: no 16-byte loads for v (bit 2).
        assert_eq!(p.vec, 0b1011);
        let hg = DilatedConfig::new(&[8, 16], &[1, 2]).unwrap();
        let launches = super::super::plan::pattern_launches(&hg, 3);
        let p = attn_params(&hg, &layout, &launches[1]);
        assert_eq!((p.head0, p.fixed_off, p.out_scale, p.causal), (2, 1, 0.5, 0));
    }
}
