// dilated_bwd_wgmma.cu: the sm_90a backward for f16/bf16 (f32 accumulation): TMA tiles,
// an mbarrier ring and wgmma, warp-specialised, in the forward's style
// (dilated_fwd_wgmma.cu).
//
// A block owns 64 consecutive SELECTED key indices of one (batch, head, pattern) and has
// two warpgroups: the producer (thread 0 issues every copy) and the consumer (64 key rows,
// 16 a warp, whose dK and dV stay in registers). Four tensor maps per (batch, head of the
// launch), rows t of stride r * seq_stride as the forward's (params `maps`,
// [batch][heads of the launch][q, k, v, grad_out]), so each tile of selected rows is one
// TMA box. The producer loads K and V once, then the query tiles (64 selected query
// indices of the keys' segments, cut by the band) into a ring of STAGES buffers of Q and
// dO, with each tile's rows, lse (base 2) and delta written beside it and released by the
// stage's `full` barrier. Per tile the consumer computes, in the keys' frame,
// S^T = K Q^T and dP^T = V dO^T (wgmma, both operands from shared memory, K-major),
// P^T = 2^(scale log2e S^T - lse) and dS^T = P^T (out_scale dP^T - delta) in registers
// (masked by each key row's queries: segment, band, padded keys), dV += P^T dO and
// dK += dS^T Q (wgmma, A from registers, B MN-major), then dQ = dS K: dS^T goes to shared
// memory in the 128-byte swizzle and is read back as an MN-major A operand against K as an
// MN-major B, one panel of head dims at a time; the f32 dQ tile is staged in shared memory
// and added to dq_acc a row at a time by bulk reductions (cp.reduce.async.bulk .add.f32:
// one instruction a query row, no per-element atomics). The dK/dV epilogue is the
// mma.sync backward's (plain adds into the f32 accumulators, or `a.out_direct`).
// Not here: block masks, several consumer warpgroups, the softmax overlapped with the next
// tile's MMAs, rows that are not one stride (the host keeps the mma.sync kernels).

#ifdef ATTN_HOPPER

