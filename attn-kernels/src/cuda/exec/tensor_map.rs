//! TMA tensor maps on the device: the driver's `cuTensorMapEncodeTiled` (through cudarc's
//! `sys`) behind one safe function, and the maps of an sm_90a forward or backward launch
//! encoded and uploaded for the kernel (or the launch's `mma.sync` fallback where they
//! cannot be).
#![allow(unsafe_code)]

use attn_core::{AttnError, DType, Result};
use cudarc::driver::CudaSlice;
use cudarc::driver::sys::{
    self, CUresult, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};

use super::device::{CudaDevice, cuda_err};
use crate::cuda::plan::launch_plan::Planned;
use crate::cuda::plan::source::MMA_HEAD_DIMS;
use crate::cuda::plan::tensor_maps::{MapBases, MapSwizzle, TiledMap, launch_maps};

/// `map` over 16-bit elements of `dtype` (f16, bf16) as the driver encodes it: rows past
/// the map read as zeros, boxes swizzled as the kernel's descriptors read them.
pub(crate) fn encode_tiled(map: &TiledMap, dtype: DType) -> Result<CUtensorMap> {
    let data_type = match dtype {
        DType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::BF16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        other => return Err(AttnError::InvalidArgument(format!("no TMA tensor map of {other:?} elements"))),
    };
    let swizzle = match map.swizzle {
        MapSwizzle::B64 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        MapSwizzle::B128 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    };
    let (dims, strides, boxes, steps) = (map.dims, [map.row_stride], map.box_dims, [1u32, 1]);
    let mut out = CUtensorMap { opaque: [0; 16] };
    // SAFETY: `out` is a live, 64-byte aligned map; the arrays hold rank (2) entries, the
    // strides rank - 1; the driver only records `base`, which the caller keeps alive for
    // the launches that read the map.
    let rc = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut out,
            data_type,
            2,
            map.base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    match rc {
        CUresult::CUDA_SUCCESS => Ok(out),
        e => Err(AttnError::InvalidArgument(format!("cuTensorMapEncodeTiled refused {map:?}: {e:?}"))),
    }
}

/// The launch to run for `p` on tensors whose launched q, k, v (and grad_out, for a
/// backward launch) start at `bases` (device addresses) with `params_at`'s alignment from
/// `starts`: `p` and its maps on the device where it is an sm_90a kernel and can take them, its fallback where it cannot, `p`
/// alone otherwise. The maps' buffer is freed in stream order after the launch.
pub(crate) fn hopper_launch<'p>(
    dev: &CudaDevice,
    p: &'p Planned,
    dtype: DType,
    (starts, elem): ([Option<u64>; 4], usize),
    bases: MapBases,
) -> Result<(&'p Planned, Option<CudaSlice<u64>>)> {
    let Some(fallback) = p.fallback.as_deref() else { return Ok((p, None)) };
    let params = p.params_at(starts, elem);
    let Some(padded) = MMA_HEAD_DIMS.into_iter().find(|&d| d as i64 >= params.d) else {
        return Ok((fallback, None));
    };
    let (_, heads, batch) = p.grid;
    let Some(maps) = launch_maps(&params, batch as usize, heads as usize, padded, bases) else {
        return Ok((fallback, None));
    };
    // Entries no block reads stay zero; each map is 16 words.
    let mut words = vec![0u64; maps.len() * 16];
    for (i, m) in maps.iter().enumerate() {
        if let Some(m) = m {
            words[i * 16..(i + 1) * 16].copy_from_slice(&encode_tiled(m, dtype)?.opaque);
        }
    }
    Ok((p, Some(dev.stream.clone_htod(&words).map_err(cuda_err)?)))
}
