//! The CUDA C source of every kernel (`kernels/*.cu`), its NVRTC options and kernel names.
//!
//! The source is header-free (no `cuda_fp16.h`, `cuda_bf16.h` or `mma.h`), so NVRTC needs
//! no include path: the same string compiles at run time on a GPU machine and in
//! `cargo xtask ptx` on a machine without one.

use attn_core::DType;

use super::choices::{
    BackwardDq, BackwardKeys, BackwardLoads, BackwardOptions, BackwardQueries, ForwardOptions, ForwardRows,
    ForwardStages,
};

/// Shared definitions, compiled first.
pub const PRELUDE: &str = include_str!("../../../kernels/prelude.cu");

/// The kernel files after the prelude, as `(file name, text)`. The last four hold the
/// sm_90a kernels (TMA, mbarriers, wgmma): empty unless NVRTC targets `compute_90a`.
pub const FILES: [(&str, &str); 12] = [
    ("dilated_rows.cu", include_str!("../../../kernels/dilated_rows.cu")),
    ("mma_tiles.cu", include_str!("../../../kernels/mma_tiles.cu")),
    ("attend_tile.cu", include_str!("../../../kernels/attend_tile.cu")),
    ("dilated_fwd_mma.cu", include_str!("../../../kernels/dilated_fwd_mma.cu")),
    ("dilated_fwd_mma3.cu", include_str!("../../../kernels/dilated_fwd_mma3.cu")),
    ("dilated_bwd_mma.cu", include_str!("../../../kernels/dilated_bwd_mma.cu")),
    ("dilated_bwd_dq_mma.cu", include_str!("../../../kernels/dilated_bwd_dq_mma.cu")),
    ("epilogue.cu", include_str!("../../../kernels/epilogue.cu")),
    ("tma_mbarrier.cu", include_str!("../../../kernels/tma_mbarrier.cu")),
    ("wgmma.cu", include_str!("../../../kernels/wgmma.cu")),
    ("dilated_fwd_wgmma.cu", include_str!("../../../kernels/dilated_fwd_wgmma.cu")),
    ("dilated_bwd_wgmma.cu", include_str!("../../../kernels/dilated_bwd_wgmma.cu")),
];

/// Padded head dims of the tensor-core forward (`head_dim` is rounded up to one of these).
pub const MMA_HEAD_DIMS: [usize; 4] = [32, 64, 128, 256];

/// Padded head dims of the tensor-core backward (larger head dims use the row kernels).
pub const MMA_BWD_HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// Padded head dims of the sm_90a forward and backward (`dilated_fwd_wgmma.cu`,
/// `dilated_bwd_wgmma.cu`).
pub const WGMMA_HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// Largest head_dim any kernel supports (32 lanes x `ROW_CHUNKS` in `prelude.cu`).
pub const MAX_HEAD_DIM: usize = 256;

/// Lowest compute capability the backend runs on (mma.sync with bf16 needs sm_80).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// The whole translation unit: prelude, then every kernel file.
pub fn full_source() -> String {
    let mut s = String::with_capacity(PRELUDE.len() + FILES.iter().map(|f| f.1.len() + 64).sum::<usize>());
    s.push_str(PRELUDE);
    for (name, text) in FILES {
        s.push_str("\n// ---- ");
        s.push_str(name);
        s.push_str(" ----\n");
        s.push_str(text);
    }
    s
}

/// NVRTC options for a virtual architecture such as `compute_80`.
pub fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "--fmad=true".into()]
}

/// The NVRTC `-D` option that limits a compile to one dtype's kernels.
pub fn dtype_define(suffix: &str) -> attn_core::Result<String> {
    match suffix {
        "f32" => Ok("-DATTN_ONLY_F32".into()),
        "f16" => Ok("-DATTN_ONLY_F16".into()),
        "bf16" => Ok("-DATTN_ONLY_BF16".into()),
        other => Err(attn_core::AttnError::InvalidArgument(format!("no CUDA kernels for dtype `{other}`"))),
    }
}

/// Kernel names of one dtype's module.
pub fn kernel_names_for(suffix: &str) -> Vec<String> {
    let (tail, mid) = (format!("_{suffix}"), format!("_{suffix}_d"));
    kernel_names().into_iter().filter(|n| n.ends_with(&tail) || n.contains(&mid)).collect()
}

/// Kernel-name suffix of a dtype (`f32`, `f16`, `bf16`); f64 has no CUDA kernels.
pub fn dtype_suffix(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::F16 => Some("f16"),
        DType::BF16 => Some("bf16"),
        DType::F64 => None,
    }
}

