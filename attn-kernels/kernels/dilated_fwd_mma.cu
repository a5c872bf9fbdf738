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
// A block mask (read by the `_bm_` instances only; positions global, as the row kernels
// read it): a key tile whose every
// (query block, key block) pair is removed is skipped (no loads, no MMA; tile_blocks in
// mma_tiles.cu), a tile with removed and kept pairs masks the removed ones' scores.
// Fragment layouts: see mma_tiles.cu.

template <class E, int D, int BN, int BM, int MT, BlockMasking MK = BM_IGNORE>
__device__ void fwd_mma(const u16* q, const u16* k, const u16* v, void* o_dst, float* lse_acc, const AttnParams& a,
                        i64 bx, i64 h, i64 b) {
    // NT: threads of the block, a warp per MT row tiles of 16.
    constexpr int LD = D + 8, NT = 2 * BM / MT;
    ATTN_DYNAMIC_SMEM(smem_raw);
    // Q tile, then two K/V stages (double buffering: the next tile loads while this one runs).
    u16* sQ = reinterpret_cast<u16*>(smem_raw);
    u16* sKs = sQ + BM * LD;
    u16* sVs = sKs + 2 * BN * LD;
    __shared__ i64 s_qrows[BM], s_krows[2][BN];
    __shared__ i64 s_klo[BM], s_khi[BM];  // each row's admitted key indices (shared: fewer registers)
    __shared__ int s_qblk[BM], s_kblk[2][BN];  // mask blocks of the rows and of each stage's keys

    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
    const i64 kvh = kv_head_of(a, h);
    const Pattern p = make_pattern(a, h);
    const i64 q_hi = sel_below(p, a.q_start + a.nq);
    const i64 t0 = sel_below(p, a.q_start) + bx * BM;
    if (t0 >= q_hi) return;  // uniform over the block
    const i64 t_last = min64(t0 + BM, q_hi) - 1;
    i64 kb_lo, kb_hi;
    block_keys(a, p, t0, t_last, &kb_lo, &kb_hi);
    // Q's copy is its own group, waited for with the first K/V tile's.
    stage_query_tile<D, LD, NT, BM>(sQ, s_qrows, p, t0, q_hi, q + b * a.q_sb + h * a.q_sh, a);

    // This warp's first row in the tile; row tile mt covers rows w0 + 16 mt .. + 16, and
    // this thread holds rows w0 + 16 mt + g and + 8 of it.
    const int w0 = warp * 16 * MT;
    // Each row's admitted key indices [klo, khi): its segment cut by its band (empty past
    // t_last). Read after the first barrier of the key loop.
    for (int i = threadIdx.x; i < BM; i += blockDim.x) {
        i64 lo = 0, hi = 0;
        if (t0 + i <= t_last) row_keys(a, p, t0 + i, &lo, &hi);
        s_klo[i] = lo;
        s_khi[i] = hi;
    }
    if (MK == BM_READ) gather_blocks(s_qblk, BM, p, t0, t_last + 1, a);

    RowState<D / 8, MT> st;
    st.clear();
    const float scale_log2 = a.scale * LOG2E;
    const u16* kbase = k + b * a.k_sb + kvh * a.k_sh;
    const u16* vbase = v + b * a.v_sb + kvh * a.v_sh;
    // Start the copy of key tile kt into stage st (one cp.async group): by stepped
    // pointers where the tile is affine (uniform over the block; no gather into s_krows).
    const bool kv_vec = (a.vec & 6) == 6 && a.kpad == nullptr;
    auto load_keys = [&](int stage, i64 kt) {
        load_kv_tile_async<D, LD, NT, BN>(sKs + stage * BN * LD, sVs + stage * BN * LD, s_krows[stage], p, kt, kb_hi,
                                          kbase, vbase, a, b, kv_vec);
        if (MK == BM_READ) gather_blocks(s_kblk[stage], BN, p, kt, kb_hi, a);
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
    if (kt0 < kb_hi) load_keys(0, kt0);  // stage the first K/V tile
    int stage = 0;
    for (i64 kt_next; kt0 < kb_hi; kt0 = kt_next, stage ^= 1) {
        kt_next = next_tile(kt0 + BN);
        if (kt_next < kb_hi) {  // start the next tile into the other stage, wait for this one
            load_keys(stage ^ 1, kt_next);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // this stage (and sQ, the first time) visible to every warp
        // The mask (key valid and not padding, inside the row's segment and band) only
        // where the tile is not full. Keys past kb_hi are cut by column; s_krows is read
        // only for padding, whose tiles are never affine. The block mask only where the
        // tile's blocks are mixed.
        const bool full = full_tile(p, t0, BM, q_hi, kt0, BN, kb_hi, a);
        const i64 *klo = s_klo + w0 + g, *khi = s_khi + w0 + g;  // this thread's rows
        auto cols = [=](int mt, int* lo, int* hi) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                lo[i] = (int)min64(max64(klo[mt * 16 + 8 * i] - kt0, 0), BN);
                hi[i] = (int)min64(max64(min64(khi[mt * 16 + 8 * i], kb_hi) - kt0, 0), BN);
            }
        };
        const int* kblk = s_kblk[stage];
        auto blocks = [&](int mt, float (*s)[4]) {
            mask_blocks<BN / 8>(s, a, b, h, s_qblk + w0 + mt * 16 + g, kblk, (int)(threadIdx.x & 3));
        };
        attend_tile<E, D, BN, MT, LD>(st, sQ, sKs + stage * BN * LD, sVs + stage * BN * LD, w0, scale_log2, !full,
                                      a.kpad == nullptr ? nullptr : s_krows[stage], cols,
                                      tile_mask(kt0) == TILE_MIXED, blocks);
        __syncthreads();  // every warp is done with this stage before it is refilled
    }
    cp_async_wait<0>();  // no copy outlives the block (Q's, where no key tile ran)
    fwd_epilogue<E, D / 8, MT>(st, o_dst, lse_acc, s_qrows, w0, t0, t_last, b, h, a);
}

