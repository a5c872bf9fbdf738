// dilated_fwd_wgmma.cu: the sm_90a forward for f16/bf16 (f32 accumulation): TMA tiles,
// an mbarrier ring and wgmma, warp-specialised.
//
// A block owns 64 consecutive SELECTED query indices of one (batch, head, pattern) and has
// two warpgroups: the producer (thread 0 issues every copy) and the consumer (64 rows, 16
// a warp). Where the selected positions of a block are one stride (off + t r: the pattern's
// r divides w, or a window), a 2-D tensor map over rows t of stride r * seq_stride makes
// every tile of selected rows one contiguous TMA box, so the dilation gather costs nothing;
// the host encodes three maps per (batch, head) of the launch: q, k and v of that head's
// offset (params `maps`, [3][batch][heads of the launch]). Boxes are panels of 64 columns
// (32 for head_dim 32) in the 128-byte (64-byte) swizzle, rows past the map and columns
// past head_dim zero-filled. The producer loads Q once, then K/V tiles into a ring of
// STAGES buffers: it waits for the buffer's `empty` phase, announces the bytes on its
// `full` barrier and issues the loads. The consumer waits for `full`, computes S = Q K^T
// (wgmma, Q and K from shared memory, K-major), masks where the tile is not full (segment,
// band, padded keys from the row table the producer writes with a tile), runs the online
// softmax in registers, computes O += P V (wgmma, P from registers: the S accumulators
// re-packed, V MN-major) and arrives on `empty`. The epilogue is the mma.sync forward's
// (fwd_epilogue: LSE-merge into the f32 partial, or the output and LSE directly).
// Not yet here: the softmax of one tile overlapped with the next tile's MMAs, several
// consumer warpgroups, fused launches, head_dim 256, patterns whose rows are not one
// stride (the host keeps the mma.sync kernels for those).

#ifdef ATTN_HOPPER

// Shared-memory bytes of the sm_90a forward: up to 1023 to align, Q, STAGES K/V tiles, the
// barriers.
#define WGMMA_FWD_SMEM(D, BN, STAGES) (1024 + 64 * (D) * 2 + (STAGES) * 2 * (BN) * (D) * 2 + 1024)