/// Every `extern "C"` kernel the source defines (checked by `attn-ptx` against ptxas output).
pub fn kernel_names() -> Vec<String> {
    let mut names = Vec::new();
    for t in ["f32", "f16", "bf16"] {
        for k in [
            "dilated_fwd_rows",
            "dilated_bwd_dq_rows",
            "dilated_bwd_dkv_rows",
            "store_rows",
            "store_rows_v8",
            "delta_rows",
            "fill_lse",
        ] {
            names.push(format!("{k}_{t}"));
        }
    }
    for t in ["f16", "bf16"] {
        names.push(format!("delta_rows_v8_{t}"));
        for stages in ForwardStages::ALL {
            for rows in ForwardRows::ALL {
                let opts = ForwardOptions { rows, stages, ..ForwardOptions::default() };
                for d in MMA_HEAD_DIMS.into_iter().filter(|&d| opts.has_head_dim(d)) {
                    names.push(mma_kernel_name(t, d, rows, stages));
                }
            }
            for d in MMA_HEAD_DIMS {
                names.push(mma_fused_kernel_name(t, d, stages));
                names.push(mma_persistent_kernel_name(t, d, stages));
            }
        }
        for queries in BackwardQueries::ALL {
            for loads in BackwardLoads::ALL {
                for keys in BackwardKeys::ALL {
                    for dq in BackwardDq::ALL {
                        for d in MMA_BWD_HEAD_DIMS.into_iter().filter(|&d| keys.has_head_dim(d)) {
                            let opts = BackwardOptions { loads, keys, dq, queries, ..BackwardOptions::default() };
                            names.push(mma_bwd_kernel_name(t, d, opts));
                        }
                    }
                }
            }
        }
        for d in MMA_BWD_HEAD_DIMS {
            names.push(mma_bwd_dq_kernel_name(t, d));
        }
        // The instances that read a block mask (`_bm_` before the dtype).
        let bm = |n: String| n.replacen(&format!("_{t}_d"), &format!("_bm_{t}_d"), 1);
        for d in MMA_HEAD_DIMS {
            names.push(bm(mma_kernel_name(t, d, ForwardRows::M64, ForwardStages::Two)));
        }
        for d in MMA_BWD_HEAD_DIMS {
            for dq in BackwardDq::ALL {
                names.push(bm(mma_bwd_kernel_name(t, d, BackwardOptions { dq, ..BackwardOptions::default() })));
            }
            names.push(bm(mma_bwd_dq_kernel_name(t, d)));
        }
    }
    names
}

/// The kernels a `compute_90a` module of one dtype has beyond [`kernel_names_for`]: the
/// sm_90a forward and backward of each padded head dim (none for f32).
pub fn sm90a_kernel_names_for(suffix: &str) -> Vec<String> {
    if suffix == "f32" {
        return Vec::new();
    }
    let fwd = WGMMA_HEAD_DIMS.iter().map(|&d| wgmma_fwd_kernel_name(suffix, d));
    fwd.chain(WGMMA_HEAD_DIMS.iter().map(|&d| wgmma_bwd_kernel_name(suffix, d))).collect()
}

/// Name of the sm_90a backward (TMA tiles, wgmma; 64 keys a block) for a dtype suffix and
/// padded head dim.
pub fn wgmma_bwd_kernel_name(suffix: &str, padded_d: usize) -> String {
    format!("dilated_bwd_wgmma_{suffix}_d{padded_d}")
}

/// Dynamic shared memory of the sm_90a backward (bytes): room to align to 1024, K and V,
/// two stages of Q and dO tiles of 64 rows, the dS^T tile, the f32 dQ tile, the
/// mbarriers; mirrors `WGMMA_BWD_SMEM` in `dilated_bwd_wgmma.cu`.
pub fn wgmma_bwd_smem_bytes(padded_d: usize) -> usize {
    1024 + 2 * 64 * padded_d * 2 + 2 * 2 * 64 * padded_d * 2 + 64 * 64 * 2 + 64 * padded_d * 4 + 1024
}

/// Name of the sm_90a forward (TMA tiles, wgmma; 64 query rows a block) for a dtype suffix
/// and padded head dim.
pub fn wgmma_fwd_kernel_name(suffix: &str, padded_d: usize) -> String {
    format!("dilated_fwd_wgmma_{suffix}_d{padded_d}")
}

