// emu_runtime.hpp: runs the CUDA kernels of ../*.cu on the CPU, one fiber (ucontext) per
// CUDA thread and one block at a time on the calling OS thread, so their logic (gathers,
// masks, fragment layouts, online softmax, LSE merges) can be checked without a GPU. A
// barrier switches to the next fiber until every member has arrived.
//
// Emulated: threadIdx/blockIdx/blockDim/gridDim, __syncthreads (block barrier),
// __syncwarp and __shfl_xor_sync (per-warp barrier + exchange buffer), atomicAdd (float,
// unsigned), __threadfence (a no-op: one block runs at a time), static and dynamic shared memory (blocks run one after another; a write past the
// launch's dynamic bytes is counted in emu::g_smem_overruns), ldmatrix (.trans),
// cp.async (held per thread until its wait_group lets it land, so a missing or early wait
// reads stale shared memory; copies still in flight when a block ends are counted in
// emu::g_unwaited_blocks), the alignment of vector accesses to global and shared memory
// (counted in emu::g_misaligned),
// bf16/f16 conversions
// with round-to-nearest-even, and mma.sync.m16n8k16 (row.col, f32 accumulate) from the
// fragment layout in the PTX ISA. Threads run in order between barriers, alternately first
// to last and last to first over a grid's blocks. Not emulated: timing, memory-model races
// beyond that, ptxas.
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define ATTN_CPU_EMULATION 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
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
// One fiber per CUDA thread of the block being run; `run_block` resumes them in turn.
// A fiber starts on its own stack through ucontext once, then switches with
// _setjmp/_longjmp (no signal-mask system call per switch).
// A cp.async copy in flight: its 16 bytes (read at issue) and where they land.
struct AsyncCopy {
    unsigned short* dst;
    unsigned char bytes[16];
};
struct Fiber {
    ucontext_t ctx;
    jmp_buf jb;
    std::unique_ptr<char[]> stack;
    Dim3 thread;
    bool started = false, done = false;
    std::vector<AsyncCopy> open;                 // issued, not yet committed
    std::deque<std::vector<AsyncCopy>> groups;  // committed, oldest first
};
inline constexpr std::size_t kFiberStack = 256 * 1024;
inline std::deque<Fiber> g_fibers;  // grows only: fibers keep their stacks and addresses
inline ucontext_t g_main;
inline jmp_buf g_main_jb;
inline unsigned g_current = 0;
inline std::function<void()> g_job;
inline Dim3 t_block;
inline unsigned g_unwaited_blocks = 0;  // blocks that ended with cp.async copies in flight
inline unsigned g_smem_overruns = 0;    // blocks that wrote past their dynamic shared memory
inline unsigned g_misaligned = 0;       // vector accesses off their alignment
inline Fiber& current() { return g_fibers[g_current]; }
// Back to the scheduler; it resumes this fiber on its next round.
inline void yield() {
    if (!_setjmp(current().jb)) _longjmp(g_main_jb, 1);
}

// Every change of synchronisation state (a barrier arrival, an mbarrier update, a copy
// landing, a fiber ending) counts here; a waiter that sees no change over whole rounds
// of the scheduler is deadlocked.
inline unsigned long long g_progress = 0;
inline unsigned g_deadlocks = 0;      // blocks ended because no fiber could make progress
inline bool g_block_aborted = false;  // this block deadlocked: its fibers leave at their next wait

// Leaves the block from a wait: the fiber is done and starts afresh on the next block.
[[noreturn]] inline void abandon_block() {
    Fiber& f = current();
    f.done = true;
    f.started = false;
    f.open.clear();
    f.groups.clear();
    _longjmp(g_main_jb, 1);
}

