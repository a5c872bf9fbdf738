// dilated_fwd_mma3.cu: the tensor-core forward with three K/V stages (sm_80+), f16/bf16 in,
// f32 accumulation. Blocks, patterns, fusion, masks and the epilogue are those of
// dilated_fwd_mma.cu; the key loop differs:
// - three stages and one barrier a key tile: tile j + 2 starts loading right after the
//   barrier that opens tile j (every warp is then done with tile j - 1, whose stage it
//   refills), so two tiles are in flight while one computes;
// - the full tiles (no mask needed) are found once per block as a range of tile indices,
//   and the loop's per-tile index math (tile columns, each row's admitted keys relative
//   to the block's first key) runs in 32 bits.

template <class E, int D, int BN, int BM, int MT>
__device__ void fwd_mma3(const u16* q, const u16* k, const u16* v, void* o_dst, float* lse_acc, const AttnParams& a,
                         i64 bx, i64 h, i64 b) {
    constexpr int LD = D + 8, NT = 2 * BM / MT;
    ATTN_DYNAMIC_SMEM(smem_raw);
    u16* sQ = reinterpret_cast<u16*>(smem_raw);
    u16* sKs = sQ + BM * LD;
    u16* sVs = sKs + 3 * BN * LD;
    __shared__ i64 s_qrows[BM], s_krows[3][BN];
    __shared__ int s_klo[BM], s_khi[BM];  // each row's admitted keys, relative to kb_lo, in [0, nkeys]

    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
    const i64 kvh = kv_head_of(a, h);
    const Pattern p = make_pattern(a, h);
    const i64 q_hi = sel_below(p, a.q_start + a.nq);
    const i64 t0 = sel_below(p, a.q_start) + bx * BM;
    if (t0 >= q_hi) return;  // uniform over the block
    const i64 t_last = min64(t0 + BM, q_hi) - 1;
    i64 kb_lo, kb_hi;
    block_keys(a, p, t0, t_last, &kb_lo, &kb_hi);
    const int nkeys = (int)max64(kb_hi - kb_lo, 0), ntiles = (nkeys + BN - 1) / BN;
    stage_query_tile<D, LD, NT, BM>(sQ, s_qrows, p, t0, q_hi, q + b * a.q_sb + h * a.q_sh, a);

    const int w0 = warp * 16 * MT;
    for (int i = threadIdx.x; i < BM; i += blockDim.x) {
        i64 lo = 0, hi = 0;
        if (t0 + i <= t_last) row_keys(a, p, t0 + i, &lo, &hi);
        s_klo[i] = (int)min64(max64(lo - kb_lo, 0), nkeys);
        s_khi[i] = (int)min64(max64(hi - kb_lo, 0), nkeys);
    }

    // Tiles [jf_lo, jf_hi) are full: every row valid, unpadded and in one segment (whose
    // keys hold [kb_lo, kb_hi), by block_keys), every key inside every row's band (the
    // last row's band bounds the keys from below, the first row's from above).
    int jf_lo = 0, jf_hi = 0;
    if (a.kpad == nullptr && t0 + BM <= q_hi && div32(t0, p.per_seg) == div32(t0 + BM - 1, p.per_seg)) {
        i64 lo_last, hi_last, lo_first, hi_first;
        band_keys(a, t0 + BM - 1, &lo_last, &hi_last);
        band_keys(a, t0, &lo_first, &hi_first);
        const i64 lo = max64(lo_last - kb_lo, 0), hi = min64(min64(kb_hi, hi_first) - kb_lo, nkeys);
        jf_lo = (int)((lo + BN - 1) / BN);
        jf_hi = hi > 0 ? (int)(hi / BN) : 0;
    }

    RowState<D / 8, MT> st;
    st.clear();
    const float scale_log2 = a.scale * LOG2E;
    const u16* kbase = k + b * a.k_sb + kvh * a.k_sh;
    const u16* vbase = v + b * a.v_sb + kvh * a.v_sh;
    const bool kv_vec = (a.vec & 6) == 6 && a.kpad == nullptr;
    // Start the copy of tile j into stage `stage` as one cp.async group; past the last
    // tile an empty group, so the loop always waits for all groups but the newest.
    auto load_keys = [&](int stage, int j) {
        if (j < ntiles)
            load_kv_tile_async<D, LD, NT, BN>(sKs + stage * BN * LD, sVs + stage * BN * LD, s_krows[stage], p,
                                              kb_lo + (i64)j * BN, kb_hi, kbase, vbase, a, b, kv_vec);
        else
            cp_async_commit();
    };
    load_keys(0, 0);
    load_keys(1, 1);
    const int r0 = w0 + g;  // this thread's first row
    int stage = 0;          // the stage tile j computes from; tile j + 2 loads into the one before it
    for (int j = 0; j < ntiles; ++j) {
        cp_async_wait<1>();  // this thread's copies of tile j (and Q) have landed
        __syncthreads();     // every thread's have; every warp is done with tile j - 1
        load_keys(stage == 0 ? 2 : stage - 1, j + 2);
        const int k0 = j * BN;
        auto cols = [=](int mt, int* lo, int* hi) {  // (s_klo, s_khi: static, not captured)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                lo[i] = min32(max32(s_klo[r0 + mt * 16 + 8 * i] - k0, 0), BN);
                hi[i] = min32(max32(s_khi[r0 + mt * 16 + 8 * i] - k0, 0), BN);
            }
        };
        const bool masked = j < jf_lo || j >= jf_hi;
        attend_tile<E, D, BN, MT, LD>(st, sQ, sKs + stage * BN * LD, sVs + stage * BN * LD, w0, scale_log2, masked,
                                      a.kpad == nullptr ? nullptr : s_krows[stage], cols, false,
                                      [](int, float(*)[4]) {});
        stage = stage == 2 ? 0 : stage + 1;
    }
    cp_async_wait<0>();  // no copy outlives the block (Q's, where no key tile ran)
    fwd_epilogue<E, D / 8, MT>(st, o_dst, lse_acc, s_qrows, w0, t0, t_last, b, h, a);
}

