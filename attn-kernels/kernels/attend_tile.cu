// attend_tile.cu: the pieces of the tensor-core forward that its two- and three-stage
// kernels share: the query tile's load, one key tile's attention (S = Q K^T, the mask
// where the tile is not full, the online softmax, O += P V) and the epilogue; also
// exp2_approx and mask_scores, which the backward uses. A row whose keys the block mask
// all removes keeps l = 0: lse -inf and o = 0, as the row kernels give. Fragment layouts: see mma_tiles.cu.

// 2^x by the hardware approximation alone (what exp2f uses, without its fix-up for
// results below 2^-126: they flush to 0, far below the f32 resolution of the row sums).
__device__ __forceinline__ float exp2_approx(float x) {
#ifdef ATTN_CPU_EMULATION
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// Sets to -inf this thread's scores of keys outside each of its rows' tile columns
// [lo, hi) and, given the tile's gathered key rows (padding), of padded keys (row -1).
template <int NS>
__device__ __forceinline__ void mask_scores(float (*s)[4], const int* lo, const int* hi, int c, const i64* krows) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = j * 8 + 2 * c + e;
                bool ok = (col >= lo[i]) & (col < hi[i]);
                if (krows != nullptr) ok &= krows[col] >= 0;
                if (!ok) s[j][2 * i + e] = NEG_INF;
            }
        }
    }
}

// One step of the online softmax over a 16-row tile of scores s (NS blocks of 8 columns,
// the accumulator layout of mma.m16n8k16's C; this thread's rows g and g + 8): raw scores
// become exponents exp2(s * scale_log2 - m), the row max m (scaled log2 domain) and sum l
// move on, and the row's O accumulators (NO blocks) are rescaled to the new max.
template <int NS, int NO>
__device__ __forceinline__ void online_softmax(float (*s)[4], float* m, float* l, float (*o)[4], float scale_log2) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float mx = NEG_INF;
#pragma unroll
        for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * i], s[j][2 * i + 1]));
        mx = fmaxf(mx, shfl_xor<1>(mx));
        mx = fmaxf(mx, shfl_xor<2>(mx));
        const float m_new = fmaxf(m[i], mx * scale_log2);
        const float m_use = m_new == NEG_INF ? 0.f : m_new;
        const float alpha = exp2_approx(m[i] - m_use);
        float rs = 0.f;
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float pe = exp2_approx(fmaf(s[j][2 * i + e], scale_log2, -m_use));
                s[j][2 * i + e] = pe;
                rs += pe;
            }
        }
        l[i] = l[i] * alpha + rs;
        m[i] = m_new;
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            o[j][2 * i] *= alpha;
            o[j][2 * i + 1] *= alpha;
        }
    }
}

// The running state of a warp's MT row tiles: O accumulators, and per row (this thread's
// rows g and g + 8 of each tile) the max in the scaled log2 domain and the sum.
template <int NO, int MT>
struct RowState {
    float o[MT][NO][4];
    float m[MT][2], l[MT][2];

    __device__ __forceinline__ void clear() {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int j = 0; j < NO; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
            m[mt][0] = m[mt][1] = NEG_INF;
            l[mt][0] = l[mt][1] = 0.f;
        }
    }
};

// Gathers the block's query rows (selected indices t0.. below q_hi) into s_qrows, then
// starts the Q tile's copy as its own cp.async group: by stepped pointers where the tile
// is affine, else through s_qrows. s_qrows is the epilogue's, in any case.
template <int D, int LD, int NT, int BM>
__device__ __forceinline__ void stage_query_tile(u16* sQ, i64* s_qrows, const Pattern& p, i64 t0, i64 q_hi,
                                                 const u16* qbase, const AttnParams& a) {
    gather_rows(s_qrows, BM, p, t0, q_hi, a.q_start);
    __syncthreads();
    const i64 q_row0 = (a.vec & 1) ? affine_row0(p, t0, BM, q_hi, a.q_start) : -1;
    if (q_row0 >= 0)
        load_tile_affine_async<D, LD, NT, BM>(sQ, qbase + q_row0 * a.q_ss, p.r * a.q_ss, a.d);
    else
        load_tile_async<D, LD>(sQ, s_qrows, BM, qbase, a.q_ss, a.d, a.vec & 1);
    cp_async_commit();
}

