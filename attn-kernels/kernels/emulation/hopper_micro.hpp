// hopper_micro.hpp: runs ../hopper_micro.cu's micro-kernels on the emulator: every wgmma
// product (each swizzle mode, A from shared memory or registers, B K-major or MN-major,
// bf16 and f16) against a plain float64 product of the same rounded inputs, and a TMA load
// of a stride-r box (rows off + t r of a [rows][heads][d] tensor, d below the box, rows
// past the end) against the gather, each with TMA copies landing at issue and at the wait.
// With --plant, each case runs again with an error planted in the kernel's parameters (a
// stride byte offset 128 bytes off, the descriptor's swizzle another mode, the first wait
// on parity 1) and passes only when the check rejects it.
#pragma once

#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace hopper_micro {

inline const char* swizzle_name(Swizzle s) {
    return s == Swizzle::B128 ? "sw128" : s == Swizzle::B64 ? "sw64" : s == Swizzle::B32 ? "sw32" : "none";
}
inline unsigned row_bytes(Swizzle s) {
    return s == Swizzle::B128 ? 128 : s == Swizzle::B64 ? 64 : s == Swizzle::B32 ? 32 : 16;
}

enum class Plant { None, Sbo, Swizzle, Parity };
inline const char* plant_name(Plant p) {
    return p == Plant::Sbo ? " [planted: SBO +128]" : p == Plant::Swizzle ? " [planted: descriptor swizzle]"
                                                    : p == Plant::Parity  ? " [planted: wait parity 1]"
                                                                          : "";
}

// Whether every emulator check stayed clean (no misuse, nothing unwaited, no deadlock,
// no misaligned access); resets the counters.
inline bool clean_run() {
    const bool ok = emu::g_hopper_faults == 0 && emu::g_hopper_unwaited == 0 && emu::g_deadlocks == 0 &&
                    emu::g_misaligned == 0;
    emu::g_hopper_faults = emu::g_hopper_unwaited = emu::g_deadlocks = emu::g_misaligned = 0;
    return ok;
}

struct WgmmaCase {
    bool bf16;
    int n, k;
    Swizzle swz;
    bool a_regs, b_mn_major;
};

// One wgmma case: true when its product matches (or, planted, when it does not).
template <class E>
inline bool run_wgmma(const WgmmaCase& t, Plant plant, emu::TmaLanding landing) {
    const int N = t.n, K = t.k;
    std::mt19937_64 rng(77 + N * 3 + K);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<u16> a(64 * K), bt(N * K), bmn(K * N);  // A [64][K], B^T [N][K], B [K][N]
    for (auto& x : a) x = E::from_f(nd(rng));
    for (int n = 0; n < N; ++n)
        for (int k = 0; k < K; ++k) bmn[k * N + n] = bt[n * K + k] = E::from_f(nd(rng));
    const unsigned half = row_bytes(t.swz) / 2;
    EmuTensorMap am{}, bm{};
    int bad = emu::encode_tiled_2d(&am, 2, a.data(), K, 64, K * 2, half, 64, t.swz);
    bad |= t.b_mn_major ? emu::encode_tiled_2d(&bm, 2, bmn.data(), N, K, N * 2, half, K, t.swz)
                        : emu::encode_tiled_2d(&bm, 2, bt.data(), K, N, K * 2, half, N, t.swz);
    std::vector<float> c(64 * N, -1.f);
    const Swizzle other = t.swz == Swizzle::B128 ? Swizzle::B64 : Swizzle::B128;
    WgmmaMicroParams p{&am, &bm, a.data(), c.data(), K, t.a_regs, t.b_mn_major, (u32)t.swz,
                       (u32)(plant == Plant::Swizzle ? other : t.swz), plant == Plant::Sbo ? 128u : 0u,
                       plant == Plant::Parity ? 1u : 0u};
    emu::g_tma_landing = landing;
    const bool bf = t.bf16;
    emu::launch(Dim3{1, 1, 1}, 128, [&] {
        if (bf && N == 64) wgmma_micro_bf16_n64(p);
        else if (bf) wgmma_micro_bf16_n128(p);
        else if (N == 32) wgmma_micro_f16_n32(p);
        else wgmma_micro_f16_n64(p);
    });
    double worst = 0;
    for (int m = 0; m < 64; ++m)
        for (int n = 0; n < N; ++n) {
            double want = 0, mag = 0;
            for (int k = 0; k < K; ++k) {
                const double x = E::to_f(a[m * K + k]) * (double)E::to_f(bt[n * K + k]);
                want += x;
                mag += std::abs(x);
            }
            // f32 accumulation of K products: 2K unit roundoffs of the magnitude.
            const double err = std::abs(c[m * N + n] - want) / (2 * K * std::ldexp(1.0, -24) * (mag + 1e-30));
            worst = std::max(worst, std::isfinite(err) ? err : INFINITY);
        }
    const bool clean = clean_run(), ok = bad == 0 && clean && worst <= 1;
    const bool pass = plant == Plant::None ? ok : !ok;
    std::printf("%-4s hopper wgmma %s m64n%dk16 K%d %s A %s B %s, TMA %s%s: worst %.2g of the bound%s\n",
                pass ? "ok" : "FAIL", bf ? "bf16" : "f16", N, K, swizzle_name(t.swz), t.a_regs ? "regs" : "smem",
                t.b_mn_major ? "MN-major" : "K-major", landing == emu::TmaLanding::Lazy ? "at wait" : "at issue",
                plant_name(plant), worst, clean ? "" : " (emulator faults)");
    return pass;
}

