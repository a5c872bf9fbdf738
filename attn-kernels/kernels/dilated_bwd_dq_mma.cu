// dilated_bwd_dq_mma.cu: the deterministic backward's dQ on tensor cores (sm_80+), f16/bf16,
// f32 accumulation. Query-major, as the forward: a block of 4 warps owns 64 consecutive
// SELECTED query indices of one (batch, head, pattern), warp w 16 of them, and keeps their dQ
// in registers while the K/V tiles of their segments (band-cut) stream through two shared
// memory stages. Per tile: S = Q K^T, dP = dO V^T, P = 2^(S scale log2 e - lse log2 e) (the
// head's FINAL lse), dS = P (out_scale dP - delta), dQ += dS K (dS straight from the
// accumulators, as the forward's P). Each query row is one block's in a launch and is
// written once, by a plain read-add-write (or straight into the gradient: see the end):
// the sum runs over keys in index order, whatever order the blocks run in, so the result's
// bits do not depend on scheduling. A block mask (the `_bm_` instances) skips the key tiles whose every (query
// block, key block) pair is removed and masks the removed pairs of a mixed one, as the
// forward.

template <class E, int D, int BN, BlockMasking MK = BM_IGNORE>
__device__ void bwd_dq_mma(const u16* q, const u16* k, const u16* v, const u16* go, const float* lse,
                           const float* delta, float* dq_acc, const AttnParams& a) {
    constexpr int BM = 64, LD = D + 8, NS = BN / 8, NO = D / 8, NT = 128;
    ATTN_DYNAMIC_SMEM(smem_raw);
    u16* sQ = reinterpret_cast<u16*>(smem_raw);
    u16* sG = sQ + BM * LD;
    u16* sKs = sG + BM * LD;
    u16* sVs = sKs + 2 * BN * LD;
    __shared__ i64 s_qrows[BM], s_krows[2][BN];
    __shared__ i64 s_klo[BM], s_khi[BM];
    __shared__ float s_lse2[BM], s_delta[BM];  // lse in base 2 (times log2 e)
    __shared__ int s_qblk[BM], s_kblk[2][BN];   // mask blocks of the rows and of each stage's keys

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const i64 h = launch_head(a), kvh = kv_head_of(a, h), b = blockIdx.z;
    const Pattern p = make_pattern(a, h);
    const i64 q_hi = sel_below(p, a.q_start + a.nq);
    const i64 t0 = sel_below(p, a.q_start) + (i64)blockIdx.x * BM;
    if (t0 >= q_hi) return;  // uniform over the block
    const i64 t_last = min64(t0 + BM, q_hi) - 1;
    i64 kb_lo, kb_hi;
    block_keys(a, p, t0, t_last, &kb_lo, &kb_hi);

    const u16* qbase = q + b * a.q_sb + h * a.q_sh;
    const u16* gbase = go + b * a.g_sb + h * a.g_sh;
    gather_rows(s_qrows, BM, p, t0, q_hi, a.q_start);
    __syncthreads();
    const i64 row0 = (a.vec & 9) == 9 ? affine_row0(p, t0, BM, q_hi, a.q_start) : -1;
    if (row0 >= 0) {
        load_tile_affine_async<D, LD, NT, BM>(sQ, qbase + row0 * a.q_ss, p.r * a.q_ss, a.d);
        load_tile_affine_async<D, LD, NT, BM>(sG, gbase + row0 * a.g_ss, p.r * a.g_ss, a.d);
    } else {
        load_tile_async<D, LD>(sQ, s_qrows, BM, qbase, a.q_ss, a.d, a.vec & 1);
        load_tile_async<D, LD>(sG, s_qrows, BM, gbase, a.g_ss, a.d, a.vec & 8);
    }
    cp_async_commit();  // its own group, waited for with the first K/V tile's

    // Each row's admitted key indices [klo, khi) (its segment cut by its band), its lse and
    // delta. Read after the first barrier of the key loop.
    for (int i = threadIdx.x; i < BM; i += blockDim.x) {
        i64 lo = 0, hi = 0;
        float l2 = NEG_INF, dl = 0.f;
        if (t0 + i <= t_last) {
            row_keys(a, p, t0 + i, &lo, &hi);
            const i64 ri = (b * a.nq + s_qrows[i]) * a.heads + h;
            l2 = lse[ri] * LOG2E;
            dl = delta[ri];
        }
        s_klo[i] = lo;
        s_khi[i] = hi;
        s_lse2[i] = l2;
        s_delta[i] = dl;
    }
    if (MK == BM_READ) gather_blocks(s_qblk, BM, p, t0, t_last + 1, a);

    float dq[NO][4];
#pragma unroll
    for (int j = 0; j < NO; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;
    const float scale_log2 = a.scale * LOG2E;
    const int r0 = warp * 16 + g;  // this thread's rows r0 and r0 + 8 of the tile

    const u16* kbase = k + b * a.k_sb + kvh * a.k_sh;
    const u16* vbase = v + b * a.v_sb + kvh * a.v_sh;
    const bool kv_vec = (a.vec & 6) == 6 && a.kpad == nullptr;
    auto load_keys = [&](int st, i64 kt) {
        load_kv_tile_async<D, LD, NT, BN>(sKs + st * BN * LD, sVs + st * BN * LD, s_krows[st], p, kt, kb_hi, kbase,
                                          vbase, a, b, kv_vec);
        if (MK == BM_READ) gather_blocks(s_kblk[st], BN, p, kt, kb_hi, a);
    };
    // The block-mask state of key tile kt; the first tile at or past kt it keeps a pair of.
    auto tile_mask = [&](i64 kt) {
        return MK == BM_READ ? tile_blocks(a, p, b, h, t0, t_last + 1, kt, min64(kt + BN, kb_hi)) : TILE_KEPT;
    };
    auto next_tile = [&](i64 kt) {
        while (kt < kb_hi && tile_mask(kt) == TILE_REMOVED) kt += BN;
        return kt;
    };
    i64 kt0 = next_tile(kb_lo);
    if (kt0 < kb_hi) load_keys(0, kt0);
    int stage = 0;
    for (i64 kt_next; kt0 < kb_hi; kt0 = kt_next, stage ^= 1) {
        const u16* sK = sKs + stage * BN * LD;
        const u16* sV = sVs + stage * BN * LD;
        kt_next = next_tile(kt0 + BN);
        if (kt_next < kb_hi) {
            load_keys(stage ^ 1, kt_next);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // this stage (and sQ, sG, the first time) visible to every warp
        const bool full = full_tile(p, t0, BM, q_hi, kt0, BN, kb_hi, a);

        // S = Q K^T and dP = dO V^T (rows = this warp's 16 queries).
        float s[NS][4], dp[NS][4];
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
        }
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            u32 qf[4], gf[4];
            ldsm_x4(qf, sQ + (warp * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8);
            ldsm_x4(gf, sG + (warp * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int j = 0; j < NS; j += 2) {  // B fragments of key n-blocks j and j + 1
                const int off = (j * 8 + ((lane >> 4) & 1) * 8 + (lane & 7)) * LD + ks * 16 + ((lane >> 3) & 1) * 8;
                u32 kf[4], vf[4];
                ldsm_x4(kf, sK + off);
                ldsm_x4(vf, sV + off);
                mma16816(s[j], qf, kf, E());
                mma16816(s[j + 1], qf, kf + 2, E());
                mma16816(dp[j], gf, vf, E());
                mma16816(dp[j + 1], gf, vf + 2, E());
            }
        }

        // Masked scores become -inf (P = 0); dS = P (out_scale dP - delta) in the S registers.
        if (!full) {
            int lo[2], hi[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                lo[i] = (int)min64(max64(s_klo[r0 + 8 * i] - kt0, 0), BN);
                hi[i] = (int)min64(max64(min64(s_khi[r0 + 8 * i], kb_hi) - kt0, 0), BN);
            }
            if (a.kpad == nullptr)
                mask_scores<NS>(s, lo, hi, c, nullptr);
            else
                mask_scores<NS>(s, lo, hi, c, s_krows[stage]);
        }
        if (tile_mask(kt0) == TILE_MIXED) mask_blocks<NS>(s, a, b, h, s_qblk + r0, s_kblk[stage], c);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float l2 = s_lse2[r0 + 8 * i], dl = s_delta[r0 + 8 * i];
#pragma unroll
            for (int j = 0; j < NS; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pe = l2 == NEG_INF ? 0.f : exp2_approx(fmaf(s[j][2 * i + e], scale_log2, -l2));
                    s[j][2 * i + e] = pe * (dp[j][2 * i + e] * a.out_scale - dl);
                }
            }
        }

        // dQ += dS K: dS re-packed as A fragments, K read transposed as [key][dim].
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const u32 af[4] = {pack2<E>(s[2 * kk][0], s[2 * kk][1]), pack2<E>(s[2 * kk][2], s[2 * kk][3]),
                               pack2<E>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack2<E>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int j = 0; j < NO; j += 2) {
                u32 bf[4];
                ldsm_x4_trans(bf, sK + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + j * 8 + ((lane >> 4) & 1) * 8);
                mma16816(dq[j], af, bf, E());
                mma16816(dq[j + 1], af, bf + 2, E());
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }
    cp_async_wait<0>();  // no copy outlives the block (Q's and dO's, where no key tile ran)

    // With `a.out_direct` (a whole call whose query rows have one writer: one pattern a
    // head, planned by the host) dQ goes straight into the gradient in E at q's strides
    // (dq_acc then points at it), with no f32 accumulator, zero-fill of it or epilogue.
    u16* dqo = reinterpret_cast<u16*>(dq_acc);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (t0 + r0 + 8 * i > t_last) continue;
        const i64 r = s_qrows[r0 + 8 * i];
        float* row = dq_acc + ((b * a.nq + r) * a.heads + h) * a.d;
        u16* out = dqo + b * a.q_sb + r * a.q_ss + h * a.q_sh;
#pragma unroll
        for (int j = 0; j < NO; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const i64 col = j * 8 + 2 * c + e;
                if (col >= a.d) continue;
                if (a.out_direct)
                    out[col] = E::from_f(a.scale * dq[j][2 * i + e]);
                else
                    row[col] += a.scale * dq[j][2 * i + e];
            }
        }
    }
}

