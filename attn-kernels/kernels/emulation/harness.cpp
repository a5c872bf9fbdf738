// harness.cpp: checks the CUDA kernels (../*.cu, compiled here as C++ on the CPU through
// emu_runtime.hpp) against the float64 reference of reference.hpp (docs/definition.md):
// forward out + lse and dq/dk/dv, f32 (row kernels), f16/bf16 (mma.sync kernels), both
// mixing modes, causal, ragged tails, w > n, strided (fused-QKV) inputs, the block API
// (q block at an offset, key blocks merged in reverse order), and the attention features:
// grouped k/v heads, key padding (padded keys must get exactly zero dk/dv), packed
// sequences (split into per-sequence launches as src/cuda/exec/block.rs does), windows and
// block masks (ragged last block, causal, one mask per head; the row kernels and the
// tensor-core `_bm_` instances, which a masked launch takes whatever the stages or tiles).
//
// Then the Hopper micro-kernels (hopper_micro.hpp: wgmma through each swizzle mode, a
// stride-r TMA box; with --plant, a wrong descriptor field, swizzle and mbarrier parity).
//
// Build and run (no GPU, no CUDA toolkit):
//   g++ -std=c++20 -O2 -pthread attn-kernels/kernels/emulation/harness.cpp -o /tmp/attn-emu && /tmp/attn-emu
// An optional argument runs only the cases whose name contains it (after `--stages 3`,
// which runs the three-stage tensor-core forward, `--hopper`, which runs the sm_90a forward
// and backward where a launch can take them, and `--bwd-queries 64`, which runs the
// backward with 64-row query tiles); `--plant [NAME]` first
// plants errors in each case's results (two rows of out swapped, one LSE off by 0.01; a
// block-masked case also runs its forward with the mask ignored; with `--hopper` also two
// rows of each of dq, dk and dv swapped) and passes only when the
// row-wise judge rejects every one. Each result is judged whole
// (relative L2) and row by row as attn-testkit's `judge` does: every [head_dim] row within
// a bound from its own magnitude, every LSE within f32 accuracy of its. Not detected here:
// races from a missing __syncthreads / cp.async wait (copies are synchronous and the CUDA
// threads are fibers that run one at a time, switching only at barriers).
#include "emu_runtime.hpp"
#include "emu_hopper.hpp"
#include "reference.hpp"
#include "judge.hpp"

#include "../prelude.cu"
#include "../dilated_rows.cu"
#include "../mma_tiles.cu"
#include "../attend_tile.cu"
#include "../dilated_fwd_mma.cu"
#include "../dilated_fwd_mma3.cu"
#include "../dilated_bwd_mma.cu"
#include "../epilogue.cu"
#include "../tma_mbarrier.cu"
#include "../wgmma.cu"
#include "../hopper_micro.cu"
#include "../dilated_fwd_wgmma.cu"
#include "../dilated_bwd_wgmma.cu"
#include "hopper_micro.hpp"
#include "hopper_plan.hpp"

#include <cstdio>
#include <random>
#include <string>


// ---- host side: the launch plan of src/cuda/exec/block.rs -----------------------------------
struct Launch {
    i64 w, r, fixed_off;
    int h0, h1;
};

static std::vector<Launch> launches(const Cfg& c, int heads) {
    // One whole-sequence pattern, its length capped at 2^31 - 1 as params.rs does (the
    // kernels' index divisions run in 32 bits).
    if (c.window) return {{0x7fffffff, 1, 0, 0, heads}};
    const int G = (int)c.w.size();
    std::vector<Launch> v;
    for (int i = 0; i < G; ++i) {
        if (c.longnet) {
            v.push_back({c.w[i], c.r[i], -1, 0, heads});
        } else {
            const int base = heads / G, extra = heads % G;
            const int start = i * base + std::min(i, extra), end = start + base + (i < extra ? 1 : 0);
            if (end > start) v.push_back({c.w[i], c.r[i], i % c.r[i], start, end});
        }
    }
    return v;
}

static i64 max_selected(const Launch& l, i64 start, i64 rows) {
    i64 best = 0;
    for (int h = l.h0; h < l.h1; ++h) {
        Pattern p;
        p.w = l.w; p.r = l.r; p.off = l.fixed_off >= 0 ? l.fixed_off : h % l.r; p.per_seg = (p.w - p.off + p.r - 1) / p.r;
        best = std::max(best, sel_below(p, start + rows) - sel_below(p, start));
    }
    return best;
}

// Head sweeps of a launch: (first head, count, step). The backward steps by the group so
// that no two blocks of one launch write the same key/value head's dk/dv rows.
struct Sweep {
    int head0, count, step;
};

static std::vector<Sweep> sweeps(const Launch& l, int group) {
    if (group == 1) return {{l.h0, l.h1 - l.h0, 1}};
    std::vector<Sweep> v;
    for (int j = 0; j < group; ++j) {
        const int first = l.h0 + ((j - l.h0 % group) % group + group) % group;
        if (first < l.h1) v.push_back({first, (l.h1 - 1 - first) / group + 1, group});
    }
    return v;
}

// A strided [B][rows][heads][D] view of a storage buffer.
template <class S>
struct View {
    S* data;
    i64 sb, ss, sh;
    int rows;
    View at(int row, int n) const { return View{data + (i64)row * ss, sb, ss, sh, n}; }
};

static int padded(int d, const std::vector<int>& dims) {
    for (int p : dims)
        if (p >= d) return p;
    return -1;
}

// A (q block, k block) pair split by packed sequence: block rows [qa, qb) x [ka, kb) of the
// sequence starting at global position s0 (one piece, s0 = 0, without packing).
struct Piece {
    int qa, qb, ka, kb, s0;
};

