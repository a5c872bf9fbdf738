// dilated_fwd_mma.cu: tensor-core forward (sm_80+) for f16/bf16, f32 accumulation.
//
// A block owns BM (64 or 128) consecutive SELECTED query indices of one (batch, head,
// pattern) over BM / (16 MT) warps (4 or 8); warp w owns 16 MT of them, MT row tiles of 16
// (MT = 2 reads each K/V fragment from shared memory once for two tiles). A launch runs
// one pattern, or, in the fused kernel, the patterns of disjoint head ranges (fused_block in prelude.cu). Q is
// loaded once, asynchronously, beside the first K/V tile. Key tiles of BN selected indices
// stream through shared memory; the dilation gather (sel_pos) is fused into the tile loads, rows are
// zero-filled past the block or past head_dim (D is head_dim rounded up). S = Q K^T and
// O += P V use mma.sync.m16n8k16 with the accumulators in registers (FlashAttention-2
// style online softmax), then the tile is LSE-merged into the f32 partial at `o_dst`, or,
// with `a.out_direct` (the only launch covering its rows: one pattern per head, a whole
// call), written straight to the output at `o_dst` (E, times out_scale) and lse. Each row's
// keys are its segment cut by the band (window / causal), minus padded keys (row -1 in
// the gathered key rows); query head h reads key/value head h / kv_group. A tile inside
// one segment, all rows valid and unpadded, is affine (rows sel_pos(t0) + i * r) and loads
// by stepped pointers, without the gather; only tiles that are not full run the mask.
// Fragment layouts: see mma_tiles.cu.

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

template <class E, int D, int BN, int BM, int MT>
__device__ void fwd_mma(const u16* q, const u16* k, const u16* v, void* o_dst, float* lse_acc, const AttnParams& a,
                        i64 bx, i64 h) {
    // NT: threads of the block, a warp per MT row tiles of 16.
    constexpr int LD = D + 8, NS = BN / 8, NO = D / 8, NT = 2 * BM / MT;
    ATTN_DYNAMIC_SMEM(smem_raw);
    // Q tile, then two K/V stages (double buffering: the next tile loads while this one runs).
    u16* sQ = reinterpret_cast<u16*>(smem_raw);
    u16* sKs = sQ + BM * LD;
    u16* sVs = sKs + 2 * BN * LD;
    __shared__ i64 s_qrows[BM], s_krows[2][BN];
    __shared__ i64 s_klo[BM], s_khi[BM];  // each row's admitted key indices (shared: fewer registers)

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const i64 kvh = kv_head_of(a, h), b = blockIdx.z;
    const Pattern p = make_pattern(a, h);
    const i64 q_hi = sel_below(p, a.q_start + a.nq);
    const i64 t0 = sel_below(p, a.q_start) + bx * BM;
    if (t0 >= q_hi) return;  // uniform over the block
    const i64 t_last = min64(t0 + BM, q_hi) - 1;
    i64 kb_lo, kb_hi;
    block_keys(a, p, t0, t_last, &kb_lo, &kb_hi);

    const u16* qbase = q + b * a.q_sb + h * a.q_sh;
    gather_rows(s_qrows, BM, p, t0, q_hi, a.q_start);  // the epilogue's rows, in any case
    __syncthreads();
    const i64 q_row0 = (a.vec & 1) ? affine_row0(p, t0, BM, q_hi, a.q_start) : -1;
    if (q_row0 >= 0)
        load_tile_affine_async<D, LD, NT, BM>(sQ, qbase + q_row0 * a.q_ss, p.r * a.q_ss, a.d);
    else
        load_tile_async<D, LD>(sQ, s_qrows, BM, qbase, a.q_ss, a.d, a.vec & 1);
    cp_async_commit();  // its own group, waited for with the first K/V tile's

    // This warp's first row in the tile; row tile mt covers rows w0 + 16 mt .. + 16, and
    // this thread holds rows w0 + 16 mt + g and + 8 of it.
    const int w0 = warp * 16 * MT;
    // Each row's admitted key indices [klo, khi): its segment cut by its band (empty past
    // t_last). Read after the first barrier of the key loop.
    for (int i = threadIdx.x; i < BM; i += blockDim.x) {
        i64 lo = 0, hi = 0;
        if (t0 + i <= t_last) {
            const i64 seg = div32(t0 + i, p.per_seg);
            band_keys(a, t0 + i, &lo, &hi);
            lo = max64(seg * p.per_seg, lo);
            hi = min64((seg + 1) * p.per_seg, hi);
        }
        s_klo[i] = lo;
        s_khi[i] = hi;
    }

    float o[MT][NO][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NO; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
    // Scores stay raw; m lives in the scaled log2 domain and each exponent is one FMA
    // (scale * log2(e) folded in). scale > 0, so the raw row max gives the scaled one.
    const float scale_log2 = a.scale * LOG2E;
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = NEG_INF;
        l[mt][0] = l[mt][1] = 0.f;
    }

    const u16* kbase = k + b * a.k_sb + kvh * a.k_sh;
    const u16* vbase = v + b * a.v_sb + kvh * a.v_sh;
    // Start the copy of key tile kt into stage st (one cp.async group): by stepped
    // pointers where the tile is affine (uniform over the block; no gather into s_krows).
    const bool kv_vec = (a.vec & 6) == 6 && a.kpad == nullptr;
    auto load_keys = [&](int st, i64 kt) {
        load_kv_tile_async<D, LD, NT, BN>(sKs + st * BN * LD, sVs + st * BN * LD, s_krows[st], p, kt, kb_hi, kbase,
                                          vbase, a, b, kv_vec);
    };
    if (kb_lo < kb_hi) load_keys(0, kb_lo);  // stage the first K/V tile
    int stage = 0;
    for (i64 kt0 = kb_lo; kt0 < kb_hi; kt0 += BN, stage ^= 1) {
        const u16* sK = sKs + stage * BN * LD;
        const u16* sV = sVs + stage * BN * LD;
        if (kt0 + BN < kb_hi) {  // start the next tile into the other stage, wait for this one
            load_keys(stage ^ 1, kt0 + BN);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // this stage (and sQ, the first time) visible to every warp
        const bool full = full_tile(p, t0, BM, q_hi, kt0, BN, kb_hi, a);

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

        // Mask (key valid and not padding, inside the row's segment and band) only where
        // the tile is not full; then the online softmax. Keys past kb_hi are cut by
        // column; s_krows is read only for padding, whose tiles are never affine.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int r0 = w0 + mt * 16 + g;
            if (!full) {
                int lo[2], hi[2];  // each row's admitted keys as tile columns, clamped to [0, BN]
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    lo[i] = (int)min64(max64(s_klo[r0 + 8 * i] - kt0, 0), BN);
                    hi[i] = (int)min64(max64(min64(s_khi[r0 + 8 * i], kb_hi) - kt0, 0), BN);
                }
                if (a.kpad == nullptr)
                    mask_scores<NS>(s[mt], lo, hi, c, nullptr);
                else
                    mask_scores<NS>(s[mt], lo, hi, c, s_krows[stage]);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float mx = NEG_INF;
#pragma unroll
                for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[mt][j][2 * i], s[mt][j][2 * i + 1]));
                mx = fmaxf(mx, shfl_xor<1>(mx));
                mx = fmaxf(mx, shfl_xor<2>(mx));
                const float m_new = fmaxf(m[mt][i], mx * scale_log2);
                const float m_use = m_new == NEG_INF ? 0.f : m_new;
                const float alpha = exp2_approx(m[mt][i] - m_use);
                float rs = 0.f;
#pragma unroll
                for (int j = 0; j < NS; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float pe = exp2_approx(fmaf(s[mt][j][2 * i + e], scale_log2, -m_use));
                        s[mt][j][2 * i + e] = pe;
                        rs += pe;
                    }
                }
                l[mt][i] = l[mt][i] * alpha + rs;
                m[mt][i] = m_new;
