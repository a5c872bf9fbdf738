// emu_runtime.hpp: runs the CUDA kernels of ../*.cu on the CPU, one OS thread per CUDA
// thread and one block at a time, so their logic (gathers, masks, fragment layouts,
// online softmax, LSE merges) can be checked without a GPU.
//
// Emulated: threadIdx/blockIdx/blockDim/gridDim, __syncthreads (block barrier),
// __syncwarp and __shfl_xor_sync (per-warp barrier + exchange buffer), atomicAdd(float),
// static and dynamic shared memory (blocks run one after another), ldmatrix (.trans),
// cp.async (copied at once, so missing waits are NOT detected),
// bf16/f16 conversions
// with round-to-nearest-even, and mma.sync.m16n8k16 (row.col, f32 accumulate) from the
// fragment layout in the PTX ISA. Not emulated: timing, memory-model races, ptxas.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define ATTN_CPU_EMULATION 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
#define ATTN_DYNAMIC_SMEM(name) unsigned char* name = emu::dyn_smem()

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};
struct uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

namespace emu {
inline thread_local Dim3 t_thread, t_block;
inline Dim3 g_block_dim, g_grid_dim;
inline std::vector<unsigned char> g_smem(256 * 1024);
inline std::unique_ptr<std::barrier<>> g_block_barrier;
struct Warp {
    std::barrier<> bar{32};
    float f[32];
    unsigned u[32][10];
    const unsigned short* ptr[32];
};
inline std::vector<std::unique_ptr<Warp>> g_warps;
inline unsigned char* dyn_smem() { return g_smem.data(); }
inline Warp& warp() { return *g_warps[t_thread.x / 32]; }
}  // namespace emu

#define threadIdx (emu::t_thread)
#define blockIdx (emu::t_block)
#define blockDim (emu::g_block_dim)
#define gridDim (emu::g_grid_dim)

inline void __syncthreads() { emu::g_block_barrier->arrive_and_wait(); }
inline void __syncwarp() { emu::warp().bar.arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    auto& w = emu::warp();
    const int lane = threadIdx.x & 31;
    w.f[lane] = v;
    w.bar.arrive_and_wait();
    const float r = w.f[lane ^ o];
    w.bar.arrive_and_wait();
    return r;
}
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline float __int_as_float(int x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline float __uint_as_float(unsigned x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline unsigned short emu_f32_to_bf16(float x) {
    unsigned u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float emu_f16_to_f32(unsigned short x) {
    _Float16 h;
    std::memcpy(&h, &x, 2);
    return (float)h;
}
inline unsigned short emu_f32_to_f16(float x) {
    _Float16 h = (_Float16)x;
    unsigned short u;
    std::memcpy(&u, &h, 2);
    return u;
}

// mma.sync.m16n8k16.row.col f32 += A(16x16) B(16x8): gather every lane's fragments,
// rebuild A and B by the documented layout, each lane computes its 4 accumulators.
template <class E>
inline void emu_mma16816(float* c, const unsigned* a, const unsigned* b) {
    auto& w = emu::warp();
    const int lane = threadIdx.x & 31;
    for (int i = 0; i < 4; ++i) w.u[lane][i] = a[i];
    w.u[lane][4] = b[0];
    w.u[lane][5] = b[1];
    w.bar.arrive_and_wait();
    auto half = [](unsigned reg, int hi) { return E::to_f((unsigned short)(hi ? reg >> 16 : reg & 0xffffu)); };
    auto A = [&](int row, int col) {
        const int l = (row % 8) * 4 + (col % 8) / 2;
        const int r = (row >= 8 ? 1 : 0) + (col >= 8 ? 2 : 0);
        return half(w.u[l][r], col % 2);
    };
    auto B = [&](int k, int n) {
        const int l = n * 4 + (k % 8) / 2;
        return half(w.u[l][k >= 8 ? 5 : 4], k % 2);
    };
    const int g = lane >> 2, cc = lane & 3;
    for (int e = 0; e < 4; ++e) {
        const int row = g + (e >= 2 ? 8 : 0), col = 2 * cc + (e & 1);
        float s = 0.f;
        for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
        c[e] += s;
    }
    w.bar.arrive_and_wait();
}

// ldmatrix.sync.m8n8.x4(.trans).b16: lane l addresses row l % 8 of matrix l / 8.
inline void emu_ldmatrix_x4(unsigned* r, const unsigned short* p, bool trans) {
    auto& w = emu::warp();
    const int lane = threadIdx.x & 31;
    w.ptr[lane] = p;
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        unsigned lo, hi;
        if (!trans) {
            const unsigned short* row = w.ptr[i * 8 + lane / 4];
            lo = row[2 * (lane % 4)];
            hi = row[2 * (lane % 4) + 1];
        } else {
            lo = w.ptr[i * 8 + 2 * (lane % 4)][lane / 4];
            hi = w.ptr[i * 8 + 2 * (lane % 4) + 1][lane / 4];
        }
        r[i] = lo | (hi << 16);
    }
    w.bar.arrive_and_wait();
}

// cp.async: the emulator copies at once (src_bytes 0 = zero fill).
inline void emu_cp_async16(unsigned short* dst, const unsigned short* src, int src_bytes) {
    if (src_bytes == 16) std::memcpy(dst, src, 16);
    else std::memset(dst, 0, 16);
}

namespace emu {
// One OS thread per CUDA thread of a block, kept across blocks and launches (thread creation
// would dominate otherwise): `start` releases the workers on a block, `done` collects them.
struct Pool {
    unsigned n = 0;
    std::vector<std::thread> ts;
    std::unique_ptr<std::barrier<>> start, done;
    std::function<void()> job;
    Dim3 block;
    bool quit = false;
    ~Pool() { stop(); }
    void stop() {
        if (n == 0) return;
        quit = true;
        start->arrive_and_wait();
        for (auto& t : ts) t.join();
        ts.clear();
        n = 0;
        quit = false;
    }
    void ensure(unsigned threads) {
        if (n == threads) return;
        stop();
        n = threads;
        start = std::make_unique<std::barrier<>>(threads + 1);
        done = std::make_unique<std::barrier<>>(threads + 1);
        for (unsigned t = 0; t < threads; ++t)
            ts.emplace_back([this, t] {
                t_thread = Dim3{t, 0, 0};
                for (;;) {
                    start->arrive_and_wait();
                    if (quit) return;
                    t_block = block;
                    job();
                    done->arrive_and_wait();
                }
            });
    }
};
inline Pool g_pool;

// Launch `kernel(args...)` over grid x block (block.x a multiple of 32, y = z = 1).
template <class F>
inline void launch(Dim3 grid, unsigned threads, F kernel) {
    g_block_dim = Dim3{threads, 1, 1};
    g_grid_dim = grid;
    g_warps.clear();
    for (unsigned i = 0; i < threads / 32; ++i) g_warps.push_back(std::make_unique<Warp>());
    g_pool.ensure(threads);
    g_pool.job = kernel;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                g_block_barrier = std::make_unique<std::barrier<>>(threads);
                std::fill(g_smem.begin(), g_smem.end(), 0xAB);  // garbage, like real shared memory
                g_pool.block = Dim3{bx, by, bz};
                g_pool.start->arrive_and_wait();
                g_pool.done->arrive_and_wait();
            }
}
}  // namespace emu