// A stride-r box: rows off + (c1 + i) r of head h of a [rows][heads][d] tensor, columns
// past d and rows past the tensor zero, against the gather.
inline bool run_tma(Swizzle swz, Plant plant, emu::TmaLanding landing) {
    const int rows = 100, heads = 3, d = 40, r = 3, off = 2, h = 1, c1 = 20;
    const int cols = (int)row_bytes(swz) / 2, box_rows = 24;
    std::mt19937_64 rng(5);
    std::vector<u16> x((size_t)rows * heads * d);
    for (auto& v : x) v = (u16)(rng() & 0x7fff);
    const i64 ss = (i64)heads * d, count = (rows - off + r - 1) / r;
    EmuTensorMap m{};
    const int bad =
        emu::encode_tiled_2d(&m, 2, x.data() + off * ss + h * d, d, count, r * ss * 2, cols, box_rows, swz);
    std::vector<u16> out((size_t)box_rows * cols, 0xffff);
    TmaMicroParams p{&m, out.data(), box_rows, cols, c1, (u32)swz, plant == Plant::Parity ? 1u : 0u};
    emu::g_tma_landing = landing;
    emu::launch(Dim3{1, 1, 1}, 128, [&] { tma_micro_b16(p); });
    int wrong = 0;
    for (int i = 0; i < box_rows; ++i)
        for (int col = 0; col < cols; ++col) {
            const i64 t = c1 + i, row = off + t * r;
            const u16 want = col < d && row < rows ? x[row * ss + h * d + col] : 0;
            wrong += out[i * cols + col] != want;
        }
    const bool clean = clean_run(), ok = bad == 0 && clean && wrong == 0;
    const bool pass = plant == Plant::None ? ok : !ok;
    std::printf("%-4s hopper tma stride-r box r%d off%d d%d of %d cols %s, TMA %s%s: %d elements wrong%s\n",
                pass ? "ok" : "FAIL", r, off, d, cols, swizzle_name(swz),
                landing == emu::TmaLanding::Lazy ? "at wait" : "at issue", plant_name(plant), wrong,
                clean ? "" : " (emulator faults)");
    return pass;
}

// Runs the cases whose name has `only` (all for ""): (ran, failed). Planted: each case with
// each of its plants, TMA landing at the wait (where a wrong parity reads stale memory).
inline std::pair<int, int> run_all(const std::string& only, bool plant) {
    const std::vector<WgmmaCase> wg = {
        {true, 64, 32, Swizzle::None, false, false},  {true, 64, 64, Swizzle::B128, false, false},
        {true, 64, 32, Swizzle::B64, false, false},   {true, 64, 32, Swizzle::B32, false, false},
        {true, 128, 64, Swizzle::B128, true, false},  {true, 64, 64, Swizzle::B128, false, true},
        {false, 64, 32, Swizzle::B64, true, true},    {false, 32, 16, Swizzle::B32, false, true},
        {false, 64, 32, Swizzle::None, true, true},   {false, 64, 128, Swizzle::B128, false, false},
    };
    if (!(only.empty() || only.rfind("hopper", 0) == 0 || std::string("hopper").rfind(only, 0) == 0)) return {0, 0};
    emu::hopper_install();
    int ran = 0, failed = 0;
    auto count = [&](bool ok) { ++ran, failed += ok ? 0 : 1; };
    const std::vector<emu::TmaLanding> landings =
        plant ? std::vector<emu::TmaLanding>{emu::TmaLanding::Lazy}
              : std::vector<emu::TmaLanding>{emu::TmaLanding::Lazy, emu::TmaLanding::Eager};
    const std::vector<Plant> plants = plant ? std::vector<Plant>{Plant::Sbo, Plant::Swizzle, Plant::Parity}
                                            : std::vector<Plant>{Plant::None};
    for (emu::TmaLanding l : landings)
        for (Plant pl : plants) {
            for (const WgmmaCase& t : wg) count(t.bf16 ? run_wgmma<BF16E>(t, pl, l) : run_wgmma<F16E>(t, pl, l));
            if (pl == Plant::None || pl == Plant::Parity)
                for (Swizzle s : {Swizzle::B128, Swizzle::B64, Swizzle::None}) count(run_tma(s, pl, l));
        }
    emu::g_tma_landing = emu::TmaLanding::Lazy;
    return {ran, failed};
}

}  // namespace hopper_micro