/// Dynamic shared memory of the sm_90a forward (bytes): room to align to 1024, the Q tile,
/// two K/V stages of 64 rows, the mbarriers; mirrors `WGMMA_FWD_SMEM` in `dilated_fwd_wgmma.cu`.
pub fn wgmma_fwd_smem_bytes(padded_d: usize) -> usize {
    1024 + 64 * padded_d * 2 + 2 * 2 * 64 * padded_d * 2 + 1024
}

/// Name of the fused tensor-core forward (64 query rows a block, several patterns a
/// launch: `AttnParams::fused`) for a dtype suffix, padded head dim and K/V stages.
pub fn mma_fused_kernel_name(suffix: &str, padded_d: usize, stages: ForwardStages) -> String {
    format!("{}fused_{suffix}_d{padded_d}", mma_forward_prefix(stages))
}

/// Name of the persistent tensor-core forward (the fused kernel's blocks as work items of a
/// grid sized to the machine: `AttnParams::work`) for a dtype suffix, padded head dim and
/// K/V stages.
pub fn mma_persistent_kernel_name(suffix: &str, padded_d: usize, stages: ForwardStages) -> String {
    format!("{}persistent_{suffix}_d{padded_d}", mma_forward_prefix(stages))
}

/// The tensor-core forward's name up to its block shape: the two- or three-stage kernel.
fn mma_forward_prefix(stages: ForwardStages) -> &'static str {
    match stages {
        ForwardStages::Two => "dilated_fwd_mma_",
        ForwardStages::Three => "dilated_fwd_mma3_",
    }
}

/// Name of the tensor-core backward for a dtype suffix, padded head dim, query-tile loads,
/// keys a block, dq sum (`dkv_`: the kernel without dq) and query rows a tile.
pub fn mma_bwd_kernel_name(suffix: &str, padded_d: usize, opts: BackwardOptions) -> String {
    let dq = match opts.dq {
        BackwardDq::Atomic => "",
        BackwardDq::Deterministic => "dkv_",
    };
    let loads = match opts.loads {
        BackwardLoads::Sync => "",
        BackwardLoads::Pipelined => "pipelined_",
    };
    let keys = match opts.keys {
        BackwardKeys::K64 => "",
        BackwardKeys::K128 => "k128_",
    };
    let queries = match opts.queries {
        BackwardQueries::Q32 => "",
        BackwardQueries::Q64 => "q64_",
    };
    format!("dilated_bwd_mma_{dq}{loads}{keys}{queries}{suffix}_d{padded_d}")
}

/// Name of the deterministic backward's tensor-core dq kernel (query-major, 64 rows a block)
/// for a dtype suffix and padded head dim.
pub fn mma_bwd_dq_kernel_name(suffix: &str, padded_d: usize) -> String {
    format!("dilated_bwd_dq_mma_{suffix}_d{padded_d}")
}