static std::vector<Piece> pieces(const Feat& f, int q_start, int nq, int k_start, int nk) {
    if (f.cu.empty()) return {{0, nq, 0, nk, 0}};
    std::vector<Piece> v;
    for (size_t i = 0; i + 1 < f.cu.size(); ++i) {
        const int c0 = f.cu[i], c1 = f.cu[i + 1];
        const int q0 = std::max(q_start, c0), q1 = std::min(q_start + nq, c1);
        const int k0 = std::max(k_start, c0), k1 = std::min(k_start + nk, c1);
        if (q0 < q1 && k0 < k1) v.push_back({q0 - q_start, q1 - q_start, k0 - k_start, k1 - k_start, c0});
    }
    return v;
}

// The parameters every launch of a piece shares (attn_params in src/cuda/plan/params.rs).
template <class S>
static AttnParams piece_params(const Cfg& c, const Feat& f, int B, int N, int H, int D, View<S> q, int q_pos,
                               View<S> k, View<S> v, int k_pos, const Launch& l) {
    const int KH = f.kv_heads > 0 ? f.kv_heads : H;
    AttnParams a{};
    a.q_sb = q.sb; a.q_ss = q.ss; a.q_sh = q.sh;
    a.k_sb = k.sb; a.k_ss = k.ss; a.k_sh = k.sh;
    a.v_sb = v.sb; a.v_ss = v.ss; a.v_sh = v.sh;
    a.nq = q.rows; a.nk = k.rows;
    a.heads = H; a.kv_heads = KH; a.kv_group = H / KH; a.head0 = l.h0; a.head_step = 1;
    a.w = l.w; a.r = l.r; a.fixed_off = l.fixed_off; a.d = D;
    // The band in selected indices of the launch's pattern (positions / r).
    a.band_left = c.window ? c.wl / l.r : -1;
    a.band_right = c.causal ? 0 : c.window ? c.wr / l.r : -1;
    // The mask is [B][N] over global key positions: row 0 of this k block is k_pos.
    a.kpad = f.pad.empty() ? nullptr : f.pad.data() + k_pos;
    a.kpad_sb = N;
    // The block mask is on global positions (no packing in its cases), one for every batch row.
    const i64 nbk = f.bm.empty() ? 0 : (N + f.bm_size - 1) / f.bm_size;
    a.bmask = f.bm.empty() ? nullptr : f.bm.data();
    a.bm_sb = 0, a.bm_sh = f.bm_heads > 1 ? nbk * nbk : 0, a.bm_nbk = nbk, a.bm_size = f.bm_size;
    a.scale = (float)(1.0 / std::sqrt((double)D));
    a.out_scale = c.longnet || c.window ? 1.f : 1.f / (float)c.w.size();
    auto vec_ok = [&](i64 sb, i64 ss, i64 sh) { return D % 8 == 0 && sb % 8 == 0 && ss % 8 == 0 && sh % 8 == 0; };
    a.vec = (vec_ok(q.sb, q.ss, q.sh) ? 1 : 0) | (vec_ok(k.sb, k.ss, k.sh) ? 2 : 0) | (vec_ok(v.sb, v.ss, v.sh) ? 4 : 0);
    (void)B;
    return a;
}

// K/V stages of the tensor-core forward the cases run (`--stages 3`: dilated_fwd_mma3.cu).
static int g_fwd_stages = 2;
// `--hopper`: f16/bf16 forward launches the sm_90a kernel can take run it (the others, and
// every launch without the flag, the mma.sync kernels); counted per case.
static bool g_hopper = false;
// `--bwd-queries 64`: the tensor-core backward with query tiles of 64 rows (the q64 kernels).
static bool g_bwd_q64 = false;
static int g_hopper_launches = 0, g_fwd_launches = 0, g_hopper_bwd_launches = 0, g_bwd_launches = 0;