#pragma unroll
                for (int j = 0; j < NO; ++j) {
                    o[mt][j][2 * i] *= alpha;
                    o[mt][j][2 * i + 1] *= alpha;
                }
            }
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
                    mma16816(o[mt][j], pf[mt], bf, E());
                    mma16816(o[mt][j + 1], pf[mt], bf + 2, E());
                }
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }
    cp_async_wait<0>();  // no copy outlives the block (Q's, where no key tile ran)

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int r0 = w0 + mt * 16 + g;
        // Row sums live in the 4 threads of a group.
        float lse[2], inv[2], wa[2] = {0.f, 0.f}, wb[2] = {0.f, 0.f}, merged[2] = {NEG_INF, NEG_INF};
        i64 ri[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float li = l[mt][i];
            li += shfl_xor<1>(li);
            li += shfl_xor<2>(li);
            lse[i] = li > 0.f ? (m[mt][i] + log2f(li)) * 0.69314718055994531f : NEG_INF;  // back to natural log
            inv[i] = li > 0.f ? 1.f / li : 0.f;
            ri[i] = t0 + r0 + 8 * i <= t_last ? (b * a.nq + s_qrows[r0 + 8 * i]) * a.heads + h : -1;
        }
        if (a.out_direct) {
            direct_store<E, NO>(static_cast<u16*>(o_dst), lse_acc, o[mt], lse, inv, ri, s_qrows + r0, b, h, c, a);
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
                        orow[col] = merged[i] == NEG_INF ? 0.f : wa[i] * orow[col] + wb[i] * o[mt][j][2 * i + e] * inv[i];
                }
            }
            if (c == 0) lse_acc[ri[i]] = merged[i];
        }
    }
}

// Shared memory of one block (bytes); mirrored by `mma_smem_bytes` in src/cuda/plan.rs.
#define MMA_SMEM(BM, D, BN) (((BM) + 4 * (BN)) * ((D) + 8) * 2)  // dynamic; plus static row indices