/// Name of the tensor-core forward for a dtype suffix, padded head dim, rows a block and
/// K/V stages.
pub fn mma_kernel_name(suffix: &str, padded_d: usize, rows: ForwardRows, stages: ForwardStages) -> String {
    let shape = match rows {
        ForwardRows::M64 => "",
        ForwardRows::M128 => "m128_",
        ForwardRows::M128W4 => "m128w4_",
    };
    format!("{}{shape}{suffix}_d{padded_d}", mma_forward_prefix(stages))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_kernel_is_defined_once_in_the_source() {
        let src = full_source();
        for name in kernel_names() {
            // Kernels are defined by macros: check the macro invocation or the literal name.
            let found = if let Some(rest) = name.strip_prefix("dilated_fwd_mma3_") {
                // Three stages: every shape's instances sit in one list macro per dtype.
                let (rest, mac) = if let Some(r) = rest.strip_prefix("m128_") {
                    (r, "ATTN_MMA3_KERNEL_M128")
                } else if let Some(r) = rest.strip_prefix("m128w4_") {
                    (r, "ATTN_MMA3_KERNEL_M128W4")
                } else if let Some(r) = rest.strip_prefix("fused_") {
                    (r, "ATTN_MMA3_KERNEL_FUSED")
                } else if let Some(r) = rest.strip_prefix("persistent_") {
                    (r, "ATTN_MMA3_KERNEL_PERSISTENT")
                } else {
                    (rest, "ATTN_MMA3_KERNEL")
                };
                let (t, d) = rest.split_once("_d").unwrap();
                let e = if t == "f16" { "F16E" } else { "BF16E" };
                src.contains(&format!("{mac}(NAME, E, {d},")) && src.contains(&format!("ATTN_MMA3_KERNELS({t}, {e})"))
            } else if let Some(rest) = name.strip_prefix("dilated_fwd_mma_") {
                let (rest, mac) = if let Some(r) = rest.strip_prefix("m128_") {
                    (r, "ATTN_MMA_KERNEL_M128")
                } else if let Some(r) = rest.strip_prefix("m128w4_") {
                    (r, "ATTN_MMA_KERNEL_M128W4")
                } else if let Some(r) = rest.strip_prefix("fused_") {
                    (r, "ATTN_MMA_KERNEL_FUSED")
                } else if let Some(r) = rest.strip_prefix("persistent_") {
                    (r, "ATTN_MMA_KERNEL_PERSISTENT")
                } else if let Some(r) = rest.strip_prefix("bm_") {
                    (r, "ATTN_MMA_KERNEL_BM")
                } else {
                    (rest, "ATTN_MMA_KERNEL")
                };
                let (t, d) = rest.split_once("_d").unwrap();
                let e = if t == "f16" { "F16E" } else { "BF16E" };
                src.contains(&format!("{mac}({t}, {e}, {d},"))
            } else if let Some(rest) = name.strip_prefix("dilated_bwd_dq_mma_") {
                // The block-mask instance (`bm_`) comes from the same macro.
                let rest = rest.strip_prefix("bm_").unwrap_or(rest);
                let (t, d) = rest.split_once("_d").unwrap();
                let e = if t == "f16" { "F16E" } else { "BF16E" };
                src.contains(&format!("ATTN_MMA_BWD_DQ_KERNEL({t}, {e}, {d},"))
            } else if let Some(rest) = name.strip_prefix("dilated_bwd_mma_") {
                let rest = rest.strip_prefix("dkv_").unwrap_or(rest);
                let rest = rest.strip_prefix("pipelined_").unwrap_or(rest);
                let (rest, mac) = match (rest.strip_prefix("k128_"), rest.strip_prefix("bm_")) {
                    (Some(r), _) => (r, "ATTN_MMA_BWD_KERNEL_K128"),
                    (None, Some(r)) => (r, "ATTN_MMA_BWD_KERNEL_BM"),
                    (None, None) => (rest, "ATTN_MMA_BWD_KERNEL"),
                };
                let (rest, mac) = match rest.strip_prefix("q64_") {
                    Some(r) => (r, format!("{mac}_Q64")),
                    None => (rest, mac.to_string()),
                };
                let (t, d) = rest.split_once("_d").unwrap();
                let e = if t == "f16" { "F16E" } else { "BF16E" };
                src.contains(&format!("{mac}({t}, {e}, {d})"))
            } else if let Some(t) = name.strip_prefix("delta_rows_v8_") {
                let e = if t == "f16" { "F16E" } else { "BF16E" };
                src.contains(&format!("ATTN_DELTA_V8_KERNEL({t}, {e})"))
            } else if let Some(t) = ["f32", "f16", "bf16"].iter().find(|t| name.ends_with(&format!("_{t}"))) {
                let e = match *t {
                    "f32" => "F32E",
                    "f16" => "F16E",
                    _ => "BF16E",
                };
                src.contains(&format!("ATTN_ROW_KERNELS({t}, {e})"))
                    && src.contains(&format!("ATTN_EPILOGUE_KERNELS({t}, {e})"))
            } else {
                src.contains(&format!("void {name}("))
            };
            assert!(found, "{name} is not defined");
        }
        for t in ["f16", "bf16"] {
            let e = if t == "f16" { "F16E" } else { "BF16E" };
            for d in WGMMA_HEAD_DIMS {
                assert_eq!(sm90a_kernel_names_for(t).iter().filter(|n| **n == wgmma_fwd_kernel_name(t, d)).count(), 1);
                assert_eq!(sm90a_kernel_names_for(t).iter().filter(|n| **n == wgmma_bwd_kernel_name(t, d)).count(), 1);
                assert!(src.contains(&format!("ATTN_WGMMA_FWD_KERNEL({t}, {e}, {d})")), "{t} d{d} sm_90a forward");
            }
        }
        assert!(sm90a_kernel_names_for("f32").is_empty());
        assert!(!src.contains("#include"), "the source must stay header-free");
        let per_dtype: usize = ["f32", "f16", "bf16"].iter().map(|t| kernel_names_for(t).len()).sum();
        assert_eq!(per_dtype, kernel_names().len(), "every kernel belongs to exactly one dtype module");
    }
}
