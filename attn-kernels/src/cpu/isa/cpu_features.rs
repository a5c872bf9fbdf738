//! Every CPU (and OS) feature check of the crate, each made once and cached: the
//! instruction sets the kernels use and Linux's grant of the AMX tile state.
#![allow(unsafe_code)]

use std::sync::OnceLock;

/// A check run once per process.
fn once(cell: &'static OnceLock<bool>, check: fn() -> bool) -> bool {
    *cell.get_or_init(check)
}

/// AVX2 and FMA.
pub(crate) fn avx2_fma() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    #[cfg(target_arch = "x86_64")]
    return once(&S, || std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"));
    #[cfg(not(target_arch = "x86_64"))]
    return once(&S, || false);
}

/// AVX2 and F16C (f16 rows converted to f32 in vectors).
pub(crate) fn f16c() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    #[cfg(target_arch = "x86_64")]
    return once(&S, || std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c"));
    #[cfg(not(target_arch = "x86_64"))]
    return once(&S, || false);
}

/// AVX-512F.
pub(crate) fn avx512f() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    #[cfg(target_arch = "x86_64")]
    return once(&S, || std::arch::is_x86_feature_detected!("avx512f"));
    #[cfg(not(target_arch = "x86_64"))]
    return once(&S, || false);
}

/// AVX-512F, BW and VL (the vector packing of bf16 pairs).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn avx512bw_vl() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    #[cfg(target_arch = "x86_64")]
    return once(&S, || {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    });
    #[cfg(not(target_arch = "x86_64"))]
    return once(&S, || false);
}

/// AVX-512F and AVX512-BF16 (`vdpbf16ps`).
pub(crate) fn avx512_bf16() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    #[cfg(target_arch = "x86_64")]
    return once(&S, || {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
    });
    #[cfg(not(target_arch = "x86_64"))]
    return once(&S, || false);
}

/// Whether `vdpbf16ps` issues at the rate of `vfmadd` (AMD, Zen 4 and later), so the bf16
/// forward's pair products beat the f32 kernel on converted rows. Intel cores issue it at
/// half that rate, and there only the AMX tiles make bf16 pay.
pub(crate) fn bf16_dot_full_rate() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    #[cfg(target_arch = "x86_64")]
    return once(&S, || {
        // CPUID leaf 0: the vendor string, "AuthenticAMD", in EBX, EDX, ECX.
        let r = std::arch::x86_64::__cpuid(0);
        (r.ebx, r.edx, r.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163)
    });
    #[cfg(not(target_arch = "x86_64"))]
    return once(&S, || false);
}

/// AMX tiles: AVX512-BF16, AMX-TILE and AMX-BF16, and Linux's permission to use the
/// tile state (asked for once, here; other systems: never).
pub(crate) fn amx_bf16() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    once(&S, amx_granted)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn amx_granted() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    if !avx512_bf16() {
        return false;
    }
    // CPUID leaf 7, sub-leaf 0, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE.
    let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
    if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
        return false;
    }
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and touches no
    // memory of ours; it fails (non-zero) where the kernel does not offer AMX.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn amx_granted() -> bool {
    false
}