// 64 query rows over 4 warps: dilated_fwd_mma_<dtype>_d<D>.
#define ATTN_MMA_KERNEL(NAME, E, D, BN)                                                                    \
    extern "C" __global__ void __launch_bounds__(128) dilated_fwd_mma_##NAME##_d##D(                       \
        const u16* q, const u16* k, const u16* v, void* o_dst, float* lse_acc, AttnParams a) {             \
        fwd_mma<E, D, BN, 64, 1>(q, k, v, o_dst, lse_acc, a, blockIdx.x, launch_head(a));                  \
    }

// 128 query rows over 8 warps (each K/V tile serves twice the rows): dilated_fwd_mma_m128_<dtype>_d<D>.
#define ATTN_MMA_KERNEL_M128(NAME, E, D, BN)                                                               \
    extern "C" __global__ void __launch_bounds__(256) dilated_fwd_mma_m128_##NAME##_d##D(                  \
        const u16* q, const u16* k, const u16* v, void* o_dst, float* lse_acc, AttnParams a) {             \
        fwd_mma<E, D, BN, 128, 1>(q, k, v, o_dst, lse_acc, a, blockIdx.x, launch_head(a));                 \
    }

// 128 query rows over 4 warps, 32 a warp (each K/V fragment read from shared memory feeds two
// row tiles; twice the accumulator registers): dilated_fwd_mma_m128w4_<dtype>_d<D>, D <= 128.
#define ATTN_MMA_KERNEL_M128W4(NAME, E, D, BN)                                                             \
    extern "C" __global__ void __launch_bounds__(128) dilated_fwd_mma_m128w4_##NAME##_d##D(                \
        const u16* q, const u16* k, const u16* v, void* o_dst, float* lse_acc, AttnParams a) {             \
        fwd_mma<E, D, BN, 128, 2>(q, k, v, o_dst, lse_acc, a, blockIdx.x, launch_head(a));                 \
    }

// 64 query rows over 4 warps, the patterns of a fused launch (fused_block):
// dilated_fwd_mma_fused_<dtype>_d<D>. Its own kernel, so the per-pattern kernels keep
// the pattern in the launch's parameters rather than in registers.
#define ATTN_MMA_KERNEL_FUSED(NAME, E, D, BN)                                                              \
    extern "C" __global__ void __launch_bounds__(128) dilated_fwd_mma_fused_##NAME##_d##D(                 \
        const u16* q, const u16* k, const u16* v, void* o_dst, float* lse_acc, AttnParams a) {             \
        i64 bx, h;                                                                                         \
        fused_block(a, &bx, &h);                                                                           \
        fwd_mma<E, D, BN, 64, 1>(q, k, v, o_dst, lse_acc, a, bx, h);                                       \
    }

#if ATTN_WANT_F16
ATTN_MMA_KERNEL(f16, F16E, 32, 64)
ATTN_MMA_KERNEL(f16, F16E, 64, 64)
ATTN_MMA_KERNEL(f16, F16E, 128, 64)
ATTN_MMA_KERNEL(f16, F16E, 256, 32)
ATTN_MMA_KERNEL_M128(f16, F16E, 32, 64)
ATTN_MMA_KERNEL_M128(f16, F16E, 64, 64)
ATTN_MMA_KERNEL_M128(f16, F16E, 128, 64)
ATTN_MMA_KERNEL_M128(f16, F16E, 256, 32)
ATTN_MMA_KERNEL_M128W4(f16, F16E, 32, 64)
ATTN_MMA_KERNEL_M128W4(f16, F16E, 64, 64)
ATTN_MMA_KERNEL_M128W4(f16, F16E, 128, 32)
ATTN_MMA_KERNEL_FUSED(f16, F16E, 32, 64)
ATTN_MMA_KERNEL_FUSED(f16, F16E, 64, 64)
ATTN_MMA_KERNEL_FUSED(f16, F16E, 128, 64)
ATTN_MMA_KERNEL_FUSED(f16, F16E, 256, 32)
#endif
#if ATTN_WANT_BF16
ATTN_MMA_KERNEL(bf16, BF16E, 32, 64)
ATTN_MMA_KERNEL(bf16, BF16E, 64, 64)
ATTN_MMA_KERNEL(bf16, BF16E, 128, 64)
ATTN_MMA_KERNEL(bf16, BF16E, 256, 32)
ATTN_MMA_KERNEL_M128(bf16, BF16E, 32, 64)
ATTN_MMA_KERNEL_M128(bf16, BF16E, 64, 64)
ATTN_MMA_KERNEL_M128(bf16, BF16E, 128, 64)
ATTN_MMA_KERNEL_M128(bf16, BF16E, 256, 32)
ATTN_MMA_KERNEL_M128W4(bf16, BF16E, 32, 64)
ATTN_MMA_KERNEL_M128W4(bf16, BF16E, 64, 64)
ATTN_MMA_KERNEL_M128W4(bf16, BF16E, 128, 32)
ATTN_MMA_KERNEL_FUSED(bf16, BF16E, 32, 64)
ATTN_MMA_KERNEL_FUSED(bf16, BF16E, 64, 64)
ATTN_MMA_KERNEL_FUSED(bf16, BF16E, 128, 64)
ATTN_MMA_KERNEL_FUSED(bf16, BF16E, 256, 32)
#endif