#ifdef ATTN_CPU_EMULATION
__device__ __forceinline__ void warpgroup_sync() { emu::warpgroup_sync(); }
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const void* src, u32 bytes) {
    emu::bulk_reduce_add_f32(dst, src, bytes);
}
__device__ __forceinline__ void bulk_commit() {}
__device__ __forceinline__ void bulk_wait_read() { emu::bulk_wait_read(); }
#else
// Barrier 1 over the 128 threads of the consumer warpgroup (barrier 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync() { asm volatile("bar.sync 1, 128;" ::: "memory"); }
// dst[i] += src[i] for `bytes` / 4 floats (both 16-byte aligned, bytes a multiple of 16),
// src in shared memory, read asynchronously; element-wise atomic in global memory.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const void* src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
                 "r"(smem_u32(src)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Every bulk operation this thread committed has read its shared-memory source.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
#endif

// Shared-memory bytes of the sm_90a backward: up to 1023 to align, K and V, STAGES Q and dO
// tiles, the dS^T tile, the f32 dQ tile, the barriers.
#define WGMMA_BWD_SMEM(D, STAGES) \
    (1024 + 2 * 64 * (D) * 2 + (STAGES) * 2 * 64 * (D) * 2 + 64 * 64 * 2 + 64 * (D) * 4 + 1024)

template <class E, int D, int STAGES>
__device__ void bwd_wgmma(const u16* q, const u16* k, const u16* v, const u16* go, const float* lse,
                          const float* delta, float* dq_acc, float* dk_acc, float* dv_acc, const AttnParams& a,
                          const TmaMap* maps) {
    constexpr int BN = 64, BM = 64, PW = D < 64 ? D : 64, NO = D / 8, NQ = BM / 8;
    constexpr u32 W = PW * 2, KT = BN * D * 2, QT = BM * D * 2, WS = BM * 2;  // WS: a dS^T row
    constexpr Swizzle SWZ = W == 128 ? Swizzle::B128 : Swizzle::B64;
    ATTN_DYNAMIC_SMEM(smem_raw);
    unsigned char* smem = align_1024(smem_raw);
    unsigned char *sK = smem, *sV = smem + KT;
    unsigned char* ring = sV + KT;                      // stage s: Q at s * 2 QT, dO after it
    unsigned char* sDS = ring + STAGES * 2 * QT;        // dS^T: [BN keys][BM queries], 128B swizzle
    float* sDQ = reinterpret_cast<float*>(sDS + BN * WS);  // [BM][D] f32, rows 16-byte aligned
    u64* bars = reinterpret_cast<u64*>(sDQ + BM * D);   // kv_full, full[], empty[]
    u64 *kv_full = bars, *full = bars + 1, *empty = bars + 1 + STAGES;
    __shared__ i64 s_krows[BN], s_qrows[STAGES][BM];
    __shared__ float s_lse[STAGES][BM], s_delta[STAGES][BM];
    __shared__ i64 s_qlo[BN], s_qhi[BN];  // each key row's admitted query indices (shared: fewer registers)

    const i64 h = launch_head(a), kvh = kv_head_of(a, h), b = blockIdx.z;
    const Pattern p = make_pattern(a, h);
    const i64 k_lo = sel_below(p, a.k_start), k_hi = sel_below(p, a.k_start + a.nk);
    const i64 tk0 = k_lo + (i64)blockIdx.x * BN;
    if (tk0 >= k_hi) return;  // uniform over the block
    const i64 tk_last = min64(tk0 + BN, k_hi) - 1, q_lo = sel_below(p, a.q_start);
    i64 band_lo, band_hi, unused;
    band_queries(a, tk0, &band_lo, &unused);
    band_queries(a, tk_last, &unused, &band_hi);
    const i64 qb_lo = max64(max64(q_lo, div32(tk0, p.per_seg) * p.per_seg), band_lo);
    const i64 qb_hi = min64(min64(sel_below(p, a.q_start + a.nq), (div32(tk_last, p.per_seg) + 1) * p.per_seg), band_hi);
    const TmaMap* map = maps + 4 * (b * gridDim.y + blockIdx.y);  // q, k, v, grad_out of this (batch, head)
    gather_keys(s_krows, BN, p, tk0, k_hi, a, b);
    key_row_queries(s_qlo, s_qhi, s_krows, BN, p, tk0, a);
    mbar_init_ring(kv_full, full, empty, STAGES, 128);

    if (threadIdx.x < 128) {  // the producer warpgroup: one thread issues
        if (threadIdx.x != 0) return;
        mbar_arrive_expect_tx(kv_full, 2 * KT);
        for (int c = 0; c < D; c += PW) {
            tma_load_2d(sK + (c / PW) * BN * W, map + 1, c, (int)(tk0 - k_lo), kv_full);
            tma_load_2d(sV + (c / PW) * BN * W, map + 2, c, (int)(tk0 - k_lo), kv_full);
        }
        int i = 0;
        for (i64 qt = qb_lo; qt < qb_hi; qt += BM, ++i) {
            const int s = i % STAGES;
            if (i >= STAGES) mbar_wait(empty + s, (i / STAGES - 1) & 1);
            for (int j = 0; j < BM; ++j) {  // the tile's rows, lse and delta, released by `full`
                const i64 r = qt + j < qb_hi ? sel_pos(p, qt + j) - a.q_start : -1;
                const i64 ri = (b * a.nq + r) * a.heads + h;
                s_qrows[s][j] = r;
                s_lse[s][j] = r >= 0 ? lse[ri] * LOG2E : NEG_INF;
                s_delta[s][j] = r >= 0 ? delta[ri] : 0.f;
            }
            mbar_arrive_expect_tx(full + s, 2 * QT);
            unsigned char* sq = ring + s * 2 * QT;
            for (int c = 0; c < D; c += PW) {
                tma_load_2d(sq + (c / PW) * BM * W, map, c, (int)(qt - q_lo), full + s);
                tma_load_2d(sq + QT + (c / PW) * BM * W, map + 3, c, (int)(qt - q_lo), full + s);
            }
        }
        return;
    }

    // The consumer warpgroup: warp w owns key rows 16 w.., this thread rows 16 w + g and + 8.
    const int l = threadIdx.x - 128, warp = l >> 5, lane = l & 31, g = lane >> 2, c = lane & 3;
    const int kr0 = warp * 16 + g;
    float dk[NO][4], dv[NO][4];
#pragma unroll
    for (int j = 0; j < NO; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
    }
    const float scale_log2 = a.scale * LOG2E;
    const u64 dK = smem_desc(sK, BN * W, 8 * W, SWZ), dV = smem_desc(sV, BN * W, 8 * W, SWZ);
    mbar_wait(kv_full, 0);
    int i = 0;
    for (i64 qt0 = qb_lo; qt0 < qb_hi; qt0 += BM, ++i) {
        const int s = i % STAGES;
        mbar_wait(full + s, (i / STAGES) & 1);
        const unsigned char* sQ = ring + s * 2 * QT;
        const unsigned char* sG = sQ + QT;
        const u64 dQd = smem_desc(sQ, BM * W, 8 * W, SWZ), dG = smem_desc(sG, BM * W, 8 * W, SWZ);
        // S^T = K Q^T and dP^T = V dO^T over D / 16 k-steps (panel (ks * 32) / W, 32 bytes a step).
        float st[NQ][4], dpt[NQ][4];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const u32 kb = ks * 32, koff = (kb / W) * BN * W + kb % W, qoff = (kb / W) * BM * W + kb % W;
            Wgmma<BM, E>::template ss<0, 0>(&st[0][0], desc_advance(dK, koff), desc_advance(dQd, qoff), ks > 0);
            Wgmma<BM, E>::template ss<0, 0>(&dpt[0][0], desc_advance(dV, koff), desc_advance(dG, qoff), ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands<BM / 2>(&st[0][0]);
        wgmma_fence_operands<BM / 2>(&dpt[0][0]);

        // P^T and dS^T in registers (masked entries 0); dS^T also to shared memory for dQ.
        // Each key row's admitted queries as tile columns [lo, hi) (32-bit: fewer registers).
        const float* tile_lse = s_lse[s];
        const float* tile_delta = s_delta[s];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int lo = (int)min64(max64(s_qlo[kr0 + 8 * r] - qt0, 0), BM);
            const int hi = (int)min64(max64(min64(s_qhi[kr0 + 8 * r], qb_hi) - qt0, 0), BM);
#pragma unroll
            for (int j = 0; j < NQ; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = j * 8 + 2 * c + e;
                    const float lse_q = tile_lse[col];
                    const bool ok = lse_q != NEG_INF && col >= lo && col < hi;
                    const float pt = ok ? exp2_approx(fmaf(st[j][2 * r + e], scale_log2, -lse_q)) : 0.f;
                    st[j][2 * r + e] = pt;
                    dpt[j][2 * r + e] = pt * (dpt[j][2 * r + e] * a.out_scale - tile_delta[col]);
                }
                const u32 off = (u32)(kr0 + 8 * r) * WS + (u32)(j * 8 + 2 * c) * 2;
                *reinterpret_cast<u32*>(sDS + swizzle_offset(off, Swizzle::B128)) =
                    pack2<E>(dpt[j][2 * r], dpt[j][2 * r + 1]);
            }
        }
        fence_proxy_async();  // dS^T's generic stores before wgmma reads them
        bulk_wait_read();     // the previous tile's dQ rows have left sDQ
        warpgroup_sync();

        // dV += P^T dO and dK += dS^T Q: A fragments re-packed from S^T and dS^T, B MN-major
        // (16 query rows of W bytes a step, panels BM W apart).
        u32 pf[BM / 16][4], df[BM / 16][4];
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            pf[kk][0] = pack2<E>(st[2 * kk][0], st[2 * kk][1]);
            pf[kk][1] = pack2<E>(st[2 * kk][2], st[2 * kk][3]);
            pf[kk][2] = pack2<E>(st[2 * kk + 1][0], st[2 * kk + 1][1]);
            pf[kk][3] = pack2<E>(st[2 * kk + 1][2], st[2 * kk + 1][3]);
            df[kk][0] = pack2<E>(dpt[2 * kk][0], dpt[2 * kk][1]);
            df[kk][1] = pack2<E>(dpt[2 * kk][2], dpt[2 * kk][3]);
            df[kk][2] = pack2<E>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
            df[kk][3] = pack2<E>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            Wgmma<D, E>::template rs<1>(&dv[0][0], pf[kk], desc_advance(dG, kk * 16 * W), 1);
            Wgmma<D, E>::template rs<1>(&dk[0][0], df[kk], desc_advance(dQd, kk * 16 * W), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands<D / 2>(&dv[0][0]);
        wgmma_fence_operands<D / 2>(&dk[0][0]);
        const i64 my_row = l < BM ? s_qrows[s][l] : -1;  // this thread's dQ row, read before the stage is freed
        mbar_arrive(empty + s);                          // this stage's Q, dO, rows, lse and delta are read

        // dQ = scale dS K, a panel of PW head dims at a time: A = dS^T (MN-major, 64 queries
        // a 128-byte row, 16 key rows a step), B = K's panel (MN-major), into sDQ.
        const u64 dDS = smem_desc(sDS, BM * WS, 8 * WS, Swizzle::B128);
#pragma unroll
        for (int pn = 0; pn < D / PW; ++pn) {
            float dqa[PW / 8][4];
            const u64 dKp = smem_desc(sK + pn * BN * W, BN * W, 8 * W, SWZ);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                Wgmma<PW, E>::template ss<1, 1>(&dqa[0][0], desc_advance(dDS, kk * 16 * WS),
                                                desc_advance(dKp, kk * 16 * W), kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_operands<PW / 2>(&dqa[0][0]);
#pragma unroll
            for (int j = 0; j < PW / 8; ++j) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    float* at = sDQ + (warp * 16 + g + 8 * r) * D + pn * PW + j * 8 + 2 * c;
                    at[0] = a.scale * dqa[j][2 * r];
                    at[1] = a.scale * dqa[j][2 * r + 1];
                }
            }
        }
        fence_proxy_async();  // sDQ's generic stores before the bulk reductions read them
        warpgroup_sync();     // sDQ complete; every warp done reading sDS
        if (my_row >= 0) {
            bulk_reduce_add_f32(dq_acc + ((b * a.nq + my_row) * a.heads + h) * a.d, sDQ + l * D, (u32)a.d * 4);
            bulk_commit();
        }
    }
    bulk_wait_read();  // no reduction outlives the block's shared memory

    // dK and dV of the block's key rows, as the mma.sync backward writes them (each key/value
    // head row has one writer a launch; `a.out_direct`: straight into the gradients).
    bwd_store_dkv<E, NO>(dk, dv, s_krows, kr0, c, b, kvh, dk_acc, dv_acc, a);
}

// 64 keys a block, a producer and a consumer warpgroup: dilated_bwd_wgmma_<dtype>_d<D>.
#define ATTN_WGMMA_BWD_KERNEL(NAME, E, D)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 1) dilated_bwd_wgmma_##NAME##_d##D(                         \
        const u16* q, const u16* k, const u16* v, const u16* go, const float* lse, const float* delta,             \
        float* dq_acc, float* dk_acc, float* dv_acc, AttnParams a, const TmaMap* maps) {                           \
        bwd_wgmma<E, D, 2>(q, k, v, go, lse, delta, dq_acc, dk_acc, dv_acc, a, maps);                              \
    }
#if ATTN_WANT_F16
ATTN_WGMMA_BWD_KERNEL(f16, F16E, 32)
ATTN_WGMMA_BWD_KERNEL(f16, F16E, 64)
ATTN_WGMMA_BWD_KERNEL(f16, F16E, 128)
#endif
#if ATTN_WANT_BF16
ATTN_WGMMA_BWD_KERNEL(bf16, BF16E, 32)
ATTN_WGMMA_BWD_KERNEL(bf16, BF16E, 64)
ATTN_WGMMA_BWD_KERNEL(bf16, BF16E, 128)
#endif

#endif  // ATTN_HOPPER
