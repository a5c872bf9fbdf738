//! The sm_90a forward and backward on the emulation: their TMA tensor maps encoded by the
//! library's stand-in for `cuTensorMapEncodeTiled` (`attn_emu_encode_tiled_2d` in
//! `emu_capi.cpp`, the layout its emulated TMA reads), or the launch's `mma.sync` fallback
//! where the launch cannot take the maps.

use std::ffi::{c_int, c_uint, c_void};

use attn_core::{AttnError, Result};
use libloading::Library;

use crate::cuda::exec::tensor::CudaElement;
use crate::cuda::plan::launch_plan::{Planned, Signature};
use crate::cuda::plan::source::MMA_HEAD_DIMS;
use crate::cuda::plan::tensor_maps::{MapBases, MapSwizzle, TiledMap, launch_maps};

type EncodeFn =
    unsafe extern "C" fn(*mut c_void, c_uint, *const c_void, u64, u64, u64, c_uint, c_uint, c_uint) -> c_int;
type BytesFn = unsafe extern "C" fn() -> c_uint;

/// The emulated tensor maps of a launch, in memory laid out as the kernel indexes them
/// (8-byte words: the maps hold addresses).
pub(super) struct EmulatedMaps(Vec<u64>);

impl EmulatedMaps {
    /// The address the kernel's `maps` argument takes.
    pub(super) fn as_ptr(&self) -> *const c_void {
        self.0.as_ptr().cast()
    }
}

fn emu_err(message: String) -> AttnError {
    AttnError::BackendUnavailable { backend: "cuda-emulation", reason: message }
}

/// The launch to run for `p` on q, k, v and grad_out (`qkvg`; buffers starting at
/// `starts`: q, k, v, the fourth tensor) with the emulation library `lib`: `p` with its
/// encoded maps where it is an sm_90a kernel and can take them, its fallback where it
/// cannot, `p` alone otherwise.
pub(super) fn hopper_launch<'p, T: CudaElement>(
    lib: &Library,
    p: &'p Planned,
    (qkv, g): ([&[T]; 3], Option<&[T]>),
    starts: [Option<u64>; 4],
) -> Result<(&'p Planned, Option<EmulatedMaps>)> {
    let Some(fallback) = p.fallback.as_deref() else { return Ok((p, None)) };
    let params = p.params_at(starts, size_of::<T>());
    let Some(padded) = MMA_HEAD_DIMS.into_iter().find(|&d| d as i64 >= params.d) else {
        return Ok((fallback, None));
    };
    let elem = |x: &[T], at: usize| x.get(at..).map_or(0, |s| s.as_ptr() as u64);
    let o = p.offsets;
    let g = g.filter(|_| p.signature == Signature::BackwardAll).map(|g| elem(g, o.g));
    let bases = MapBases { q: elem(qkv[0], o.q), k: elem(qkv[1], o.k), v: elem(qkv[2], o.v), g };
    let (_, heads, batch) = p.grid;
    let Some(maps) = launch_maps(&params, batch as usize, heads as usize, padded, bases) else {
        return Ok((fallback, None));
    };
    Ok((p, Some(encode_maps(lib, &maps)?)))
}

/// The maps in `lib`'s layout (an entry no block reads left zero).
fn encode_maps(lib: &Library, maps: &[Option<TiledMap>]) -> Result<EmulatedMaps> {
    // SAFETY: both functions have these signatures in emu_capi.cpp.
    let (encode, bytes) = unsafe {
        let encode = lib.get::<EncodeFn>(b"attn_emu_encode_tiled_2d");
        let bytes = lib.get::<BytesFn>(b"attn_emu_tensor_map_bytes");
        (encode.map_err(|e| emu_err(e.to_string()))?, bytes.map_err(|e| emu_err(e.to_string()))?)
    };
    // SAFETY: no arguments; returns a size.
    let size = unsafe { bytes() } as usize;
    let mut buf = EmulatedMaps(vec![0u64; (maps.len() * size).div_ceil(8)]);
    for (i, m) in maps.iter().enumerate() {
        let Some(m) = m else { continue };
        let swizzle = match m.swizzle {
            MapSwizzle::B128 => 1,
            MapSwizzle::B64 => 2,
        };
        // SAFETY: entry `i` of `buf` lies inside it (`maps.len()` entries of `size`
        // bytes); the base is only stored, read by a later launch on live buffers.
        let rc = unsafe {
            let base = m.base as *const c_void;
            let [d0, d1] = m.dims;
            let [b0, b1] = m.box_dims;
            encode(buf.0.as_mut_ptr().cast(), i as c_uint, base, d0, d1, m.row_stride, b0, b1, swizzle)
        };
        if rc != 0 {
            return Err(emu_err(format!("the emulated cuTensorMapEncodeTiled refused map {i}: {m:?}")));
        }
    }
    Ok(buf)
}
