// hopper_plan.hpp: the host side of the sm_90a forward and backward
// (../dilated_fwd_wgmma.cu, ../dilated_bwd_wgmma.cu) in the emulation harness: whether a
// launch can take them, and their tensor maps, encoded as the runtime would with
// cuTensorMapEncodeTiled (emu::encode_tiled_2d checks the same rules).
#pragma once

#include <vector>

namespace hopper_plan {

// Padded head dims the sm_90a forward has.
inline bool has_head_dim(int padded) { return padded == 32 || padded == 64 || padded == 128; }

// The maps of one launch, [batch][head of the launch][q, k, v]: for head h, rows t of
// stride r * seq_stride from the block's first selected row (its pattern's offset), head_dim
// columns, boxes of one swizzle row (64 columns, 32 for head_dim 32) by 64 rows. False
// where the launch cannot take the kernel: rows not 16-byte aligned, or a pattern whose
// selected rows are not one stride (r does not divide w).
template <class S>
inline bool encode_maps(const AttnParams& a, int batch, int heads, int padded_d, const S* q, const S* k, const S* v,
                        std::vector<EmuTensorMap>* maps) {
    if ((a.vec & 7) != 7 || !has_head_dim(padded_d)) return false;
    const unsigned pw = padded_d < 64 ? padded_d : 64;
    const Swizzle swz = pw == 64 ? Swizzle::B128 : Swizzle::B64;
    maps->assign((size_t)batch * heads * 3, EmuTensorMap{});
    for (int b = 0; b < batch; ++b)
        for (int hh = 0; hh < heads; ++hh) {
            const i64 h = a.head0 + hh, kvh = kv_head_of(a, h);
            const Pattern p = make_pattern(a, h);
            if (p.per_seg * p.r != p.w) return false;
            EmuTensorMap* m = maps->data() + ((size_t)b * heads + hh) * 3;
            // One map over the selected rows [lo, hi) of a block starting at position `start`.
            auto encode = [&](EmuTensorMap* out, const S* base, i64 start, i64 n, i64 ss) {
                const i64 lo = sel_below(p, start), hi = sel_below(p, start + n);
                if (hi <= lo) return true;  // no block of this head runs
                const S* row0 = base + (sel_pos(p, lo) - start) * ss;
                return emu::encode_tiled_2d(out, 2, row0, a.d, hi - lo, p.r * ss * 2, pw, 64, swz) == 0;
            };
            if (!encode(m, q + b * a.q_sb + h * a.q_sh, a.q_start, a.nq, a.q_ss) ||
                !encode(m + 1, k + b * a.k_sb + kvh * a.k_sh, a.k_start, a.nk, a.k_ss) ||
                !encode(m + 2, v + b * a.v_sb + kvh * a.v_sh, a.k_start, a.nk, a.v_ss))
                return false;
        }
    return true;
}

// Runs the sm_90a forward of a launch over `grid` (64 selected rows a block).
template <class E>
inline void launch_fwd(Dim3 grid, int padded_d, const u16* q, const u16* k, const u16* v, float* o, float* lse,
                       const AttnParams& a, const EmuTensorMap* maps) {
    constexpr bool bf = std::is_same_v<E, BF16E>;
    const std::size_t smem = padded_d == 32    ? WGMMA_FWD_SMEM(32, 64, 2)
                             : padded_d == 64 ? WGMMA_FWD_SMEM(64, 64, 2)
                                              : WGMMA_FWD_SMEM(128, 64, 2);
    emu::launch(grid, 256, [=] {
        switch (padded_d) {
            case 32: bf ? dilated_fwd_wgmma_bf16_d32(q, k, v, o, lse, a, maps) : dilated_fwd_wgmma_f16_d32(q, k, v, o, lse, a, maps); break;
            case 64: bf ? dilated_fwd_wgmma_bf16_d64(q, k, v, o, lse, a, maps) : dilated_fwd_wgmma_f16_d64(q, k, v, o, lse, a, maps); break;
            default: bf ? dilated_fwd_wgmma_bf16_d128(q, k, v, o, lse, a, maps) : dilated_fwd_wgmma_f16_d128(q, k, v, o, lse, a, maps); break;
        }
    }, smem);
}

// The backward's maps of one launch, [batch][head of the launch][q, k, v, grad_out]: the
// forward's q, k and v maps and one over grad_out's rows as q's; heads a.head0 + i
// a.head_step (the backward's sweeps). False where the launch cannot take the kernel.
template <class S>
inline bool encode_bwd_maps(const AttnParams& a, int batch, int heads, int padded_d, const S* q, const S* k,
                            const S* v, const S* g, std::vector<EmuTensorMap>* maps) {
    if ((a.vec & 15) != 15 || !has_head_dim(padded_d)) return false;
    const unsigned pw = padded_d < 64 ? padded_d : 64;
    const Swizzle swz = pw == 64 ? Swizzle::B128 : Swizzle::B64;
    maps->assign((size_t)batch * heads * 4, EmuTensorMap{});
    for (int b = 0; b < batch; ++b)
        for (int hh = 0; hh < heads; ++hh) {
            const i64 h = a.head0 + (i64)hh * a.head_step, kvh = kv_head_of(a, h);
            const Pattern p = make_pattern(a, h);
            if (p.per_seg * p.r != p.w) return false;
            EmuTensorMap* m = maps->data() + ((size_t)b * heads + hh) * 4;
            auto encode = [&](EmuTensorMap* out, const S* base, i64 start, i64 n, i64 ss) {
                const i64 lo = sel_below(p, start), hi = sel_below(p, start + n);
                if (hi <= lo) return true;
                const S* row0 = base + (sel_pos(p, lo) - start) * ss;
                return emu::encode_tiled_2d(out, 2, row0, a.d, hi - lo, p.r * ss * 2, pw, 64, swz) == 0;
            };
            if (!encode(m, q + b * a.q_sb + h * a.q_sh, a.q_start, a.nq, a.q_ss) ||
                !encode(m + 1, k + b * a.k_sb + kvh * a.k_sh, a.k_start, a.nk, a.k_ss) ||
                !encode(m + 2, v + b * a.v_sb + kvh * a.v_sh, a.k_start, a.nk, a.v_ss) ||
                !encode(m + 3, g + b * a.g_sb + h * a.g_sh, a.q_start, a.nq, a.g_ss))
                return false;
        }
    return true;
}

// Runs the sm_90a backward of a launch over `grid` (64 selected keys a block).
template <class E>
inline void launch_bwd(Dim3 grid, int padded_d, const u16* q, const u16* k, const u16* v, const u16* g,
                       const float* lse, const float* delta, float* dq, float* dk, float* dv, const AttnParams& a,
                       const EmuTensorMap* maps) {
    constexpr bool bf = std::is_same_v<E, BF16E>;
    const std::size_t smem = padded_d == 32    ? WGMMA_BWD_SMEM(32, 2)
                             : padded_d == 64 ? WGMMA_BWD_SMEM(64, 2)
                                              : WGMMA_BWD_SMEM(128, 2);
    emu::launch(grid, 256, [=] {
        switch (padded_d) {
            case 32: bf ? dilated_bwd_wgmma_bf16_d32(q, k, v, g, lse, delta, dq, dk, dv, a, maps) : dilated_bwd_wgmma_f16_d32(q, k, v, g, lse, delta, dq, dk, dv, a, maps); break;
            case 64: bf ? dilated_bwd_wgmma_bf16_d64(q, k, v, g, lse, delta, dq, dk, dv, a, maps) : dilated_bwd_wgmma_f16_d64(q, k, v, g, lse, delta, dq, dk, dv, a, maps); break;
            default: bf ? dilated_bwd_wgmma_bf16_d128(q, k, v, g, lse, delta, dq, dk, dv, a, maps) : dilated_bwd_wgmma_f16_d128(q, k, v, g, lse, delta, dq, dk, dv, a, maps); break;
        }
    }, smem);
}

}  // namespace hopper_plan
