// wgmma.cu: Hopper (sm_90a) warpgroup MMA: shared-memory matrix descriptors and
// wgmma.mma_async m64nNk16 (N = 32, 64, 128; f16/bf16 in, f32 accumulate), with
// wgmma.fence / commit_group / wait_group. A warpgroup is 4 consecutive warps (128
// threads, the first a multiple of 128) and every thread of it issues each instruction.
// Inline PTX for sm_90a; under ATTN_CPU_EMULATION the emulator (emulation/emu_hopper.hpp).
//
// Fragments (warp w of the warpgroup owns rows 16w..16w+15 of the 64; g = lane / 4,
// c = lane % 4): the accumulator D (N / 2 floats a thread) is mma.m16n8k16's C per
// 8-column block j, d[4j + e] = (row g + 8 (e >= 2), col 8j + 2c + (e & 1)); A from
// registers (4 u32) is mma.m16n8k16's A, so D of one product re-packed in pairs is the A
// of the next, as with mma.sync.
//
// Descriptors (PTX ISA, "Matrix Descriptor Format"): bits 0-13 start address >> 4, 16-29
// leading byte offset >> 4, 32-45 stride byte offset >> 4, 49-51 base offset (kept 0:
// operands start on their swizzle pattern's rows), 62-63 swizzle. For 16-bit operands
// in K-major layout with a swizzle of W bytes: rows of W bytes, 8-row groups SBO apart,
// LBO unused; a k-step of 16 advances the start by 32 bytes. MN-major (transposed, tnsp 1):
// W / 2 elements of M or N a row, 8 k-rows of W bytes, k-groups SBO apart, M/N blocks of
// W / 2 LBO apart. Without swizzle, 8x16-byte core matrices: K-major: SBO between 8-row
// groups, LBO between 8-column ones; MN-major: SBO between 8-element MN groups, LBO
// between 8-row k groups.

#ifdef ATTN_HOPPER

// The descriptor of a 16-bit operand at shared address `p`.
__device__ __forceinline__ u64 smem_desc(const void* p, u32 lbo, u32 sbo, Swizzle s) {
    const u32 addr = smem_address(p);
    return (u64)((addr & 0x3ffff) >> 4) | ((u64)((lbo >> 4) & 0x3fff) << 16) | ((u64)((sbo >> 4) & 0x3fff) << 32) |
           ((u64)(u32)s << 62);
}
// The descriptor `bytes` further on (a k-step inside a swizzled row; bytes % 16 == 0).
__device__ __forceinline__ u64 desc_advance(u64 desc, u32 bytes) { return desc + (bytes >> 4); }

#ifdef ATTN_CPU_EMULATION
__device__ __forceinline__ void wgmma_fence() { emu::wgmma_fence(); }
__device__ __forceinline__ void wgmma_commit() { emu::wgmma_commit(); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    emu::wgmma_wait(N);
}
// D (+)= A B, A and B through descriptors (ss) or A from registers (rs); scale_d 0: D = A B.
// TA / TB: 1 where the operand is MN-major (transposed).
template <int N, class E>
struct Wgmma {
    template <int TA, int TB>
    static void ss(float* d, u64 da, u64 db, int scale_d) {
        emu::wgmma_issue(d, N, nullptr, da, db, scale_d, TA, TB, E::to_f);
    }
    template <int TB>
    static void rs(float* d, const u32* a, u64 db, int scale_d) {
        emu::wgmma_issue(d, N, a, 0, db, scale_d, 0, TB, E::to_f);
    }
};
#else
// Orders register accesses of the accumulators before the wgmma that reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

#define ATTN_WG_ACC4(d) "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3])
#define ATTN_WG_ACC16(d) ATTN_WG_ACC4(d), ATTN_WG_ACC4((d) + 4), ATTN_WG_ACC4((d) + 8), ATTN_WG_ACC4((d) + 12)
#define ATTN_WG_ACC32(d) ATTN_WG_ACC16(d), ATTN_WG_ACC16((d) + 16)
#define ATTN_WG_ACC64(d) ATTN_WG_ACC32(d), ATTN_WG_ACC32((d) + 32)

