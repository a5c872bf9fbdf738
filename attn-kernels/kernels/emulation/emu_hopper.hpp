// emu_hopper.hpp: the Hopper (sm_90a) instructions of ../hopper.cu on the CPU, over
// emu_runtime.hpp's fibers: wgmma.mma_async (warpgroup-collective m64nNk16, f16/bf16 in,
// f32 accumulate; A from registers or shared memory, B from shared memory, both read
// through 64-bit matrix descriptors with the swizzle modes none/32B/64B/128B, K-major or
// MN-major), wgmma.fence / commit_group / wait_group, mbarriers (init, arrive,
// arrive.expect_tx, complete_tx, try_wait.parity with phases) and TMA 2-D tiled loads
// from a tensor map (cp.async.bulk.tensor.2d ... mbarrier::complete_tx::bytes), bulk
// f32 reductions from shared into global memory (cp.reduce.async.bulk ... .add.f32) and
// bar.sync over one warpgroup.
//
// Timing is adversarial where it is cheap to be: a wgmma reads its shared-memory operands
// and writes its accumulators only at the wait_group that retires it (after yielding once,
// so other warps run between issue and completion); a TMA copy reads global memory at
// issue and lands in shared memory, completing its bytes on the mbarrier, either at issue
// (TmaLanding::Eager) or only when a thread waits for the phase it belongs to
// (TmaLanding::Lazy: a wait on the wrong parity sees the old contents). Misuse is counted
// in g_hopper_faults (an mbarrier used before init or arrived past its count, a
// descriptor with a base offset, operands outside shared memory, a wgmma without a
// wgmma.fence since the thread last retired one, a collective whose threads disagree)
// and in g_hopper_unwaited (a block that ended with wgmma or TMA work in flight).
//
// The layouts are read as the PTX ISA ("Matrix Descriptor Format", "Shared Memory Matrix
// Layout") and CUTLASS's GMMA atoms describe them; only a GPU run of the micro-kernels in
// hopper_micro.hpp confirms this reading. Swizzles act on shared-memory address bits:
// 128B XORs bits 4-6 with bits 7-9, 64B bits 4-5 with 7-8, 32B bit 4 with bit 7.
#pragma once

#include "emu_runtime.hpp"

#include <array>
#include <map>
#include <memory>

// Swizzle mode of a descriptor (its bits 62-63) and of a tensor map.
enum class Swizzle : unsigned { None = 0, B128 = 1, B64 = 2, B32 = 3 };

// A 2-D tiled tensor map as cuTensorMapEncodeTiled builds it (the fields the load reads).
struct EmuTensorMap {
    const unsigned char* base;
    unsigned long long dims[2];  // elements: dim 0 innermost (contiguous)
    unsigned long long stride1;  // bytes between consecutive dim-1 indices
    unsigned box[2];             // box extent per dim (elements)
    unsigned elem;               // bytes per element
    Swizzle swizzle;
};

