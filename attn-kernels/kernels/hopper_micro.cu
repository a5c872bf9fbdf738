// hopper_micro.cu: micro-kernels that pin down the Hopper layouts the sm_90a kernels rely
// on, so the first GPU run checks the emulator's reading of them (emulation/hopper_micro.hpp
// runs them on the CPU against plain products and gathers):
//   wgmma_micro_<dtype>_n<N>: C (64xN, f32) = A (64xK) B (KxN) by K/16 wgmma m64nNk16,
//     A and B brought by TMA in a swizzle mode (or A from registers), B K-major (B^T
//     stored [N][K]) or MN-major (B stored [K][N], read transposed);
//   tma_micro_b16: one TMA box of 16-bit elements through any tensor map (a stride-r map
//     turns rows off + t r into a contiguous box), copied out un-swizzled.
// Each takes the planted errors of the emulation's --plant as parameters (a wrong
// descriptor field, a wrong descriptor swizzle, a wrong mbarrier parity), 0 otherwise.

#ifdef ATTN_HOPPER

// Mirrored by the runner in emulation/hopper_micro.hpp.
struct WgmmaMicroParams {
    const TmaMap* a_map;  // A [64][K]
    const TmaMap* b_map;  // B^T [N][K] (K-major) or B [K][N] (MN-major)
    const u16* a_rows;    // A [64][K] in global memory (read as register fragments)
    float* c;             // C [64][N]
    int k;                // K: a multiple of 16 and of the swizzle's elements a row
    int a_regs;           // 1: A from registers
    int b_mn_major;       // 1: B MN-major
    u32 swz;              // Swizzle of the tiles and the tensor maps
    u32 desc_swz;         // swizzle written into the descriptors (planted: another)
    u32 sbo_extra;        // bytes added to every stride byte offset (planted: 128)
    u32 parity;           // parity of the first wait on the tile barrier (planted: 1)
};

struct TmaMicroParams {
    const TmaMap* map;
    u16* out;  // [rows][cols], un-swizzled
    int rows, cols, c1;
    u32 swz, parity;
};

// Bytes a tile row holds under swizzle s (the core matrix's 16 without one).
__device__ __forceinline__ u32 swizzle_row_bytes(Swizzle s) {
    return s == Swizzle::B128 ? 128u : s == Swizzle::B64 ? 64u : s == Swizzle::B32 ? 32u : 16u;
}