// Shared memory of one block (bytes); mirrored by `mma_smem_bytes` in src/cuda/plan/patterns.rs.
#define MMA3_SMEM(BM, D, BN) (((BM) + 6 * (BN)) * ((D) + 8) * 2)  // dynamic; plus static row indices

// The block shapes of dilated_fwd_mma.cu: dilated_fwd_mma3_[m128_|m128w4_|fused_|persistent_]<dtype>_d<D>.
#define ATTN_MMA3_KERNEL(NAME, E, D, BN) \
    ATTN_FWD_KERNEL(dilated_fwd_mma3_##NAME##_d##D, fwd_mma3, (128), E, D, BN, 64, 1)
#define ATTN_MMA3_KERNEL_M128(NAME, E, D, BN) \
    ATTN_FWD_KERNEL(dilated_fwd_mma3_m128_##NAME##_d##D, fwd_mma3, (256), E, D, BN, 128, 1)
#define ATTN_MMA3_KERNEL_M128W4(NAME, E, D, BN) \
    ATTN_FWD_KERNEL(dilated_fwd_mma3_m128w4_##NAME##_d##D, fwd_mma3, (128), E, D, BN, 128, 2)
// The fused kernel's launch bound admits one block an SM (what its shared memory allows at
// head dim 128 anyway), so ptxas keeps its pattern table's registers without spilling.
#define ATTN_MMA3_KERNEL_FUSED(NAME, E, D, BN) \
    ATTN_FWD_FUSED_KERNEL(dilated_fwd_mma3_fused_##NAME##_d##D, fwd_mma3, (128, 1), E, D, BN)
#define ATTN_MMA3_KERNEL_PERSISTENT(NAME, E, D, BN) \
    ATTN_FWD_PERSISTENT_KERNEL(dilated_fwd_mma3_persistent_##NAME##_d##D, fwd_mma3, (128, 1), E, D, BN)

// The key tiles of dilated_fwd_mma.cu (64, and 32 where the accumulators are large: two
// row tiles a warp at head dim 128 would spill registers with 64); 128 rows at head dim
// 256 would pass sm_80's shared memory.
#define ATTN_MMA3_KERNELS(NAME, E)            \
    ATTN_MMA3_KERNEL(NAME, E, 32, 64)         \
    ATTN_MMA3_KERNEL(NAME, E, 64, 64)         \
    ATTN_MMA3_KERNEL(NAME, E, 128, 64)        \
    ATTN_MMA3_KERNEL(NAME, E, 256, 32)        \
    ATTN_MMA3_KERNEL_M128(NAME, E, 32, 64)    \
    ATTN_MMA3_KERNEL_M128(NAME, E, 64, 64)    \
    ATTN_MMA3_KERNEL_M128(NAME, E, 128, 64)   \
    ATTN_MMA3_KERNEL_M128W4(NAME, E, 32, 64)  \
    ATTN_MMA3_KERNEL_M128W4(NAME, E, 64, 64)  \
    ATTN_MMA3_KERNEL_M128W4(NAME, E, 128, 32) \
    ATTN_MMA3_KERNEL_FUSED(NAME, E, 32, 64)   \
    ATTN_MMA3_KERNEL_FUSED(NAME, E, 64, 64)   \
    ATTN_MMA3_KERNEL_FUSED(NAME, E, 128, 64)  \
    ATTN_MMA3_KERNEL_FUSED(NAME, E, 256, 32)       \
    ATTN_MMA3_KERNEL_PERSISTENT(NAME, E, 32, 64)   \
    ATTN_MMA3_KERNEL_PERSISTENT(NAME, E, 64, 64)   \
    ATTN_MMA3_KERNEL_PERSISTENT(NAME, E, 128, 64)  \
    ATTN_MMA3_KERNEL_PERSISTENT(NAME, E, 256, 32)

#if ATTN_WANT_F16
ATTN_MMA3_KERNELS(f16, F16E)
#endif
#if ATTN_WANT_BF16
ATTN_MMA3_KERNELS(bf16, BF16E)
#endif