// One key tile of BN keys in shared memory (sK, sV) against the warp's MT row tiles of
// sQ (rows w0 + 16 mt ..): scores stay raw and each exponent is one FMA (scale * log2(e)
// folded into scale_log2; scale > 0, so the raw row max gives the scaled one). Where
// `masked`, cols(mt, lo, hi) gives this thread's two rows' admitted tile columns [lo, hi)
// and krows (non-null with padding) the tile's gathered key rows. Where `bmixed` (the
// tile's block-mask state is TILE_MIXED), blocks(mt, s) masks row tile mt's removed pairs.
template <class E, int D, int BN, int MT, int LD, class Cols, class Blocks>
__device__ __forceinline__ void attend_tile(RowState<D / 8, MT>& st, const u16* sQ, const u16* sK, const u16* sV,
                                            int w0, float scale_log2, bool masked, const i64* krows, Cols cols,
                                            bool bmixed, Blocks blocks) {
    constexpr int NS = BN / 8, NO = D / 8;
    const int lane = threadIdx.x & 31, c = lane & 3;
    // S = Q K^T: each K fragment read from shared memory feeds the warp's MT row tiles.
    float s[MT][NS][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NS; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ldsm_x4(af[mt], sQ + (w0 + mt * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int j = 0; j < NS; j += 2) {  // B fragments of n-blocks j and j + 1
            u32 bf[4];
            ldsm_x4(bf, sK + (j * 8 + ((lane >> 4) & 1) * 8 + (lane & 7)) * LD + ks * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(s[mt][j], af[mt], bf, E());
                mma16816(s[mt][j + 1], af[mt], bf + 2, E());
            }
        }
    }

    // The mask where the tile is not full, then the online softmax.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        if (masked) {
            int lo[2], hi[2];
            cols(mt, lo, hi);
            if (krows == nullptr)  // two call sites: each inlines its own test
                mask_scores<NS>(s[mt], lo, hi, c, nullptr);
            else
                mask_scores<NS>(s[mt], lo, hi, c, krows);
        }
        if (bmixed) blocks(mt, s[mt]);
        online_softmax<NS, NO>(s[mt], st.m[mt], st.l[mt], st.o[mt], scale_log2);
    }

    // O += P V: P comes straight from the S accumulators (C layout == A layout pairs);
    // each V fragment feeds the warp's MT row tiles.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        u32 pf[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            pf[mt][0] = pack2<E>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
            pf[mt][1] = pack2<E>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
            pf[mt][2] = pack2<E>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
            pf[mt][3] = pack2<E>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int j = 0; j < NO; j += 2) {  // B fragments of n-blocks j and j + 1 (V transposed)
            u32 bf[4];
            ldsm_x4_trans(bf, sV + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + j * 8 + ((lane >> 4) & 1) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(st.o[mt][j], pf[mt], bf, E());
                mma16816(st.o[mt][j + 1], pf[mt], bf + 2, E());
            }
        }
    }
}

// The direct epilogue: this thread's two rows (selected index row `rows[0]`, `rows[8]` in the
// tile; ri < 0 past the block) written as E = out_scale * o / l at the output's strides
// (g_*), with their lse. Adjacent column pairs go as one 32-bit store where rows allow it.
template <class E, int NO>
__device__ __forceinline__ void direct_store(u16* out, float* lse_out, const float (*o)[4], const float* lse,
                                             const float* inv, const i64* ri, const i64* rows, i64 b, i64 h, int c,
                                             const AttnParams& a) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (ri[i] < 0) continue;
        u16* orow = out + b * a.g_sb + rows[8 * i] * a.g_ss + h * a.g_sh;
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            const i64 col = j * 8 + 2 * c;
            const float x0 = a.out_scale * (o[j][2 * i] * inv[i]), x1 = a.out_scale * (o[j][2 * i + 1] * inv[i]);
            if ((a.vec & 8) && col + 1 < a.d) {
                ATTN_ALIGNED(orow + col, 4);
                *reinterpret_cast<u32*>(orow + col) = pack2<E>(x0, x1);
            } else {
                if (col < a.d) orow[col] = E::from_f(x0);
                if (col + 1 < a.d) orow[col + 1] = E::from_f(x1);
            }
        }
        if (c == 0) lse_out[ri[i]] = lse[i];
    }
}

