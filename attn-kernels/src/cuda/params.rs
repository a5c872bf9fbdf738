//! Kernel parameter structs passed by value to the CUDA kernels; `#[repr(C)]` mirrors of
//! `AttnParams` and `RowParams` in `kernels/prelude.cu` (same fields, same order).
#![allow(unsafe_code)]

use cudarc::driver::DeviceRepr;

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
}