// Yields until `ready()`. Three whole rounds of every fiber with no progress are a
// deadlock: it is counted in g_deadlocks and every fiber of the block leaves it at its
// next wait, so a deadlocked kernel ends (with a wrong result) instead of hanging.
template <class Ready>
inline void spin_until(Ready ready) {
    unsigned long long seen = g_progress;
    for (int still = 0; !ready();) {
        if (g_block_aborted) abandon_block();
        yield();
        if (g_block_aborted) abandon_block();
        if (g_progress != seen) {
            seen = g_progress;
            still = 0;
        } else if (++still > 3) {
            ++g_deadlocks;
            g_block_aborted = true;
            abandon_block();
        }
    }
}

// A barrier of `size` fibers: the last to arrive opens it, the others yield until it opens.
struct Barrier {
    unsigned size, count = 0, generation = 0;
    explicit Barrier(unsigned n) : size(n) {}
    void arrive_and_wait() {
        const unsigned gen = generation;
        ++g_progress;
        if (++count == size) {
            count = 0;
            ++generation;
            return;
        }
        spin_until([&] { return generation != gen; });
    }
};
// Run at the start and at the end of every block (the Hopper state of emu_hopper.hpp).
inline void (*g_block_start)() = nullptr;
inline void (*g_block_end)() = nullptr;

inline Dim3 g_block_dim, g_grid_dim;
inline constexpr std::size_t kSmemBytes = 256 * 1024;  // every block's shared memory
inline std::vector<unsigned char> g_smem(kSmemBytes);
inline std::unique_ptr<Barrier> g_block_barrier;
struct Warp {
    Barrier bar{32};
    float f[32];
    unsigned u[32][10];
    const unsigned short* ptr[32];
};
inline std::vector<std::unique_ptr<Warp>> g_warps;
// Dynamic shared memory starts this far into the block's shared memory, as it does on a
// GPU after the static arrays: 16-byte aligned, not 1024 (a tile that needs more aligns
// itself).
inline constexpr std::size_t kDynSmemOffset = 512;
inline unsigned char* dyn_smem() { return g_smem.data() + kDynSmemOffset; }
inline Warp& warp() { return *g_warps[current().thread.x / 32]; }
}  // namespace emu

#define threadIdx (emu::current().thread)
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
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline void __threadfence() {}
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
inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, 4);
    return u;
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

// A vector access of `bytes` at `p`, to global or shared memory (ATTN_ALIGNED in
// prelude.cu, ldmatrix rows, cp.async): the GPU faults unless p is a multiple of `bytes`;
// here it is counted.
inline void emu_check_aligned(const void* p, unsigned bytes) {
    if (reinterpret_cast<std::uintptr_t>(p) % bytes != 0) ++emu::g_misaligned;
}