template <int N, class E>
struct Wgmma;
template <>
struct Wgmma<32, BF16E> {
    template <int TA, int TB>
    static __device__ __forceinline__ void ss(float* d, u64 da, u64 db, int scale_d) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %18, 0; "
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
            "%16, %17, p, 1, 1, %19, %20;}"
            : ATTN_WG_ACC16(d)
            : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
    }
    template <int TB>
    static __device__ __forceinline__ void rs(float* d, const u32* a, u64 db, int scale_d) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %21, 0; "
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
            "{%16, %17, %18, %19}, %20, p, 1, 1, %22;}"
            : ATTN_WG_ACC16(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
    }
};
template <>
struct Wgmma<64, BF16E> {
    template <int TA, int TB>
    static __device__ __forceinline__ void ss(float* d, u64 da, u64 db, int scale_d) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %34, 0; "
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, %35, %36;}"
            : ATTN_WG_ACC32(d)
            : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
    }
    template <int TB>
    static __device__ __forceinline__ void rs(float* d, const u32* a, u64 db, int scale_d) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %37, 0; "
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "{%32, %33, %34, %35}, %36, p, 1, 1, %38;}"
            : ATTN_WG_ACC32(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
    }
};
template <>
struct Wgmma<128, BF16E> {
    template <int TA, int TB>
    static __device__ __forceinline__ void ss(float* d, u64 da, u64 db, int scale_d) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %66, 0; "
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "%64, %65, p, 1, 1, %67, %68;}"
            : ATTN_WG_ACC64(d)
            : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
    }
    template <int TB>
    static __device__ __forceinline__ void rs(float* d, const u32* a, u64 db, int scale_d) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %69, 0; "
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "{%64, %65, %66, %67}, %68, p, 1, 1, %70;}"
            : ATTN_WG_ACC64(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
    }
};
template <>
struct Wgmma<32, F16E> {
    template <int TA, int TB>
    static __device__ __forceinline__ void ss(float* d, u64 da, u64 db, int scale_d) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %18, 0; "
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
            "%16, %17, p, 1, 1, %19, %20;}"
            : ATTN_WG_ACC16(d)
            : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
    }
    template <int TB>
    static __device__ __forceinline__ void rs(float* d, const u32* a, u64 db, int scale_d) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %21, 0; "
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
            "{%16, %17, %18, %19}, %20, p, 1, 1, %22;}"
            : ATTN_WG_ACC16(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
    }
};
template <>
struct Wgmma<64, F16E> {
    template <int TA, int TB>
    static __device__ __forceinline__ void ss(float* d, u64 da, u64 db, int scale_d) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %34, 0; "
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, %35, %36;}"
            : ATTN_WG_ACC32(d)
            : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
    }
    template <int TB>
    static __device__ __forceinline__ void rs(float* d, const u32* a, u64 db, int scale_d) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %37, 0; "
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "{%32, %33, %34, %35}, %36, p, 1, 1, %38;}"
            : ATTN_WG_ACC32(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
    }
};
template <>
struct Wgmma<128, F16E> {
    template <int TA, int TB>
    static __device__ __forceinline__ void ss(float* d, u64 da, u64 db, int scale_d) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %66, 0; "
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "%64, %65, p, 1, 1, %67, %68;}"
            : ATTN_WG_ACC64(d)
            : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
    }
    template <int TB>
    static __device__ __forceinline__ void rs(float* d, const u32* a, u64 db, int scale_d) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %69, 0; "
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "{%64, %65, %66, %67}, %68, p, 1, 1, %70;}"
            : ATTN_WG_ACC64(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
    }
};
#endif  // ATTN_CPU_EMULATION

// Keeps the compiler from moving accesses of accumulators across a wgmma or a wait.
template <int NREG>
__device__ __forceinline__ void wgmma_fence_operands(float* d) {
#ifndef ATTN_CPU_EMULATION
#pragma unroll
    for (int i = 0; i < NREG; ++i) asm volatile("" : "+f"(d[i])::"memory");
#endif
}

#endif  // ATTN_HOPPER