// The end of a block: each row's lse from its max and sum, then the rows (selected
// indices t0 + r, r < BM; those past t_last are skipped; block row s_qrows[r]) written
// straight to the output where `a.out_direct`, else LSE-merged into the f32 partial.
template <class E, int NO, int MT>
__device__ __forceinline__ void fwd_epilogue(const RowState<NO, MT>& st, void* o_dst, float* lse_acc,
                                             const i64* s_qrows, int w0, i64 t0, i64 t_last, i64 b, i64 h,
                                             const AttnParams& a) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int r0 = w0 + mt * 16 + g;
        // Row sums live in the 4 threads of a group.
        float lse[2], inv[2], wa[2] = {0.f, 0.f}, wb[2] = {0.f, 0.f}, merged[2] = {NEG_INF, NEG_INF};
        i64 ri[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float li = st.l[mt][i];
            li += shfl_xor<1>(li);
            li += shfl_xor<2>(li);
            lse[i] = li > 0.f ? (st.m[mt][i] + log2f(li)) * 0.69314718055994531f : NEG_INF;  // back to natural log
            inv[i] = li > 0.f ? 1.f / li : 0.f;
            ri[i] = t0 + r0 + 8 * i <= t_last ? (b * a.nq + s_qrows[r0 + 8 * i]) * a.heads + h : -1;
        }
        if (a.out_direct) {
            direct_store<E, NO>(static_cast<u16*>(o_dst), lse_acc, st.o[mt], lse, inv, ri, s_qrows + r0, b, h, c, a);
            continue;
        }
        // Merge the tile into the partial.
        float* o_acc = static_cast<float*>(o_dst);
#pragma unroll
        for (int i = 0; i < 2; ++i)
            if (ri[i] >= 0) lse_merge(lse_acc[ri[i]], lse[i], &merged[i], &wa[i], &wb[i]);
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (ri[i] < 0) continue;
            float* orow = o_acc + ri[i] * a.d;
#pragma unroll
            for (int j = 0; j < NO; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const i64 col = j * 8 + 2 * c + e;
                    if (col < a.d)
                        orow[col] =
                            merged[i] == NEG_INF ? 0.f : wa[i] * orow[col] + wb[i] * st.o[mt][j][2 * i + e] * inv[i];
                }
            }
            if (c == 0) lse_acc[ri[i]] = merged[i];
        }
    }
}

// One tensor-core forward kernel `KNAME`: template FN<E, D, BN, BM, MT> with launch bounds
// BOUNDS (parenthesised), on the launch's pattern and the block's grid position.
#define ATTN_FWD_KERNEL(KNAME, FN, BOUNDS, E, D, BN, BM, MT)                                                \
    extern "C" __global__ void __launch_bounds__ BOUNDS KNAME(const u16* q, const u16* k, const u16* v,     \
                                                              void* o_dst, float* lse_acc, AttnParams a) { \
        FN<E, D, BN, BM, MT>(q, k, v, o_dst, lse_acc, a, blockIdx.x, launch_head(a), blockIdx.z);           \
    }

// The fused form: 64 rows over 4 warps, the block's pattern, row block and head from the
// launch's table (fused_block). Its own kernel, so the per-pattern kernels keep the pattern
// in the launch's parameters rather than in registers.
#define ATTN_FWD_FUSED_KERNEL(KNAME, FN, BOUNDS, E, D, BN)                                                  \
    extern "C" __global__ void __launch_bounds__ BOUNDS KNAME(const u16* q, const u16* k, const u16* v,     \
                                                              void* o_dst, float* lse_acc, AttnParams a) { \
        i64 bx, h;                                                                                           \
        fused_block(a, &bx, &h);                                                                             \
        FN<E, D, BN, 64, 1>(q, k, v, o_dst, lse_acc, a, bx, h, blockIdx.z);                                  \
    }

// The persistent form: the fused kernel's blocks as work items of a grid sized to the
// machine (persistent_items in prelude.cu).
#define ATTN_FWD_PERSISTENT_KERNEL(KNAME, FN, BOUNDS, E, D, BN)                                             \
    extern "C" __global__ void __launch_bounds__ BOUNDS KNAME(const u16* q, const u16* k, const u16* v,     \
                                                              void* o_dst, float* lse_acc, AttnParams a) { \
        persistent_items(a, [&](const AttnParams& ai, i64 bx, i64 h, i64 b) {                                \
            FN<E, D, BN, 64, 1>(q, k, v, o_dst, lse_acc, ai, bx, h, b);                                      \
        });                                                                                                  \
    }