// Forward of a block: q rows at global position q_pos, k/v rows at k_pos, merged into
// (o_acc, lse_acc) of the q block.
template <class E>
static void fwd_block(DT dt, const Cfg& c, const Feat& f, int B, int N, int H, int D, View<typename E::S> q,
                      int q_pos, View<typename E::S> k, View<typename E::S> v, int k_pos, float* o_acc, float* lse_acc) {
    typedef typename E::S S;
    const int pd = dt == DT::F32 ? -1 : padded(D, {32, 64, 128, 256});
    for (const Piece& pc : pieces(f, q_pos, q.rows, k_pos, k.rows)) {
        const View<S> qp = q.at(pc.qa, pc.qb - pc.qa), kp = k.at(pc.ka, pc.kb - pc.ka), vp = v.at(pc.ka, pc.kb - pc.ka);
        float* o = o_acc + (size_t)pc.qa * H * D;  // packing has batch 1: row offsets suffice
        float* lse = lse_acc + (size_t)pc.qa * H;
        for (const Launch& l : launches(c, H)) {
            AttnParams a = piece_params(c, f, B, N, H, D, qp, q_pos + pc.qa, kp, vp, k_pos + pc.ka, l);
            a.q_start = q_pos + pc.qa - pc.s0;
            a.k_start = k_pos + pc.ka - pc.s0;
            const i64 rows = max_selected(l, a.q_start, qp.rows);
            const int per_block = pd > 0 ? 64 : 4;
            const Dim3 grid{(unsigned)((rows + per_block - 1) / per_block), (unsigned)(l.h1 - l.h0), (unsigned)B};
            if (grid.x == 0) continue;
            const S *qd = qp.data, *kd = kp.data, *vd = vp.data;
            ++g_fwd_launches;
            if constexpr (!std::is_same_v<E, F32E>) {
                std::vector<EmuTensorMap> maps;
                if (g_hopper && f.bm.empty() && hopper_plan::encode_maps(a, B, l.h1 - l.h0, pd, qd, kd, vd, &maps)) {
                    hopper_plan::launch_fwd<E>(grid, pd, qd, kd, vd, o, lse, a, maps.data());
                    ++g_hopper_launches;
                    continue;
                }
            }
            if constexpr (std::is_same_v<E, F32E>) {
                emu::launch(grid, 128, [=] { dilated_fwd_rows_f32(qd, kd, vd, o, lse, a); });
            } else {
                constexpr bool bf = std::is_same_v<E, BF16E>;
                const bool three = g_fwd_stages == 3, bm = !f.bm.empty();
                emu::launch(grid, 128, [=] {
                    if (bm) {  // a block mask takes the `_bm_` instances whatever the stages
                        switch (pd) {
                            case 32: bf ? dilated_fwd_mma_bm_bf16_d32(qd, kd, vd, o, lse, a) : dilated_fwd_mma_bm_f16_d32(qd, kd, vd, o, lse, a); break;
                            case 64: bf ? dilated_fwd_mma_bm_bf16_d64(qd, kd, vd, o, lse, a) : dilated_fwd_mma_bm_f16_d64(qd, kd, vd, o, lse, a); break;
                            case 128: bf ? dilated_fwd_mma_bm_bf16_d128(qd, kd, vd, o, lse, a) : dilated_fwd_mma_bm_f16_d128(qd, kd, vd, o, lse, a); break;
                            default: bf ? dilated_fwd_mma_bm_bf16_d256(qd, kd, vd, o, lse, a) : dilated_fwd_mma_bm_f16_d256(qd, kd, vd, o, lse, a); break;
                        }
                        return;
                    }
                    switch (pd) {
                        case 32: three ? (bf ? dilated_fwd_mma3_bf16_d32(qd, kd, vd, o, lse, a) : dilated_fwd_mma3_f16_d32(qd, kd, vd, o, lse, a))
                                       : (bf ? dilated_fwd_mma_bf16_d32(qd, kd, vd, o, lse, a) : dilated_fwd_mma_f16_d32(qd, kd, vd, o, lse, a)); break;
                        case 64: three ? (bf ? dilated_fwd_mma3_bf16_d64(qd, kd, vd, o, lse, a) : dilated_fwd_mma3_f16_d64(qd, kd, vd, o, lse, a))
                                       : (bf ? dilated_fwd_mma_bf16_d64(qd, kd, vd, o, lse, a) : dilated_fwd_mma_f16_d64(qd, kd, vd, o, lse, a)); break;
                        case 128: three ? (bf ? dilated_fwd_mma3_bf16_d128(qd, kd, vd, o, lse, a) : dilated_fwd_mma3_f16_d128(qd, kd, vd, o, lse, a))
                                        : (bf ? dilated_fwd_mma_bf16_d128(qd, kd, vd, o, lse, a) : dilated_fwd_mma_f16_d128(qd, kd, vd, o, lse, a)); break;
                        default: three ? (bf ? dilated_fwd_mma3_bf16_d256(qd, kd, vd, o, lse, a) : dilated_fwd_mma3_f16_d256(qd, kd, vd, o, lse, a))
                                       : (bf ? dilated_fwd_mma_bf16_d256(qd, kd, vd, o, lse, a) : dilated_fwd_mma_f16_d256(qd, kd, vd, o, lse, a)); break;
                    }
                });
            }
        }
    }
}

