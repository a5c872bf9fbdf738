//! Tile loops of one piece: the forward (`piece_forward`, choosing the kernel:
//! `tile_forward`, rows of scores; `lane_forward`, queries in SIMD lanes; or the bf16
//! pairs) and the backward (`tile_backward`) over packed f32 tiles (`f32_tiles`), with
//! their reusable buffers (`forward_scratch`).

pub(crate) mod f32_tiles;
pub(crate) mod forward_scratch;
pub(crate) mod lane_forward;
pub(crate) mod piece_forward;
pub(crate) mod tile_backward;
pub(crate) mod tile_forward;