namespace emu {
enum class TmaLanding { Lazy, Eager };
inline TmaLanding g_tma_landing = TmaLanding::Lazy;
inline unsigned g_hopper_faults = 0;
inline unsigned g_hopper_unwaited = 0;

// Shared-memory byte address of p (an offset into the block's dynamic shared memory).
inline unsigned smem_addr(const void* p) {
    const auto* c = static_cast<const unsigned char*>(p);
    if (c < g_smem.data() || c >= g_smem.data() + g_smem.size()) {
        ++g_hopper_faults;
        return 0;
    }
    return (unsigned)(c - g_smem.data());
}

// Bytes after which a swizzle's pattern repeats (a swizzled tile starts on a multiple).
inline unsigned swizzle_repeat(Swizzle s) {
    return s == Swizzle::B128 ? 1024 : s == Swizzle::B64 ? 512 : s == Swizzle::B32 ? 256 : 16;
}

// The physical address of logical byte address a under a swizzle mode.
inline unsigned swizzled(unsigned a, Swizzle s) {
    switch (s) {
        case Swizzle::B128: return a ^ (((a >> 7) & 7u) << 4);
        case Swizzle::B64: return a ^ (((a >> 7) & 3u) << 4);
        case Swizzle::B32: return a ^ (((a >> 7) & 1u) << 4);
        default: return a;
    }
}

// ---- mbarriers: keyed by shared address, reset with every block ---------------------------
struct Mbar {
    unsigned expected, pending;
    long long tx;
    unsigned phase;  // completed phases; its parity is the current phase's complement's
};
struct TmaCopy {
    std::vector<std::pair<unsigned, std::array<unsigned char, 16>>> chunks;  // (address, bytes)
    unsigned bytes;
};
inline std::map<unsigned, Mbar> g_mbars;
inline std::multimap<unsigned, TmaCopy> g_tma_pending;  // by mbarrier address

inline Mbar* mbar_at(unsigned addr) {
    auto it = g_mbars.find(addr);
    if (it == g_mbars.end()) {
        ++g_hopper_faults;
        return nullptr;
    }
    return &it->second;
}
// The phase completes when every expected arrival came and every expected byte landed.
inline void mbar_settle(Mbar& m) {
    if (m.pending == 0 && m.tx == 0) {
        ++m.phase;
        m.pending = m.expected;
        ++g_progress;
    }
}
inline void mbar_init(void* bar, unsigned count) {
    const unsigned a = smem_addr(bar);
    g_mbars[a] = Mbar{count, count, 0, 0};
    std::memset(bar, 0, 8);  // the object occupies 8 bytes of shared memory
    ++g_progress;
}
inline void mbar_complete_tx(unsigned addr, unsigned bytes) {
    if (Mbar* m = mbar_at(addr)) {
        m->tx -= bytes;
        ++g_progress;
        mbar_settle(*m);
    }
}
inline void mbar_arrive_expect_tx(void* bar, unsigned bytes) {
    if (Mbar* m = mbar_at(smem_addr(bar))) {
        if (m->pending == 0) {
            ++g_hopper_faults;
            return;
        }
        m->tx += bytes;
        --m->pending;
        ++g_progress;
        mbar_settle(*m);
    }
}
inline void mbar_arrive(void* bar) { mbar_arrive_expect_tx(bar, 0); }

inline void tma_land(unsigned bar, const TmaCopy& c) {
    for (const auto& [addr, bytes] : c.chunks) std::memcpy(g_smem.data() + addr, bytes.data(), 16);
    mbar_complete_tx(bar, c.bytes);
}
// Whether the phase of parity `parity` has completed: the current phase has the other
// parity. Where the phase asked for is the current one, the copies it waits for land
// first (TmaLanding::Lazy).
inline bool mbar_try_wait_parity(void* bar, unsigned parity) {
    const unsigned a = smem_addr(bar);
    Mbar* m = mbar_at(a);
    if (m == nullptr) return true;
    if ((m->phase & 1u) != parity) return true;
    for (auto [it, end] = g_tma_pending.equal_range(a); it != end; it = g_tma_pending.erase(it)) tma_land(a, it->second);
    return (m->phase & 1u) != parity;
}
inline void mbar_wait_parity(void* bar, unsigned parity) {
    spin_until([&] { return mbar_try_wait_parity(bar, parity); });
}

// ---- TMA ---------------------------------------------------------------------------------
// cuTensorMapEncodeTiled's checks for a 2-D map: 0, or 1 (CUDA_ERROR_INVALID_VALUE).
inline int encode_tiled_2d(EmuTensorMap* m, unsigned elem, const void* base, unsigned long long dim0,
                           unsigned long long dim1, unsigned long long stride1, unsigned box0, unsigned box1,
                           Swizzle s) {
    const unsigned span = s == Swizzle::B128 ? 128 : s == Swizzle::B64 ? 64 : s == Swizzle::B32 ? 32 : 0;
    const bool ok = reinterpret_cast<std::uintptr_t>(base) % 16 == 0 && stride1 % 16 == 0 && stride1 < (1ull << 40) &&
                    dim0 >= 1 && dim1 >= 1 && dim0 <= (1ull << 32) && dim1 <= (1ull << 32) && box0 >= 1 &&
                    box1 >= 1 && box0 <= 256 && box1 <= 256 && (box0 * elem) % 16 == 0 &&
                    (span == 0 || box0 * elem <= span);
    if (!ok) return 1;
    *m = EmuTensorMap{static_cast<const unsigned char*>(base), {dim0, dim1}, stride1, {box0, box1}, elem, s};
    return 0;
}

// The box at (c0, c1) into shared memory at dst (128-byte aligned): box rows of box[0]
// elements back to back, each 16-byte chunk at its swizzled address; elements outside
// the tensor read as zero. The whole box's bytes complete on the mbarrier.
inline void tma_load_2d(void* dst, const EmuTensorMap* map, int c0, int c1, void* bar) {
    const unsigned d = smem_addr(dst), a = smem_addr(bar);
    if (d % 128 != 0) ++g_misaligned;
    if (d % swizzle_repeat(map->swizzle) != 0) ++g_hopper_faults;  // the pattern would start mid-way
    const unsigned row_bytes = map->box[0] * map->elem;
    TmaCopy c{{}, row_bytes * map->box[1]};
    for (unsigned y = 0; y < map->box[1]; ++y) {
        for (unsigned x = 0; x < row_bytes; x += 16) {
            std::array<unsigned char, 16> bytes{};
            for (unsigned e = 0; e < 16 / map->elem; ++e) {
                const long long gx = (long long)c0 + (x / map->elem) + e, gy = (long long)c1 + y;
                if (gx < 0 || gy < 0 || (unsigned long long)gx >= map->dims[0] || (unsigned long long)gy >= map->dims[1])
                    continue;
                std::memcpy(bytes.data() + e * map->elem, map->base + gy * map->stride1 + gx * map->elem, map->elem);
            }
            c.chunks.push_back({swizzled(d + y * row_bytes + x, map->swizzle), bytes});
        }
    }
    ++g_progress;
    if (g_tma_landing == TmaLanding::Eager)
        tma_land(a, c);
    else
        g_tma_pending.emplace(a, std::move(c));
}

// ---- wgmma -------------------------------------------------------------------------------
// Byte address of element (mn, k) of a 16-bit operand read through descriptor `desc`:
// K-major (tnsp 0: k contiguous) or MN-major (tnsp 1: mn contiguous), the layouts of
// CUTLASS's GMMA canonical atoms (T = 8 elements = 16 bytes, W = the swizzle's bytes):
//   K-major  none: ((8,m),(T,k)) : ((16 B, SBO),(2 B, LBO));   swizzled: ((8,m),(W/2)) : ((W, SBO),(2 B))
//   MN-major none: ((T,m),(8,k)) : ((2 B, SBO),(16 B, LBO));   swizzled: ((W/2,m),(8,k)) : ((2 B, LBO),(W, SBO))
inline unsigned desc_addr(unsigned long long desc, int mn, int k, int tnsp) {
    const unsigned start = (unsigned)(desc & 0x3fff) << 4, lbo = (unsigned)((desc >> 16) & 0x3fff) << 4;
    const unsigned sbo = (unsigned)((desc >> 32) & 0x3fff) << 4;
    const Swizzle s = static_cast<Swizzle>(desc >> 62);
    const unsigned W = s == Swizzle::B128 ? 128 : s == Swizzle::B64 ? 64 : s == Swizzle::B32 ? 32 : 0;
    if (W == 0)
        return tnsp ? start + (mn / 8) * sbo + (mn % 8) * 2 + (k / 8) * lbo + (k % 8) * 16
                    : start + (mn / 8) * sbo + (mn % 8) * 16 + (k / 8) * lbo + (k % 8) * 2;
    const unsigned a = tnsp ? start + (mn / (W / 2)) * lbo + (mn % (W / 2)) * 2 + (k % 8) * W + (k / 8) * sbo
                            : start + (mn / 8) * sbo + (mn % 8) * W + k * 2;
    return swizzled(a, s);
}

// One issued wgmma: what its warpgroup gave at issue (A as a 64x16 matrix from registers,
// or A's descriptor), read again at completion.
struct WgmmaOp {
    int n;
    bool a_regs;
    float a[64][16];
    unsigned long long desc_a, desc_b;
    int tnsp_a, tnsp_b, scale_d;
    float (*to_f)(unsigned short);
};
struct WgmmaPending {
    std::shared_ptr<WgmmaOp> op;
    float* d;
};
// A bulk reduction (cp.reduce.async.bulk .add.f32) not yet waited for: it reads its
// shared-memory source only at the wait, so a source rewritten before it is caught.
struct BulkReduce {
    float* dst;
    unsigned src, bytes;
};
struct WgmmaThread {
    std::vector<BulkReduce> bulk;                   // bulk reductions issued, not yet waited for
    std::vector<WgmmaPending> open;                 // issued, not yet committed
    std::deque<std::vector<WgmmaPending>> groups;  // committed, oldest first
    bool fenced = false;                            // a wgmma.fence since the last retired wgmma
};
struct Warpgroup {
    Barrier bar{128};
    Barrier named{128};  // bar.sync over the warpgroup (warpgroup_sync)
    unsigned a[128][4];
    unsigned long long desc[128][2];
    std::shared_ptr<WgmmaOp> op;
};
inline std::vector<WgmmaThread> g_wg_threads;
inline std::vector<std::unique_ptr<Warpgroup>> g_warpgroups;

inline WgmmaThread& wg_thread() {
    const unsigned t = threadIdx.x;
    if (g_wg_threads.size() <= t) g_wg_threads.resize(g_block_dim.x);
    return g_wg_threads[t];
}
inline Warpgroup& warpgroup() {
    const unsigned w = threadIdx.x / 128;
    while (g_warpgroups.size() <= w) g_warpgroups.push_back(std::make_unique<Warpgroup>());
    return *g_warpgroups[w];
}

inline float smem_elem(unsigned addr, float (*to_f)(unsigned short)) {
    if (addr + 2 > g_smem.size()) {
        ++g_hopper_faults;
        return 0.f;
    }
    unsigned short x;
    std::memcpy(&x, g_smem.data() + addr, 2);
    return to_f(x);
}

// The thread's accumulators of one retired wgmma: the D fragment of warp w of the
// warpgroup is rows 16w.., laid out as mma.m16n8k16's C per 8-column block j:
// d[4j + e] = (row 16w + g + 8 (e >= 2), col 8j + 2c + (e & 1)), g = lane / 4, c = lane % 4.
inline void wgmma_retire(const WgmmaPending& p, unsigned tid) {
    const WgmmaOp& op = *p.op;
    const int w = (tid % 128) / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    for (int j = 0; j < op.n / 8; ++j)
        for (int e = 0; e < 4; ++e) {
            const int row = 16 * w + g + (e >= 2 ? 8 : 0), col = 8 * j + 2 * c + (e & 1);
            float s = 0.f;
            for (int k = 0; k < 16; ++k) {
                const float a = op.a_regs ? op.a[row][k] : smem_elem(desc_addr(op.desc_a, row, k, op.tnsp_a), op.to_f);
                s += a * smem_elem(desc_addr(op.desc_b, col, k, op.tnsp_b), op.to_f);
            }
            p.d[4 * j + e] = (op.scale_d ? p.d[4 * j + e] : 0.f) + s;
        }
}

// wgmma.mma_async m64nNk16: every thread of the warpgroup gives its A fragment (a, or
// null with desc_a) and its accumulators d (N / 2 floats); the product lands at wait_group.
// A fragment layout (per warp w, rows 16w..): mma.m16n8k16's A.
inline void wgmma_issue(float* d, int n, const unsigned* a, unsigned long long desc_a, unsigned long long desc_b,
                        int scale_d, int tnsp_a, int tnsp_b, float (*to_f)(unsigned short)) {
    WgmmaThread& t = wg_thread();
    Warpgroup& wg = warpgroup();
    const unsigned l = threadIdx.x % 128;
    if (!t.fenced) ++g_hopper_faults;
    for (int i = 0; i < 4; ++i) wg.a[l][i] = a ? a[i] : 0u;
    wg.desc[l][0] = a ? 0 : desc_a;
    wg.desc[l][1] = desc_b;
    wg.bar.arrive_and_wait();
    if (l == 0) {
        auto op = std::make_shared<WgmmaOp>();
        *op = WgmmaOp{n, a != nullptr, {}, desc_a, desc_b, tnsp_a, tnsp_b, scale_d, to_f};
        for (int m = 0; m < 64 && a; ++m)
            for (int k = 0; k < 16; ++k) {
                const int owner = (m / 16) * 32 + (m % 8) * 4 + (k % 8) / 2;  // mma.m16n8k16's A
                const unsigned reg = wg.a[owner][(m % 16 >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
                op->a[m][k] = to_f((unsigned short)(k % 2 ? reg >> 16 : reg & 0xffffu));
            }
        for (int i = 0; i < 128; ++i)
            if (wg.desc[i][0] != wg.desc[0][0] || wg.desc[i][1] != wg.desc[0][1]) ++g_hopper_faults;
        // No base offset: a swizzled operand starts on its pattern's first row (a k-step
        // may move the start inside a row, never across one).
        auto off_pattern = [](unsigned long long desc) {
            const unsigned start = (unsigned)(desc & 0x3fff) << 4;
            return ((desc >> 49) & 7) != 0 || start % swizzle_repeat(static_cast<Swizzle>(desc >> 62)) >= 128;
        };
        if ((a == nullptr && off_pattern(desc_a)) || off_pattern(desc_b)) ++g_hopper_faults;
        wg.op = op;
    }
    wg.bar.arrive_and_wait();
    t.open.push_back({wg.op, d});
}
inline void wgmma_fence() { wg_thread().fenced = true; }
inline void wgmma_commit() {
    WgmmaThread& t = wg_thread();
    t.groups.push_back(std::move(t.open));
    t.open.clear();
}
// wgmma.wait_group n: every committed group but the newest n retires (after one yield, so
// the rest of the block runs between issue and completion).
inline void wgmma_wait(unsigned n) {
    WgmmaThread& t = wg_thread();
    if (t.groups.size() <= n) return;
    yield();
    const unsigned tid = threadIdx.x;
    while (t.groups.size() > n) {
        for (const WgmmaPending& p : t.groups.front()) wgmma_retire(p, tid);
        t.groups.pop_front();
        t.fenced = false;
    }
}

// bar.sync over the 128 threads of this thread's warpgroup.
inline void warpgroup_sync() { warpgroup().named.arrive_and_wait(); }
// cp.reduce.async.bulk.global.shared::cta .add.f32: dst and src 16-byte aligned, bytes a
// multiple of 16, src inside shared memory; performed at bulk_wait_read.
inline void bulk_reduce_add_f32(float* dst, const void* src, unsigned bytes) {
    const unsigned s = smem_addr(src);
    if (reinterpret_cast<std::uintptr_t>(dst) % 16 != 0 || s % 16 != 0 || bytes % 16 != 0) ++g_misaligned;
    if (s + bytes > g_smem.size()) {
        ++g_hopper_faults;
        return;
    }
    wg_thread().bulk.push_back({dst, s, bytes});
    ++g_progress;
}
// cp.async.bulk.wait_group.read 0: this thread's bulk reductions read their sources (and,
// here, add them) now, after one yield so the rest of the block runs first.
inline void bulk_wait_read() {
    WgmmaThread& t = wg_thread();
    if (t.bulk.empty()) return;
    yield();
    for (const BulkReduce& r : t.bulk) {
        float x[1];
        for (unsigned i = 0; i < r.bytes / 4; ++i) {
            std::memcpy(x, g_smem.data() + r.src + 4 * i, 4);
            r.dst[i] += x[0];
        }
    }
    t.bulk.clear();
}

// Block boundaries: a fresh Hopper state; work still in flight at the end is counted.
inline void hopper_block_start() {
    g_mbars.clear();
    g_tma_pending.clear();
    g_wg_threads.assign(g_block_dim.x, WgmmaThread{});
    g_warpgroups.clear();
}
inline void hopper_block_end() {
    bool open = !g_tma_pending.empty();
    for (const WgmmaThread& t : g_wg_threads)
        open = open || !t.open.empty() || !t.groups.empty() || !t.bulk.empty();
    if (open) ++g_hopper_unwaited;
    g_tma_pending.clear();
}
// Installs the block hooks (the harness calls this once).
inline void hopper_install() {
    g_block_start = hopper_block_start;
    g_block_end = hopper_block_end;
}
}  // namespace emu