// Backward of the whole call (q and k/v blocks at position 0).
template <class E>
static void bwd_call(DT dt, const Cfg& c, const Feat& f, int B, int N, int H, int D, View<typename E::S> q,
                     View<typename E::S> k, View<typename E::S> v, View<typename E::S> g, const float* lse_all,
                     const float* delta_all, float* dq_all, float* dk_all, float* dv_all) {
    typedef typename E::S S;
    const int pd = dt == DT::F32 ? -1 : padded(D, {32, 64, 128});
    const int KH = f.kv_heads > 0 ? f.kv_heads : H;
    for (const Piece& pc : pieces(f, 0, q.rows, 0, k.rows)) {
        const View<S> qv = q.at(pc.qa, pc.qb - pc.qa), kv = k.at(pc.ka, pc.kb - pc.ka), vv = v.at(pc.ka, pc.kb - pc.ka);
        const View<S> gv = g.at(pc.qa, pc.qb - pc.qa);
        const float *lse = lse_all + (size_t)pc.qa * H, *delta = delta_all + (size_t)pc.qa * H;
        float* dq = dq_all + (size_t)pc.qa * H * D;
        float *dk = dk_all + (size_t)pc.ka * KH * D, *dv = dv_all + (size_t)pc.ka * KH * D;
        for (const Launch& l : launches(c, H)) {
            AttnParams a = piece_params(c, f, B, N, H, D, qv, pc.qa, kv, vv, pc.ka, l);
            a.g_sb = gv.sb; a.g_ss = gv.ss; a.g_sh = gv.sh;
            a.q_start = pc.qa - pc.s0;
            a.k_start = pc.ka - pc.s0;
            const bool g_vec = D % 8 == 0 && gv.sb % 8 == 0 && gv.ss % 8 == 0 && gv.sh % 8 == 0;
            a.vec |= g_vec ? 8 : 0;
            const S *qp = qv.data, *kp = kv.data, *vp = vv.data, *gp = gv.data;
            const i64 qrows = max_selected(l, a.q_start, qv.rows), krows = max_selected(l, a.k_start, kv.rows);
            for (const Sweep& sw : sweeps(l, H / KH)) {
                a.head0 = sw.head0;
                a.head_step = sw.step;
                const unsigned hy = (unsigned)sw.count;
                ++g_bwd_launches;
                if constexpr (!std::is_same_v<E, F32E>) {
                    std::vector<EmuTensorMap> maps;
                    if (g_hopper && pd > 0 && f.bm.empty() &&
                        hopper_plan::encode_bwd_maps(a, B, sw.count, pd, qp, kp, vp, gp, &maps)) {
                        const Dim3 grid{(unsigned)((krows + 63) / 64), hy, (unsigned)B};
                        if (grid.x > 0)
                            hopper_plan::launch_bwd<E>(grid, pd, qp, kp, vp, gp, lse, delta, dq, dk, dv, a, maps.data());
                        ++g_hopper_bwd_launches;
                        continue;
                    }
                }
                if (pd > 0) {
                    constexpr bool bf = std::is_same_v<E, BF16E>;
                    const bool q64 = g_bwd_q64, bm = !f.bm.empty();
                    emu::launch(Dim3{(unsigned)((krows + 63) / 64), hy, (unsigned)B}, 128, [=] {
                        if constexpr (!std::is_same_v<E, F32E>) {
                            if (bm) {  // the `_bm_` instances (32-query tiles) whatever the query tiles
                                switch (pd) {
                                    case 32: bf ? dilated_bwd_mma_bm_bf16_d32(qp, kp, vp, gp, lse, delta, dq, dk, dv, a) : dilated_bwd_mma_bm_f16_d32(qp, kp, vp, gp, lse, delta, dq, dk, dv, a); break;
                                    case 64: bf ? dilated_bwd_mma_bm_bf16_d64(qp, kp, vp, gp, lse, delta, dq, dk, dv, a) : dilated_bwd_mma_bm_f16_d64(qp, kp, vp, gp, lse, delta, dq, dk, dv, a); break;
                                    default: bf ? dilated_bwd_mma_bm_bf16_d128(qp, kp, vp, gp, lse, delta, dq, dk, dv, a) : dilated_bwd_mma_bm_f16_d128(qp, kp, vp, gp, lse, delta, dq, dk, dv, a); break;
                                }
                                return;
                            }
                            if (q64) {
                                switch (pd) {
                                    case 32: bf ? dilated_bwd_mma_q64_bf16_d32(qp, kp, vp, gp, lse, delta, dq, dk, dv, a) : dilated_bwd_mma_q64_f16_d32(qp, kp, vp, gp, lse, delta, dq, dk, dv, a); break;
                                    case 64: bf ? dilated_bwd_mma_q64_bf16_d64(qp, kp, vp, gp, lse, delta, dq, dk, dv, a) : dilated_bwd_mma_q64_f16_d64(qp, kp, vp, gp, lse, delta, dq, dk, dv, a); break;
                                    default: bf ? dilated_bwd_mma_q64_bf16_d128(qp, kp, vp, gp, lse, delta, dq, dk, dv, a) : dilated_bwd_mma_q64_f16_d128(qp, kp, vp, gp, lse, delta, dq, dk, dv, a); break;
                                }
                                return;
                            }
                            switch (pd) {
                                case 32: bf ? dilated_bwd_mma_bf16_d32(qp, kp, vp, gp, lse, delta, dq, dk, dv, a) : dilated_bwd_mma_f16_d32(qp, kp, vp, gp, lse, delta, dq, dk, dv, a); break;
                                case 64: bf ? dilated_bwd_mma_bf16_d64(qp, kp, vp, gp, lse, delta, dq, dk, dv, a) : dilated_bwd_mma_f16_d64(qp, kp, vp, gp, lse, delta, dq, dk, dv, a); break;
                                default: bf ? dilated_bwd_mma_bf16_d128(qp, kp, vp, gp, lse, delta, dq, dk, dv, a) : dilated_bwd_mma_f16_d128(qp, kp, vp, gp, lse, delta, dq, dk, dv, a); break;
                            }
                        }
                    });
                } else {
                    auto dqk = [&](auto f_dq, auto f_dkv) {
                        emu::launch(Dim3{(unsigned)((qrows + 3) / 4), hy, (unsigned)B}, 128, [=] { f_dq(qp, kp, vp, gp, lse, delta, dq, a); });
                        emu::launch(Dim3{(unsigned)((krows + 3) / 4), hy, (unsigned)B}, 128, [=] { f_dkv(qp, kp, vp, gp, lse, delta, dk, dv, a); });
                    };
                    if constexpr (std::is_same_v<E, F32E>) dqk(dilated_bwd_dq_rows_f32, dilated_bwd_dkv_rows_f32);
                    else if constexpr (std::is_same_v<E, F16E>) dqk(dilated_bwd_dq_rows_f16, dilated_bwd_dkv_rows_f16);
                    else dqk(dilated_bwd_dq_rows_bf16, dilated_bwd_dkv_rows_bf16);
                }
            }
        }
    }
}

// `--plant`: errors put into each case's results, which the row judge must reject.
static bool g_plant = false;

// ---- one test case ------------------------------------------------------------------------
struct Case {
    std::string name;
    DT dt;
    Cfg cfg;
    int B, N, H, D;
    bool fused_qkv;   // q, k, v interleaved as [B][N][3][H][D]
    int q_start;      // forward through the block API: q rows [q_start, N), keys in two blocks
    int split;        // key block boundary (merged [split, N) first, then [0, split))
    Feat feat = {};
};