// ldmatrix.sync.m8n8.x4(.trans).b16: lane l addresses row l % 8 of matrix l / 8.
inline void emu_ldmatrix_x4(unsigned* r, const unsigned short* p, bool trans) {
    auto& w = emu::warp();
    const int lane = threadIdx.x & 31;
    emu_check_aligned(p, 16);  // each lane's row: 16 bytes
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

// cp.async: the source is read at issue (src_bytes 0 = zero fill) and lands in shared
// memory only when a wait_group covers its group. Its source address needs 16-byte
// alignment either way.
inline void emu_cp_async16(unsigned short* dst, const unsigned short* src, int src_bytes) {
    emu_check_aligned(src, 16);
    emu_check_aligned(dst, 16);
    emu::AsyncCopy c{dst, {}};
    if (src_bytes == 16) std::memcpy(c.bytes, src, 16);
    emu::current().open.push_back(c);
}
inline void emu_cp_async_commit() {
    auto& f = emu::current();
    f.groups.push_back(std::move(f.open));
    f.open.clear();
}
// cp.async.wait_group n: every committed group but the newest n lands.
inline void emu_cp_async_wait(unsigned n) {
    auto& f = emu::current();
    while (f.groups.size() > n) {
        for (const auto& c : f.groups.front()) std::memcpy(c.dst, c.bytes, 16);
        f.groups.pop_front();
    }
}

namespace emu {
// A fiber runs one job per block it is resumed for, for the life of the process.
inline void fiber_main() {
    for (;;) {
        g_job();
        Fiber& f = current();
        if (!f.open.empty() || !f.groups.empty()) {
            ++g_unwaited_blocks;
            f.open.clear();
            f.groups.clear();
        }
        f.done = true;
        ++g_progress;
        if (!_setjmp(current().jb)) _longjmp(g_main_jb, 1);
    }
}

// Run one block: `threads` fibers from the start of the job, round by round until all are
// done; `reversed` resumes them last thread first, so a read that a missing barrier leaves
// racing with another thread's write sees the old value in one order or the other.
inline void run_block(unsigned threads, bool reversed) {
    while (g_fibers.size() < threads) {
        Fiber& f = g_fibers.emplace_back();
        f.stack = std::make_unique<char[]>(kFiberStack);
        f.thread = Dim3{(unsigned)g_fibers.size() - 1, 0, 0};
    }
    for (unsigned t = 0; t < threads; ++t) g_fibers[t].done = false;
    for (unsigned left = threads; left > 0;) {
        left = 0;
        for (unsigned i = 0; i < threads; ++i) {
            const unsigned t = reversed ? threads - 1 - i : i;
            Fiber& f = g_fibers[t];
            if (f.done) continue;
            g_current = t;
            if (!_setjmp(g_main_jb)) {
                if (!f.started) {
                    f.started = true;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack.get();
                    f.ctx.uc_stack.ss_size = kFiberStack;
                    f.ctx.uc_link = &g_main;
                    makecontext(&f.ctx, fiber_main, 0);
                    swapcontext(&g_main, &f.ctx);
                } else {
                    _longjmp(f.jb, 1);
                }
            }
            left += f.done ? 0 : 1;
        }
    }
}

// The blocks of a grid in the order a launch runs them: grid order (x fastest) for `order`
// 0, else the permutation that seed draws (splitmix64 driving a Fisher-Yates shuffle).
inline std::vector<Dim3> block_order(Dim3 grid, unsigned long long order) {
    std::vector<Dim3> blocks;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) blocks.push_back(Dim3{bx, by, bz});
    if (order == 0) return blocks;
    unsigned long long state = order;
    auto next = [&state] {
        unsigned long long z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    };
    for (std::size_t i = blocks.size(); i > 1; --i) std::swap(blocks[i - 1], blocks[next() % i]);
    return blocks;
}

// Launch `kernel(args...)` over grid x block (block.x a multiple of 32, y = z = 1) with
// `dyn_bytes` of dynamic shared memory, blocks in `block_order(grid, order)`: a block that
// changes a byte past them (still the fill value) counts in g_smem_overruns.
template <class F>
inline void launch(Dim3 grid, unsigned threads, F kernel, std::size_t dyn_bytes = kSmemBytes,
                   unsigned long long order = 0) {
    g_block_dim = Dim3{threads, 1, 1};
    g_grid_dim = grid;
    g_warps.clear();
    for (unsigned i = 0; i < threads / 32; ++i) g_warps.push_back(std::make_unique<Warp>());
    g_job = kernel;
    for (const Dim3& blk : block_order(grid, order)) {
        g_block_barrier = std::make_unique<Barrier>(threads);
        std::fill(g_smem.begin(), g_smem.end(), 0xAB);  // garbage, like real shared memory
        t_block = blk;
        g_block_aborted = false;
        if (g_block_start) g_block_start();
        run_block(threads, (blk.x + blk.y + blk.z) % 2 == 1);  // both orders over a grid's blocks
        if (g_block_end) g_block_end();
        if (g_block_aborted)  // the warps' barriers may hold arrivals of the abandoned block
            for (auto& w : g_warps) w = std::make_unique<Warp>();
        const auto touched = [](unsigned char c) { return c != 0xAB; };
        const std::size_t end = std::min(g_smem.size(), kDynSmemOffset + dyn_bytes);
        if (std::any_of(g_smem.begin(), g_smem.begin() + kDynSmemOffset, touched) ||
            std::any_of(g_smem.begin() + end, g_smem.end(), touched))
            ++g_smem_overruns;
    }
}
}  // namespace emu