// Shared memory of one block (bytes); mirrored by `mma_smem_bytes` in src/cuda/plan/patterns.rs.
#define MMA_SMEM(BM, D, BN) (((BM) + 4 * (BN)) * ((D) + 8) * 2)  // dynamic; plus static row indices

// 64 query rows over 4 warps: dilated_fwd_mma_<dtype>_d<D>.
#define ATTN_MMA_KERNEL(NAME, E, D, BN) ATTN_FWD_KERNEL(dilated_fwd_mma_##NAME##_d##D, fwd_mma, (128), E, D, BN, 64, 1)

// 128 query rows over 8 warps (each K/V tile serves twice the rows): dilated_fwd_mma_m128_<dtype>_d<D>.
#define ATTN_MMA_KERNEL_M128(NAME, E, D, BN) \
    ATTN_FWD_KERNEL(dilated_fwd_mma_m128_##NAME##_d##D, fwd_mma, (256), E, D, BN, 128, 1)

// 128 query rows over 4 warps, 32 a warp (each K/V fragment read from shared memory feeds two
// row tiles; twice the accumulator registers): dilated_fwd_mma_m128w4_<dtype>_d<D>, D <= 128.
#define ATTN_MMA_KERNEL_M128W4(NAME, E, D, BN) \
    ATTN_FWD_KERNEL(dilated_fwd_mma_m128w4_##NAME##_d##D, fwd_mma, (128), E, D, BN, 128, 2)

// 64 query rows over 4 warps reading the block mask: dilated_fwd_mma_bm_<dtype>_d<D>.
template <class E, int D, int BN, int BM, int MT>
__device__ void fwd_mma_bm(const u16* q, const u16* k, const u16* v, void* o_dst, float* lse_acc, const AttnParams& a,
                           i64 bx, i64 h, i64 b) {
    fwd_mma<E, D, BN, BM, MT, BM_READ>(q, k, v, o_dst, lse_acc, a, bx, h, b);
}
#define ATTN_MMA_KERNEL_BM(NAME, E, D, BN) \
    ATTN_FWD_KERNEL(dilated_fwd_mma_bm_##NAME##_d##D, fwd_mma_bm, (128), E, D, BN, 64, 1)

// 64 query rows over 4 warps, the patterns of a fused launch: dilated_fwd_mma_fused_<dtype>_d<D>.
#define ATTN_MMA_KERNEL_FUSED(NAME, E, D, BN) \
    ATTN_FWD_FUSED_KERNEL(dilated_fwd_mma_fused_##NAME##_d##D, fwd_mma, (128), E, D, BN)

// The fused kernel's blocks as work items of a persistent launch: dilated_fwd_mma_persistent_<dtype>_d<D>.
#define ATTN_MMA_KERNEL_PERSISTENT(NAME, E, D, BN) \
    ATTN_FWD_PERSISTENT_KERNEL(dilated_fwd_mma_persistent_##NAME##_d##D, fwd_mma, (128), E, D, BN)

#if ATTN_WANT_F16
ATTN_MMA_KERNEL(f16, F16E, 32, 64)
ATTN_MMA_KERNEL_BM(f16, F16E, 32, 64)
ATTN_MMA_KERNEL_BM(f16, F16E, 64, 64)
ATTN_MMA_KERNEL_BM(f16, F16E, 128, 64)
ATTN_MMA_KERNEL_BM(f16, F16E, 256, 32)
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
ATTN_MMA_KERNEL_PERSISTENT(f16, F16E, 32, 64)
ATTN_MMA_KERNEL_PERSISTENT(f16, F16E, 64, 64)
ATTN_MMA_KERNEL_PERSISTENT(f16, F16E, 128, 64)
ATTN_MMA_KERNEL_PERSISTENT(f16, F16E, 256, 32)
#endif
#if ATTN_WANT_BF16
ATTN_MMA_KERNEL(bf16, BF16E, 32, 64)
ATTN_MMA_KERNEL_BM(bf16, BF16E, 32, 64)
ATTN_MMA_KERNEL_BM(bf16, BF16E, 64, 64)
ATTN_MMA_KERNEL_BM(bf16, BF16E, 128, 64)
ATTN_MMA_KERNEL_BM(bf16, BF16E, 256, 32)
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
ATTN_MMA_KERNEL_PERSISTENT(bf16, BF16E, 32, 64)
ATTN_MMA_KERNEL_PERSISTENT(bf16, BF16E, 64, 64)
ATTN_MMA_KERNEL_PERSISTENT(bf16, BF16E, 128, 64)
ATTN_MMA_KERNEL_PERSISTENT(bf16, BF16E, 256, 32)
#endif