template <class E>
static bool run_case(const Case& t) {
    typedef typename E::S S;
    const int B = t.B, N = t.N, H = t.H, D = t.D;
    const Feat& f = t.feat;
    const int KH = f.kv_heads > 0 ? f.kv_heads : H;
    const size_t numel = (size_t)B * N * H * D, kv_numel = (size_t)B * N * KH * D, rows = (size_t)B * N * H;
    std::mt19937_64 rng(1234 + N * 7 + D);
    std::normal_distribution<float> nd(0.f, 1.f);
    // Inputs rounded to the dtype; the reference sees the rounded values.
    std::vector<S> qkv(t.fused_qkv ? numel * 3 : numel + 2 * kv_numel), go(numel);
    for (auto& x : qkv) x = E::from_f(nd(rng));
    for (auto& x : go) x = E::from_f(nd(rng));
    const i64 row3 = 3LL * H * D;
    auto view = [&](int part) -> View<S> {
        if (t.fused_qkv) return View<S>{qkv.data() + part * H * D, N * row3, row3, D, N};
        if (part == 0) return View<S>{qkv.data(), (i64)N * H * D, (i64)H * D, D, N};
        return View<S>{qkv.data() + numel + (part - 1) * kv_numel, (i64)N * KH * D, (i64)KH * D, D, N};
    };
    auto to_d = [&](View<S> vw, int heads) {
        std::vector<double> out((size_t)B * N * heads * D);
        for (int b = 0; b < B; ++b)
            for (int s = 0; s < N; ++s)
                for (int h = 0; h < heads; ++h)
                    for (int e = 0; e < D; ++e)
                        out[(((size_t)b * N + s) * heads + h) * D + e] = E::to_f(vw.data[b * vw.sb + s * vw.ss + h * vw.sh + e]);
        return out;
    };
    const View<S> q = view(0), k = view(1), v = view(2), g{go.data(), (i64)N * H * D, (i64)H * D, D, N};
    const Ref ref = reference(t.cfg, f, B, N, H, D, to_d(q, H), to_d(k, KH), to_d(v, KH), to_d(g, H));
    const float out_scale = t.cfg.longnet || t.cfg.window ? 1.f : 1.f / (float)t.cfg.w.size();

    // Forward, whole call (TMA copies of the sm_90a forward land at the wait for them).
    g_hopper_launches = g_fwd_launches = g_hopper_bwd_launches = g_bwd_launches = 0;
    emu::g_tma_landing = emu::TmaLanding::Lazy;
    std::vector<float> o_acc(numel, 0.f), lse(rows, -INFINITY);
    fwd_block<E>(t.dt, t.cfg, f, B, N, H, D, q, 0, k, v, 0, o_acc.data(), lse.data());
    std::vector<S> out(numel);
    RowParams rp{B, N, H, D, (i64)N * H * D, (i64)H * D, D, (i64)N * H * D, (i64)H * D, D, out_scale, 0};
    emu::launch(Dim3{(unsigned)((numel + 255) / 256), 1, 1}, 256, [&] {
        if constexpr (std::is_same_v<E, F32E>) store_rows_f32(o_acc.data(), out.data(), rp);
        else if constexpr (std::is_same_v<E, F16E>) store_rows_f16(o_acc.data(), out.data(), rp);
        else store_rows_bf16(o_acc.data(), out.data(), rp);
    });
    std::vector<float> outf(numel);
    for (size_t i = 0; i < numel; ++i) outf[i] = E::to_f(out[i]);
    // `--plant` with a block mask: the kernels run without it; the LSE judge must see the removed keys.
    if (g_plant && !f.bm.empty()) {
        Feat off = f;
        off.bm.clear();
        std::vector<float> o2(numel, 0.f), l2(rows, -INFINITY);
        fwd_block<E>(t.dt, t.cfg, off, B, N, H, D, q, 0, k, v, 0, o2.data(), l2.data());
        const double w = worst_lse(l2, ref.lse, ref.mlse);
        std::printf("%-4s %-58s planted: block mask ignored, worst lse row at %.1f of the bound\n", w > 1 ? "ok" : "FAIL", t.name.c_str(), w);
        if (!(w > 1)) return false;
    }
    // `--plant --hopper`: the forward's planted errors, then the gradients' (below).
    const bool fwd_planted = g_plant && planted_rejected(t.name, outf, lse, ref, D, t.dt);
    if (g_plant && (!g_hopper || !fwd_planted)) return fwd_planted;

    // Forward through the block API: q rows [q_start, N), key blocks merged in reverse order
    // (TMA copies land at issue).
    emu::g_tma_landing = emu::TmaLanding::Eager;
    const int qs = t.q_start, nq = N - qs;
    std::vector<float> bo((size_t)B * nq * H * D, 0.f), bl((size_t)B * nq * H, -INFINITY);
    const View<S> qb = q.at(qs, nq);
    for (auto [lo, hi] : {std::pair<int, int>{t.split, N}, std::pair<int, int>{0, t.split}}) {
        if (lo == hi) continue;
        fwd_block<E>(t.dt, t.cfg, f, B, N, H, D, qb, qs, k.at(lo, hi - lo), v.at(lo, hi - lo), lo, bo.data(), bl.data());
    }
    emu::g_tma_landing = emu::TmaLanding::Lazy;
    double block_err = 0;
    for (int b = 0; b < B; ++b)
        for (int s = qs; s < N; ++s)
            for (int h = 0; h < H; ++h) {
                const float want_l = lse[((size_t)b * N + s) * H + h], got_l = bl[((size_t)b * nq + (s - qs)) * H + h];
                if (std::isinf(want_l) != std::isinf(got_l)) block_err = INFINITY;
                for (int e = 0; e < D; ++e) {
                    const double want = o_acc[(((size_t)b * N + s) * H + h) * D + e];
                    const double got = bo[(((size_t)b * nq + (s - qs)) * H + h) * D + e];
                    block_err = std::max(block_err, std::abs(got - want));
                }
            }

    // Backward: delta, gradients (f32 accumulators), compared before rounding to the dtype.
    std::vector<float> delta(rows), dq(numel, 0.f), dk(kv_numel, 0.f), dv(kv_numel, 0.f);
    emu::launch(Dim3{(unsigned)((rows + 7) / 8), 1, 1}, 256, [&] {
        if constexpr (std::is_same_v<E, F32E>) delta_rows_f32(go.data(), out.data(), nullptr, lse.data(), delta.data(), rp);
        else if constexpr (std::is_same_v<E, F16E>) delta_rows_f16(go.data(), out.data(), nullptr, lse.data(), delta.data(), rp);
        else delta_rows_bf16(go.data(), out.data(), nullptr, lse.data(), delta.data(), rp);
    });
    bwd_call<E>(t.dt, t.cfg, f, B, N, H, D, q, k, v, g, lse.data(), delta.data(), dq.data(), dk.data(), dv.data());

    if (g_plant) {  // rows of dq, dk and dv swapped: the row judge must reject each
        std::string line;
        const bool rejected = planted_grad_rejected("dq", dq, ref.dq, ref.mdq, D, t.dt, &line) &
                              planted_grad_rejected("dk", dk, ref.dk, ref.mdk, D, t.dt, &line) &
                              planted_grad_rejected("dv", dv, ref.dv, ref.mdv, D, t.dt, &line);
        std::printf("%-4s %-58s planted gradients (sm_90a backward %d of %d launches):%s\n", rejected ? "ok" : "FAIL",
                    t.name.c_str(), g_hopper_bwd_launches, g_bwd_launches, line.c_str());
        return rejected;
    }
    const double tol = t.dt == DT::F32 ? 1e-5 : t.dt == DT::F16 ? 5e-3 : 4e-2;
    const double e_out = rel_l2(outf, ref.out), e_lse = lse_err(lse, ref.lse);
    const double e_dq = rel_l2(dq, ref.dq), e_dk = rel_l2(dk, ref.dk), e_dv = rel_l2(dv, ref.dv);
    // Padded keys get exactly zero gradient.
    bool pad_zero = true;
    for (int b = 0; b < B && !f.pad.empty(); ++b)
        for (int s = 0; s < N; ++s)
            if (f.pad[(size_t)b * N + s])
                for (size_t i = 0; i < (size_t)KH * D; ++i) {
                    const size_t at = ((size_t)b * N + s) * KH * D + i;
                    pad_zero = pad_zero && dk[at] == 0.f && dv[at] == 0.f;
                }
    // Whole call vs block API differ only by where P is rounded to the dtype (other running
    // maxima): allow 4 unit roundoffs of the dtype on these O(1) values.
    const double block_tol = t.dt == DT::F32 ? 1e-5 : t.dt == DT::F16 ? 4 * 4.9e-4 : 4 * 3.9e-3;
    // Row by row: the worst row of each result as a fraction of its bound.
    const RowBound rb = row_bound(t.dt);
    const double rows_worst = std::max({worst_row(outf, ref.out, ref.mout, D, rb), worst_lse(lse, ref.lse, ref.mlse),
                                        worst_row(dq, ref.dq, ref.mdq, D, rb), worst_row(dk, ref.dk, ref.mdk, D, rb),
                                        worst_row(dv, ref.dv, ref.mdv, D, rb)});
    const bool ok = e_out <= tol && e_lse <= 1e-4 && e_dq <= tol && e_dk <= tol && e_dv <= tol &&
                    block_err <= block_tol && pad_zero && rows_worst <= 1;
    std::printf("%-4s %-58s out %.2e lse %.2e dq %.2e dk %.2e dv %.2e block %.1e%s (tol %.0e), worst row %.2f",
                ok ? "ok" : "FAIL", t.name.c_str(), e_out, e_lse, e_dq, e_dk, e_dv, block_err, pad_zero ? "" : " PAD-GRAD",
                tol, rows_worst);
    if (g_hopper)
        std::printf(", sm_90a forward %d of %d launches, backward %d of %d", g_hopper_launches, g_fwd_launches,
                    g_hopper_bwd_launches, g_bwd_launches);
    std::printf("\n");
    return ok;
}