// Dynamic shared memory (bytes): Q and dO tiles, two K/V stages; mirrored by
// `mma_bwd_dq_smem_bytes` in src/cuda/plan/patterns.rs.
#define MMA_BWD_DQ_SMEM(D, BN) ((2 * 64 + 4 * (BN)) * ((D) + 8) * 2)

// dilated_bwd_dq_mma_<dtype>_d<D>: 64 query rows over 4 warps, BN keys a tile (32 at head
// dim 128: 68 KB of shared memory, which every sm_80+ part allows).
// dilated_bwd_dq_mma_bm_<dtype>_d<D>: the same, reading the block mask.
#define ATTN_MMA_BWD_DQ_KERNEL(NAME, E, D, BN)                                                             \
    extern "C" __global__ void __launch_bounds__(128) dilated_bwd_dq_mma_##NAME##_d##D(                    \
        const u16* q, const u16* k, const u16* v, const u16* go, const float* lse, const float* delta,     \
        float* dq_acc, AttnParams a) {                                                                     \
        bwd_dq_mma<E, D, BN>(q, k, v, go, lse, delta, dq_acc, a);                                          \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) dilated_bwd_dq_mma_bm_##NAME##_d##D(                 \
        const u16* q, const u16* k, const u16* v, const u16* go, const float* lse, const float* delta,     \
        float* dq_acc, AttnParams a) {                                                                     \
        bwd_dq_mma<E, D, BN, BM_READ>(q, k, v, go, lse, delta, dq_acc, a);                                 \
    }

#if ATTN_WANT_F16
ATTN_MMA_BWD_DQ_KERNEL(f16, F16E, 32, 64)
ATTN_MMA_BWD_DQ_KERNEL(f16, F16E, 64, 64)
ATTN_MMA_BWD_DQ_KERNEL(f16, F16E, 128, 32)
#endif
#if ATTN_WANT_BF16
ATTN_MMA_BWD_DQ_KERNEL(bf16, BF16E, 32, 64)
ATTN_MMA_BWD_DQ_KERNEL(bf16, BF16E, 64, 64)
ATTN_MMA_BWD_DQ_KERNEL(bf16, BF16E, 128, 32)
#endif