template <class E, int D, int BN, int STAGES>
__device__ void fwd_wgmma(const u16* q, const u16* k, const u16* v, void* o_dst, float* lse_acc, const AttnParams& a,
                          const TmaMap* maps, i64 bx, i64 h) {
    constexpr int BM = 64, PW = D < 64 ? D : 64;  // panel width (elements): one swizzle row
    constexpr u32 W = PW * 2, TILE = BN * D * 2;
    constexpr Swizzle SWZ = W == 128 ? Swizzle::B128 : Swizzle::B64;
    ATTN_DYNAMIC_SMEM(smem_raw);
    unsigned char* smem = align_1024(smem_raw);  // every tile on its swizzle pattern's start
    u16* sQ = reinterpret_cast<u16*>(smem);
    unsigned char* ring = smem + BM * D * 2;  // stage s: K at s * 2 TILE, V after it
    u64* bars = reinterpret_cast<u64*>(ring + STAGES * 2 * TILE);  // q_full, full[], empty[]
    u64 *q_full = bars, *full = bars + 1, *empty = bars + 1 + STAGES;
    __shared__ i64 s_qrows[BM], s_krows[STAGES][BN];

    const i64 b = blockIdx.z;
    const Pattern p = make_pattern(a, h);
    const i64 q_lo = sel_below(p, a.q_start), q_hi = sel_below(p, a.q_start + a.nq);
    const i64 t0 = q_lo + bx * BM;
    if (t0 >= q_hi) return;  // uniform over the block
    const i64 t_last = min64(t0 + BM, q_hi) - 1, k_lo = sel_below(p, a.k_start);
    i64 kb_lo, kb_hi;
    block_keys(a, p, t0, t_last, &kb_lo, &kb_hi);
    const TmaMap* map = maps + 3 * (b * gridDim.y + blockIdx.y);  // q, k, v of this (batch, head)
    gather_rows(s_qrows, BM, p, t0, q_hi, a.q_start);
    mbar_init_ring(q_full, full, empty, STAGES, 128);

    if (threadIdx.x < 128) {  // the producer warpgroup: one thread issues
        if (threadIdx.x != 0) return;
        mbar_arrive_expect_tx(q_full, BM * D * 2);
        for (int c = 0; c < D; c += PW) tma_load_2d(smem + (c / PW) * BM * W, map, c, (int)(t0 - q_lo), q_full);
        int i = 0;
        for (i64 kt = kb_lo; kt < kb_hi; kt += BN, ++i) {
            const int s = i % STAGES;
            if (i >= STAGES) mbar_wait(empty + s, (i / STAGES - 1) & 1);
            if (a.kpad != nullptr)  // the tile's key rows for the padding mask, released by `full`
                for (int j = 0; j < BN; ++j) s_krows[s][j] = key_row(p, kt + j, kb_hi, a, b);
            mbar_arrive_expect_tx(full + s, 2 * TILE);
            unsigned char* sk = ring + s * 2 * TILE;
            for (int c = 0; c < D; c += PW) {
                tma_load_2d(sk + (c / PW) * BN * W, map + 1, c, (int)(kt - k_lo), full + s);
                tma_load_2d(sk + TILE + (c / PW) * BN * W, map + 2, c, (int)(kt - k_lo), full + s);
            }
        }
        return;
    }

    // The consumer warpgroup: warp w owns rows 16 w.., this thread rows 16 w + g and + 8.
    const int warp = (threadIdx.x - 128) >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int w0 = warp * 16;
    i64 klo[2], khi[2];  // this thread's rows' admitted keys (empty past t_last)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        klo[i] = khi[i] = 0;
        if (t0 + w0 + g + 8 * i <= t_last) row_keys(a, p, t0 + w0 + g + 8 * i, &klo[i], &khi[i]);
    }
    RowState<D / 8, 1> st;
    st.clear();
    const float scale_log2 = a.scale * LOG2E;
    mbar_wait(q_full, 0);
    int i = 0;
    for (i64 kt0 = kb_lo; kt0 < kb_hi; kt0 += BN, ++i) {
        const int s = i % STAGES;
        mbar_wait(full + s, (i / STAGES) & 1);
        const u16* sK = reinterpret_cast<const u16*>(ring + s * 2 * TILE);
        const u16* sV = reinterpret_cast<const u16*>(ring + s * 2 * TILE + TILE);
        // S = Q K^T over D / 16 k-steps; panel (ks * 32) / W of Q and K, 32 bytes a step.
        float sacc[BN / 8][4];
        const u64 dq = smem_desc(sQ, BM * W, 8 * W, SWZ), dk = smem_desc(sK, BN * W, 8 * W, SWZ);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const u32 kb = ks * 32, qoff = (kb / W) * BM * W + kb % W, koff = (kb / W) * BN * W + kb % W;
            Wgmma<BN, E>::template ss<0, 0>(&sacc[0][0], desc_advance(dq, qoff), desc_advance(dk, koff), ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands<BN / 2>(&sacc[0][0]);
        if (!full_tile(p, t0, BM, q_hi, kt0, BN, kb_hi, a)) {
            int lo[2], hi[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                lo[r] = (int)min64(max64(klo[r] - kt0, 0), BN);
                hi[r] = (int)min64(max64(min64(khi[r], kb_hi) - kt0, 0), BN);
            }
            mask_scores<BN / 8>(sacc, lo, hi, c, a.kpad == nullptr ? nullptr : s_krows[s]);
        }
        online_softmax<BN / 8, D / 8>(sacc, st.m[0], st.l[0], st.o[0], scale_log2);
        // O += P V over BN / 16 k-steps: P's A fragment is S's blocks 2 kk and 2 kk + 1,
        // packed before the fence (a register written between wgmmas serialises them); V is
        // MN-major: 16 key rows of W bytes a step, its panels BN W apart.
        u32 pf[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            pf[kk][0] = pack2<E>(sacc[2 * kk][0], sacc[2 * kk][1]);
            pf[kk][1] = pack2<E>(sacc[2 * kk][2], sacc[2 * kk][3]);
            pf[kk][2] = pack2<E>(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]);
            pf[kk][3] = pack2<E>(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3]);
        }
        const u64 dv = smem_desc(sV, BN * W, 8 * W, SWZ);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            Wgmma<D, E>::template rs<1>(&st.o[0][0][0], pf[kk], desc_advance(dv, kk * 16 * W), 1);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands<D / 2>(&st.o[0][0][0]);
        mbar_arrive(empty + s);  // this stage's K and V are read
    }
    fwd_epilogue<E, D / 8, 1>(st, o_dst, lse_acc, s_qrows, w0, t0, t_last, b, h, a);
}

// 64 query rows, a producer and a consumer warpgroup: dilated_fwd_wgmma_<dtype>_d<D>.
#define ATTN_WGMMA_FWD_KERNEL(NAME, E, D)                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                              \
        dilated_fwd_wgmma_##NAME##_d##D(const u16* q, const u16* k, const u16* v, void* o_dst, float* lse_acc,     \
                                        AttnParams a, const TmaMap* maps) {                                        \
        fwd_wgmma<E, D, 64, 2>(q, k, v, o_dst, lse_acc, a, maps, blockIdx.x, launch_head(a));                      \
    }
#if ATTN_WANT_F16
ATTN_WGMMA_FWD_KERNEL(f16, F16E, 32)
ATTN_WGMMA_FWD_KERNEL(f16, F16E, 64)
ATTN_WGMMA_FWD_KERNEL(f16, F16E, 128)
#endif
#if ATTN_WANT_BF16
ATTN_WGMMA_FWD_KERNEL(bf16, BF16E, 32)
ATTN_WGMMA_FWD_KERNEL(bf16, BF16E, 64)
ATTN_WGMMA_FWD_KERNEL(bf16, BF16E, 128)
#endif

#endif  // ATTN_HOPPER