// The K/16 products into acc. A K-major tile of R rows lies in panels of W bytes a row,
// each R W bytes; B MN-major in panels of W / 2 columns, each K W bytes, k-rows W apart.
template <class E, int N, int TB>
__device__ __forceinline__ void micro_product(float* acc, const u16* sA, const u16* sB, const WgmmaMicroParams& p) {
    const Swizzle ds = static_cast<Swizzle>(p.desc_swz);
    const u32 W = swizzle_row_bytes(static_cast<Swizzle>(p.swz)), swizzled = ds != Swizzle::None;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    for (int ks = 0; ks < p.k / 16; ++ks) {
        const u32 kb = ks * 32;  // the k-step's first byte along a K-major row
        const u64 da = desc_advance(smem_desc(sA, 64 * W, 8 * W + p.sbo_extra, ds), (kb / W) * 64 * W + kb % W);
        u64 db;
        if (TB)
            db = desc_advance(swizzled ? smem_desc(sB, p.k * W, 8 * W + p.sbo_extra, ds)
                                       : smem_desc(sB, 128, p.k * 16 + p.sbo_extra, ds),
                              ks * 16 * W);
        else
            db = desc_advance(smem_desc(sB, N * W, 8 * W + p.sbo_extra, ds), (kb / W) * N * W + kb % W);
        wgmma_fence();
        if (p.a_regs) {
            const u16* r0 = p.a_rows + (16 * warp + g) * p.k + 16 * ks + 2 * c;
            const u16* r8 = r0 + 8 * p.k;
            const u32 a[4] = {r0[0] | (u32)r0[1] << 16, r8[0] | (u32)r8[1] << 16, r0[8] | (u32)r0[9] << 16,
                              r8[8] | (u32)r8[9] << 16};
            Wgmma<N, E>::template rs<TB>(acc, a, db, ks > 0);
        } else {
            Wgmma<N, E>::template ss<0, TB>(acc, da, db, ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands<N / 2>(acc);
    }
}

template <class E, int N>
__device__ void wgmma_micro(const WgmmaMicroParams& p) {
    ATTN_DYNAMIC_SMEM(smem_raw);
    unsigned char* smem = align_1024(smem_raw);
    const Swizzle s = static_cast<Swizzle>(p.swz);
    const u32 W = swizzle_row_bytes(s), half = W / 2;
    const u32 a_bytes = 64 * p.k * 2, b_bytes = N * p.k * 2;
    const u32 a_room = (a_bytes + 1023) / 1024 * 1024, b_room = (b_bytes + 1023) / 1024 * 1024;
    u16* sA = reinterpret_cast<u16*>(smem);
    u16* sB = reinterpret_cast<u16*>(smem + a_room);
    u64* bar = reinterpret_cast<u64*>(smem + a_room + b_room);
    if (threadIdx.x == 0) {
        mbar_init(bar, 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(bar, (p.a_regs ? 0 : a_bytes) + b_bytes);
        if (!p.a_regs)
            for (int c0 = 0; c0 < p.k; c0 += half) tma_load_2d(smem + (c0 / half) * 64 * W, p.a_map, c0, 0, bar);
        const int inner = p.b_mn_major ? N : p.k, panel = (p.b_mn_major ? p.k : N) * W;
        for (int c0 = 0; c0 < inner; c0 += half) tma_load_2d(smem + a_room + (c0 / half) * panel, p.b_map, c0, 0, bar);
    }
    mbar_wait(bar, p.parity);
    float acc[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
    if (p.b_mn_major)
        micro_product<E, N, 1>(acc, sA, sB, p);
    else
        micro_product<E, N, 0>(acc, sA, sB, p);
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) p.c[(16 * warp + g + (e >= 2 ? 8 : 0)) * N + 8 * j + 2 * c + (e & 1)] = acc[4 * j + e];
}

// One box of `map` at (0, c1) into shared memory, then out[row][col] from its swizzled place.
__device__ void tma_micro(const TmaMicroParams& p) {
    ATTN_DYNAMIC_SMEM(smem_raw);
    unsigned char* smem = align_1024(smem_raw);
    const u32 bytes = p.rows * p.cols * 2;
    u64* bar = reinterpret_cast<u64*>(smem + (bytes + 1023) / 1024 * 1024);
    if (threadIdx.x == 0) {
        mbar_init(bar, 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(bar, bytes);
        tma_load_2d(smem, p.map, 0, p.c1, bar);
    }
    mbar_wait(bar, p.parity);
    for (int i = threadIdx.x; i < p.rows * p.cols; i += blockDim.x)
        p.out[i] = *reinterpret_cast<const u16*>(smem + swizzle_offset(2 * i, static_cast<Swizzle>(p.swz)));
}

#define ATTN_WGMMA_MICRO(NAME, E, N) \
    extern "C" __global__ void __launch_bounds__(128) wgmma_micro_##NAME##_n##N(WgmmaMicroParams p) { wgmma_micro<E, N>(p); }
#if ATTN_WANT_BF16
ATTN_WGMMA_MICRO(bf16, BF16E, 64)
ATTN_WGMMA_MICRO(bf16, BF16E, 128)
#endif
#if ATTN_WANT_F16
ATTN_WGMMA_MICRO(f16, F16E, 32)
ATTN_WGMMA_MICRO(f16, F16E, 64)
#endif
extern "C" __global__ void __launch_bounds__(128) tma_micro_b16(TmaMicroParams p) { tma_micro(p); }

#endif  // ATTN_HOPPER