// A [B][N] key padding mask from a rule (true = padded).
template <class F>
static std::vector<unsigned char> pad_mask(int B, int N, F padded_at) {
    std::vector<unsigned char> m((size_t)B * N);
    for (int b = 0; b < B; ++b)
        for (int s = 0; s < N; ++s) m[(size_t)b * N + s] = padded_at(b, s) ? 1 : 0;
    return m;
}

int main(int argc, char** argv) {
    // Optional argument: run only the cases whose name contains it.
    int arg = 1;
    if (argc > arg && std::string(argv[arg]) == "--plant") g_plant = true, ++arg;
    if (argc > arg + 1 && std::string(argv[arg]) == "--stages") g_fwd_stages = std::atoi(argv[arg + 1]), arg += 2;
    if (argc > arg && std::string(argv[arg]) == "--hopper") g_hopper = true, ++arg;
    if (argc > arg + 1 && std::string(argv[arg]) == "--bwd-queries") g_bwd_q64 = std::atoi(argv[arg + 1]) == 64, arg += 2;
    emu::hopper_install();
    const std::string only = argc > arg ? argv[arg] : "";
    const std::vector<Case> cases = {
        {"f32 headgroups w[4,8] r[1,2] n19 h3 d8", DT::F32, {{4, 8}, {1, 2}, false, false}, 2, 19, 3, 8, false, 5, 7},
        {"f32 longnet causal w[4,8,16] r[1,2,4] d33", DT::F32, {{4, 8, 16}, {1, 2, 4}, true, true}, 1, 37, 2, 33, false, 0, 20},
        {"bf16 headgroups causal w[8,16] r[1,2] d16", DT::BF16, {{8, 16}, {1, 2}, false, true}, 1, 45, 2, 16, false, 9, 30},
        {"f16 longnet causal w[64,128] r[1,3] d64", DT::F16, {{64, 128}, {1, 3}, true, true}, 1, 200, 3, 64, false, 50, 90},
        {"bf16 longnet w>n w[64] r[2] d36 (scalar loads)", DT::BF16, {{64}, {2}, true, false}, 2, 30, 2, 36, false, 3, 11},
        {"bf16 headgroups w[32,64] r[1,2] d160 (bwd rows)", DT::BF16, {{32, 64}, {1, 2}, false, false}, 1, 70, 2, 160, false, 0, 35},
        {"f16 headgroups causal fused-qkv w[32,64] r[1,2] d128", DT::F16, {{32, 64}, {1, 2}, false, true}, 1, 100, 2, 128, true, 20, 64},
        {"f16 longnet w[130] r[1] d64 full tiles, ragged", DT::F16, {{130}, {1}, true, false}, 1, 150, 1, 64, false, 64, 64},
        {"bf16 headgroups b2 h5 G3 uneven w[16,32,48] r[1,2,4] d32", DT::BF16, {{16, 32, 48}, {1, 2, 4}, false, true}, 2, 61, 5, 32, false, 13, 40},
        {"bf16 longnet causal r4 offsets w[96] r[4] d128 h4", DT::BF16, {{96}, {4}, true, true}, 1, 170, 4, 128, false, 33, 100},
        {"bf16 longnet w[256,512] r[1,2] d64 (key tiles wrap the ring)", DT::BF16, {{256, 512}, {1, 2}, true, false}, 1, 600, 2, 64, false, 100, 300},
        // Features: grouped k/v heads, key padding, packed sequences, sliding windows.
        {"f32 gqa kv1 of h4 longnet causal w[4,8] r[1,2] d8", DT::F32, {{4, 8}, {1, 2}, true, true}, 2, 23, 4, 8, false, 5, 9, {1}},
        {"bf16 gqa kv2 of h8 headgroups w[8,16] r[1,2] d32", DT::BF16, {{8, 16}, {1, 2}, false, false}, 1, 40, 8, 32, false, 7, 20, {2}},
        {"f16 gqa kv1 of h8 headgroups causal G3 w[16,32,64] r[1,2,4] d64", DT::F16, {{16, 32, 64}, {1, 2, 4}, false, true}, 1, 90, 8, 64, false, 10, 50, {1}},
        {"f16 gqa kv2 of h4 longnet w[32] r[2] d128", DT::F16, {{32}, {2}, true, false}, 1, 70, 4, 128, false, 3, 33, {2}},
        {"f32 padding b2 headgroups w[8,16] r[1,2] d8 (row 1: segment 0 all padded)", DT::F32, {{8, 16}, {1, 2}, false, false}, 2, 21, 2, 8, false, 4, 10, {0, pad_mask(2, 21, [](int b, int s) { return b == 0 ? s % 5 == 3 : s < 8; })}},
        {"bf16 padding b2 longnet causal w[16,32] r[1,2] d32", DT::BF16, {{16, 32}, {1, 2}, true, true}, 2, 50, 2, 32, false, 6, 25, {0, pad_mask(2, 50, [](int b, int s) { return b == 0 ? s % 7 == 2 || s > 44 : (s >= 16 && s < 32) || s % 3 == 0; })}},
        {"f16 padding headgroups w[64,128] r[1,2] d64 (full tiles off)", DT::F16, {{64, 128}, {1, 2}, false, false}, 1, 140, 2, 64, false, 30, 64, {0, pad_mask(1, 140, [](int, int s) { return s % 11 == 4 || (s >= 64 && s < 80); })}},
        {"f32 packed cu[0,3,4,17,30] longnet causal w[8,16] r[1,2] d8", DT::F32, {{8, 16}, {1, 2}, true, true}, 1, 30, 2, 8, false, 2, 15, {0, {}, {0, 3, 4, 17, 30}}},
        {"f16 packed cu[0,1,70,75,130] headgroups w[32,64] r[1,2] d64", DT::F16, {{32, 64}, {1, 2}, false, false}, 1, 130, 2, 64, false, 40, 72, {0, {}, {0, 1, 70, 75, 130}}},
        {"bf16 packed cu[0,5,6,40] longnet r3 w[12] r[3] d16", DT::BF16, {{12}, {3}, true, false}, 1, 40, 3, 16, false, 4, 20, {0, {}, {0, 5, 6, 40}}},
        {"f32 window (3,0) causal d8", DT::F32, {{}, {}, false, true, true, 3, 0}, 2, 30, 2, 8, false, 7, 12},
        {"f32 window (4,6) two-sided d33", DT::F32, {{}, {}, false, false, true, 4, 6}, 1, 29, 2, 33, false, 3, 14},
        {"bf16 window (5,2) two-sided d32", DT::BF16, {{}, {}, false, false, true, 5, 2}, 1, 80, 2, 32, false, 20, 41},
        {"f16 window (40,0) causal d64 (full tiles)", DT::F16, {{}, {}, false, true, true, 40, 0}, 1, 200, 1, 64, false, 70, 120},
        {"bf16 window (7,3) causal=(7,0) d128 h2", DT::BF16, {{}, {}, false, true, true, 7, 3}, 1, 90, 2, 128, false, 11, 47},
        {"bf16 window gqa kv1 of h4 + padding + packed (6,3) d32", DT::BF16, {{}, {}, false, false, true, 6, 3}, 1, 70, 4, 32, false, 9, 30, {1, pad_mask(1, 70, [](int, int s) { return s % 9 == 1 || (s >= 20 && s < 24); }), {0, 20, 24, 25, 70}}},
        {"f16 longnet gqa kv2 of h4 + padding + packed causal w[16,32] r[1,2] d64", DT::F16, {{16, 32}, {1, 2}, true, true}, 1, 100, 4, 64, false, 13, 60, {2, pad_mask(1, 100, [](int, int s) { return s % 6 == 5 || (s >= 40 && s < 56); }), {0, 10, 11, 56, 100}}},
        {"f32 window (4,4) gqa kv2 of h4 + padding b2 d8", DT::F32, {{}, {}, false, false, true, 4, 4}, 2, 26, 4, 8, false, 5, 13, {2, pad_mask(2, 26, [](int b, int s) { return b == 1 ? s < 9 : s % 4 == 0; })}},
        {"bf16 gqa kv1 of h2 window (9,0) + padding d160 (bwd rows)", DT::BF16, {{}, {}, false, true, true, 9, 0}, 1, 60, 2, 160, false, 8, 30, {1, pad_mask(1, 60, [](int, int s) { return s % 5 == 0; })}},
        // Block masks (global positions): a ragged last block, causal, one mask per head.
        {"f32 blocks 4 ragged n19 headgroups w[8,16] r[1,2] d8", DT::F32, {{8, 16}, {1, 2}, false, false}, 2, 19, 2, 8, false, 5, 7, with_blocks({}, 19, 4, 1, [](int, int i, int j) { return (i + 2 * j) % 3 != 1 || i == j; })},
        {"f32 blocks 5 per head causal window (9,0) d8", DT::F32, {{}, {}, false, true, true, 9, 0}, 1, 33, 2, 8, false, 4, 17, with_blocks({}, 33, 5, 2, [](int h, int i, int j) { return h == 0 ? j != i - 1 : j % 2 == 0 || i == j; })},
        {"bf16 blocks 16 ragged longnet causal w[64,128] r[1,2] d64", DT::BF16, {{64, 128}, {1, 2}, true, true}, 1, 150, 2, 64, false, 30, 80, with_blocks({}, 150, 16, 1, [](int, int i, int j) { return i - j < 3 || j == 0; })},
        {"f16 blocks 32 per head ragged headgroups w[100] r[1] d32", DT::F16, {{100}, {1}, false, false}, 1, 100, 2, 32, false, 20, 50, with_blocks({}, 100, 32, 2, [](int h, int i, int j) { return h == 0 ? i != j + 1 : (i + j) % 2 == 0; })},
        {"f16 blocks 8 gqa kv1 of h2 causal w[64] r[1] d128", DT::F16, {{64}, {1}, false, true}, 1, 64, 2, 128, false, 16, 40, with_blocks({1}, 64, 8, 1, [](int, int i, int j) { return (i * 3 + j) % 4 != 2; })},
        {"f16 headgroups gqa kv2 of h4 + packed + padding w[8,16] r[2,4] d32", DT::F16, {{8, 16}, {2, 4}, false, false}, 1, 45, 4, 32, false, 6, 19, {2, pad_mask(1, 45, [](int, int s) { return s >= 3 && s < 9; }), {0, 1, 2, 19, 45}}},
    };
    int failed = 0, ran = 0;
    for (const Case& c : cases) {
        if (!only.empty() && c.name.find(only) == std::string::npos) continue;
        ++ran;
        bool ok = false;
        switch (c.dt) {
            case DT::F32: ok = run_case<F32E>(c); break;
            case DT::F16: ok = run_case<F16E>(c); break;
            case DT::BF16: ok = run_case<BF16E>(c); break;
        }
        failed += ok ? 0 : 1;
    }
    if (emu::g_hopper_faults + emu::g_hopper_unwaited + emu::g_deadlocks != 0) {
        std::printf("FAILED: Hopper misuse %u, work in flight at a block's end %u, deadlocks %u\n",
                    emu::g_hopper_faults, emu::g_hopper_unwaited, emu::g_deadlocks);
        return 1;
    }
    const auto [hopper_ran, hopper_failed] = hopper_micro::run_all(only, g_plant);
    ran += hopper_ran;
    failed += hopper_failed;
    if (emu::g_unwaited_blocks != 0) {
        std::printf("FAILED: %u blocks ended with cp.async copies never waited for\n", emu::g_unwaited_blocks);
        return 1;
    }
    if (emu::g_misaligned != 0) {
        std::printf("FAILED: %u vector accesses off their alignment\n", emu::g_misaligned);
        return 1;
    }
    if (ran == 0) {
        std::printf("FAILED: no case matches '%s'\n", only.c_str());
        return 1;
    }
    std::printf("%s: %d of %d cases failed%s\n", failed ? "FAILED" : "PASSED", failed, ran,
                g_plant ? " (planted errors: a case fails when one was not rejected)" : "");
    return failed ? 1 : 0;
}
