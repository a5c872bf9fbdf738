// tma_mbarrier.cu: the Hopper (sm_90a) memory pipeline: mbarriers (init, arrive,
// arrive.expect_tx, try_wait.parity) and TMA 2-D tiled loads from a tensor map into
// shared memory that complete their bytes on an mbarrier. Inline PTX where the compile
// targets sm_90a (__CUDA_ARCH_FEAT_SM90_ALL), the emulator's stand-ins
// (emulation/emu_hopper.hpp) under ATTN_CPU_EMULATION, nothing for other architectures.
//
// An mbarrier counts a phase: it completes when the expected arrivals came and the bytes
// announced by arrive.expect_tx landed; a waiter names the phase by its parity (0 for the
// first, then alternating), so a ring of stages keeps one parity bit per stage.

#if defined(ATTN_CPU_EMULATION) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTN_HOPPER 1

typedef unsigned long long u64;

#ifdef ATTN_CPU_EMULATION
typedef EmuTensorMap TmaMap;
#else
// A tensor map as cuTensorMapEncodeTiled writes it (opaque, 128 bytes, 64-byte aligned),
// read by the TMA unit from global or parameter memory.
struct __align__(64) TmaMap {
    u64 opaque[16];
};
// Swizzle of a tensor map's box and of a wgmma descriptor (descriptor bits 62-63);
// mirrored by emulation/emu_hopper.hpp.
enum class Swizzle : unsigned { None = 0, B128 = 1, B64 = 2, B32 = 3 };
#endif

#ifdef ATTN_CPU_EMULATION
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) { emu::mbar_init(bar, count); }
__device__ __forceinline__ void mbar_fence_init() {}
__device__ __forceinline__ void mbar_arrive(u64* bar) { emu::mbar_arrive(bar); }
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) { emu::mbar_arrive_expect_tx(bar, bytes); }
__device__ __forceinline__ bool mbar_try_wait(u64* bar, u32 parity) { return emu::mbar_try_wait_parity(bar, parity); }
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) { emu::mbar_wait_parity(bar, parity); }
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaMap* map, int c0, int c1, u64* bar) {
    emu::tma_load_2d(dst, map, c0, c1, bar);
}
__device__ __forceinline__ void fence_proxy_async() {}
#else
// The barrier counts `count` arrivals a phase; call mbar_fence_init and __syncthreads
// before any other thread uses it.
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the async proxy (TMA).
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// One arrival that also announces `bytes` still to land in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Whether the phase of this parity has completed.
__device__ __forceinline__ bool mbar_try_wait(u64* bar, u32 parity) {
    u32 done;
    asm volatile(
        "{.reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p;}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    return done != 0;
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}
// The box of `map` at element coordinates (c0 innermost, c1) into dst (128-byte aligned;
// 1024 for the 128B swizzle's pattern to start at a row of 8), its bytes completing on bar.
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaMap* map, int c0, int c1, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            smem_u32(dst)),
        "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
        : "memory");
}
// Orders this thread's generic shared-memory writes before later async-proxy reads (wgmma).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif

// The barriers of a producer/consumer ring, initialised by thread 0 and then visible to
// the block (a __syncthreads): `once` (the producer's one-off load, one arrival), and
// per stage `full` (the producer's arrival and its bytes) and `empty` (`consumers` arrivals).
__device__ __forceinline__ void mbar_init_ring(u64* once, u64* full, u64* empty, int stages, u32 consumers) {
    if (threadIdx.x == 0) {
        mbar_init(once, 1);
        for (int s = 0; s < stages; ++s) {
            mbar_init(full + s, 1);
            mbar_init(empty + s, consumers);
        }
        mbar_fence_init();
    }
    __syncthreads();
}

// The shared-memory address of p (what descriptors, mbarriers and TMA take).
__device__ __forceinline__ u32 smem_address(const void* p) {
#ifdef ATTN_CPU_EMULATION
    return emu::smem_addr(p);
#else
    return smem_u32(p);
#endif
}

// The first byte at or after p on a 1024-byte shared address: the 128B swizzle's repeat,
// where a swizzled tile must start (TMA writes it and wgmma reads it by address bits).
// Dynamic shared memory starts after the static arrays, wherever they end.
__device__ __forceinline__ unsigned char* align_1024(unsigned char* p) {
    return p + ((1024u - (smem_address(p) & 1023u)) & 1023u);
}

// Byte offset of logical byte `off` of a tile under swizzle `s`, for generic loads and
// stores of a tile that starts on a 1024-byte boundary (the TMA and wgmma patterns are
// functions of the address bits: 128B XORs bits 4-6 with 7-9, 64B 4-5 with 7-8, 32B 4 with 7).
__device__ __forceinline__ u32 swizzle_offset(u32 off, Swizzle s) {
    const u32 bits = s == Swizzle::B128 ? 7u : s == Swizzle::B64 ? 3u : s == Swizzle::B32 ? 1u : 0u;
    return off ^ (((off >> 7) & bits) << 4);
}

#endif  // ATTN_CPU_EMULATION || __CUDA_ARCH_FEAT_SM90_ALL
