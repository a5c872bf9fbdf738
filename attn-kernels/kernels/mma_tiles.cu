// mma_tiles.cu: tensor-core building blocks shared by the MMA forward and backward:
// mma.sync.m16n8k16 (f16/bf16 in, f32 accumulate), packing, and the gathered tile loads
// (the dilation gather happens here: row t of a tile is block row sel_pos(t) - start),
// with a gather-free path for tiles inside one segment, whose rows are affine in t.
//
// Fragment layout of mma.m16n8k16 (g = lane / 4, c = lane % 4):
//   A (16x16, row): a0 = (g, 2c..2c+1), a1 = (g+8, 2c..), a2 = (g, 2c+8..), a3 = (g+8, 2c+8..)
//   B (16x8, col):  b0 = (k 2c..2c+1, n g), b1 = (k 2c+8.., n g)
//   C (16x8, f32):  c0, c1 = (g, 2c..2c+1), c2, c3 = (g+8, 2c..2c+1)
// so a C tile pair (n-blocks 2j, 2j+1) re-packed as f16/bf16 pairs is exactly an A tile.

#ifdef ATTN_CPU_EMULATION
__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b, BF16E) { emu_mma16816<BF16E>(c, a, b); }
__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b, F16E) { emu_mma16816<F16E>(c, a, b); }
#else
__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b, BF16E) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b, F16E) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

template <class E>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    return (u32)E::from_f(lo) | ((u32)E::from_f(hi) << 16);
}

__device__ __forceinline__ u32 lds32(const u16* p) {
    ATTN_ALIGNED(p, 4);
    return *reinterpret_cast<const u32*>(p);
}

// ldmatrix.x4: lane l gives the address of row (l % 8) of 8x8 matrix l / 8 (16 bytes each);
// r[i] of lane l gets matrix i's (row l/4, cols 2(l%4)..+1), or with .trans its
// (rows 2(l%4)..+1, col l/4) -- exactly the A / B fragment pieces of mma.m16n8k16.
#ifdef ATTN_CPU_EMULATION
__device__ __forceinline__ void ldsm_x4(u32* r, const u16* p) { emu_ldmatrix_x4(r, p, false); }
__device__ __forceinline__ void ldsm_x4_trans(u32* r, const u16* p) { emu_ldmatrix_x4(r, p, true); }
#else
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void ldsm_x4(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}
#endif

// Row indices (inside the block) of `rows` gathered rows: selected indices t0.. of
// pattern p, -1 where t >= t_hi. One i64 division per row, shared by the tile loads.
__device__ __forceinline__ void gather_rows(i64* s_rows, int rows, const Pattern& p, i64 t0, i64 t_hi, i64 pos0) {
    for (int i = threadIdx.x; i < rows; i += blockDim.x) {
        const i64 t = t0 + i;
        s_rows[i] = t < t_hi ? sel_pos(p, t) - pos0 : -1;
    }
}

// Copy gathered rows into shared tile `dst` ([rows][LD], u16), zero-filling invalid rows
// and columns >= d. `base` points at (batch, row 0, head) of the block. Needs a barrier
// after gather_rows.
template <int D, int LD>
__device__ __forceinline__ void load_tile(u16* dst, const i64* s_rows, int rows, const u16* base, i64 row_stride,
                                          i64 d, bool vec) {
    if (vec) {  // d % 8 == 0, strides % 8 == 0: 16-byte chunks
        constexpr int CH = D / 8;
        for (int i = threadIdx.x; i < rows * CH; i += blockDim.x) {
            const int row = i / CH, ch = i % CH;
            const i64 r = s_rows[row];
            uint4 val = make_uint4(0u, 0u, 0u, 0u);
            if (r >= 0 && ch * 8 < d) {
                const u16* src = base + r * row_stride + ch * 8;
                ATTN_ALIGNED(src, 16);
                val = *reinterpret_cast<const uint4*>(src);
            }
            ATTN_ALIGNED(dst + row * LD + ch * 8, 16);
            *reinterpret_cast<uint4*>(dst + row * LD + ch * 8) = val;
        }
    } else {
        for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
            const int row = i / D, col = i % D;
            const i64 r = s_rows[row];
            dst[row * LD + col] = (r >= 0 && col < d) ? base[r * row_stride + col] : (u16)0;
        }
    }
}

// cp.async (sm_80+): 16-byte global -> shared copies that complete in the background;
// `src_bytes = 0` writes zeros. commit/wait group them (the emulator holds each copy
// until its wait). cp_async16_at copies to dst + off (elements): with a constant off the
// 32-bit shared address of dst is shared and off folds into the instruction.
#ifdef ATTN_CPU_EMULATION
__device__ __forceinline__ void cp_async16_at(u16* dst, int off, const u16* src, int src_bytes) {
    emu_cp_async16(dst + off, src, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { emu_cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    emu_cp_async_wait(N);
}
#else
__device__ __forceinline__ void cp_async16_at(u16* dst, int off, const u16* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst) + 2 * off), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
#endif
__device__ __forceinline__ void cp_async16(u16* dst, const u16* src, int src_bytes) {
    cp_async16_at(dst, 0, src, src_bytes);
}

// Like load_tile, but the 16-byte path goes through cp.async (call cp_async_commit after,
// and cp_async_wait + __syncthreads before reading). Needs a barrier after gather_rows.
template <int D, int LD>
__device__ __forceinline__ void load_tile_async(u16* dst, const i64* s_rows, int rows, const u16* base,
                                                i64 row_stride, i64 d, bool vec) {
    if (vec) {
        constexpr int CH = D / 8;
        for (int i = threadIdx.x; i < rows * CH; i += blockDim.x) {
            const int row = i / CH, ch = i % CH;
            const i64 r = s_rows[row];
            const bool ok = r >= 0 && ch * 8 < d;
            cp_async16(dst + row * LD + ch * 8, ok ? base + r * row_stride + ch * 8 : base, ok ? 16 : 0);
        }
    } else {
        load_tile<D, LD>(dst, s_rows, rows, base, row_stride, d, false);
    }
}

// A tile [t0, t0 + n) of selected indices inside one segment and below t_end has rows
// row0 + i * r (affine, no gather needed): row0 = sel_pos(t0) - pos0 (>= 0), else -1.
__device__ __forceinline__ i64 affine_row0(const Pattern& p, i64 t0, i64 n, i64 t_end, i64 pos0) {
    return t0 + n <= t_end && mod32(t0, p.per_seg) + n <= p.per_seg ? sel_pos(p, t0) - pos0 : -1;
}

// load_tile_async (16-byte path) of an affine tile: row i at src0 + i * step. With NT
// threads each thread keeps one chunk column and steps its pointers by a constant: no
// row table, no barrier before, no per-chunk index math.
template <int D, int LD, int NT, int ROWS>
__device__ __forceinline__ void load_tile_affine_async(u16* dst, const u16* src0, i64 step, i64 d) {
    constexpr int CH = D / 8, RS = NT / CH;
    static_assert(NT % CH == 0 && ROWS % RS == 0, "whole passes of the block over the tile");
    const int ch = threadIdx.x % CH, row = threadIdx.x / CH;
    const int n = ch * 8 < d ? 16 : 0;  // columns past d: zero-filled, from a valid address
    const u16* src = src0 + row * step + (n ? ch * 8 : 0);
    u16* out = dst + row * LD + ch * 8;
#pragma unroll
    for (int it = 0; it < ROWS / RS; ++it, src += RS * step) cp_async16_at(out, it * RS * LD, src, n);
}

// Row of the k block of selected key index t, or -1 at or past t_hi or where padded.
__device__ __forceinline__ i64 key_row(const Pattern& p, i64 t, i64 t_hi, const AttnParams& a, i64 b) {
    const i64 r = t < t_hi ? sel_pos(p, t) - a.k_start : -1;
    return r >= 0 && key_padded(a, b, r) ? -1 : r;
}

// gather_rows for key tiles: padded keys get -1 too (zero-filled, masked out like rows
// past the block).
__device__ __forceinline__ void gather_keys(i64* s_rows, int rows, const Pattern& p, i64 t0, i64 t_hi,
                                            const AttnParams& a, i64 b) {
    for (int i = threadIdx.x; i < rows; i += blockDim.x) s_rows[i] = key_row(p, t0 + i, t_hi, a, b);
}

// Selected key indices [*lo, *hi) that query t reads: its segment cut by its band.
__device__ __forceinline__ void row_keys(const AttnParams& a, const Pattern& p, i64 t, i64* lo, i64* hi) {
    const i64 seg = div32(t, p.per_seg);
    band_keys(a, t, lo, hi);
    *lo = max64(seg * p.per_seg, *lo);
    *hi = min64((seg + 1) * p.per_seg, *hi);
}

// Selected key indices [*kb_lo, *kb_hi) that the query rows t0..=t_last of one block read:
// the keys of their segments inside the k block, cut by the first row's and the last
// row's band.
__device__ __forceinline__ void block_keys(const AttnParams& a, const Pattern& p, i64 t0, i64 t_last, i64* kb_lo,
                                           i64* kb_hi) {
    i64 band_lo, band_hi, unused;
    band_keys(a, t0, &band_lo, &unused);
    band_keys(a, t_last, &unused, &band_hi);
    *kb_lo = max64(max64(sel_below(p, a.k_start), div32(t0, p.per_seg) * p.per_seg), band_lo);
    *kb_hi = min64(min64(sel_below(p, a.k_start + a.nk), (div32(t_last, p.per_seg) + 1) * p.per_seg), band_hi);
}

// Start the copy of key tile kt (BN selected key indices below kb_hi) of K and V into dK,
// dV as one cp.async group: by stepped pointers where `affine` (16-byte rows, no padding)
// and the tile is inside one segment (both uniform over the block), else through the
// block's gather of the rows into s_krows.
template <int D, int LD, int NT, int BN>
__device__ __forceinline__ void load_kv_tile_async(u16* dK, u16* dV, i64* s_krows, const Pattern& p, i64 kt,
                                                   i64 kb_hi, const u16* kbase, const u16* vbase, const AttnParams& a,
                                                   i64 b, bool affine) {
    const i64 row0 = affine ? affine_row0(p, kt, BN, kb_hi, a.k_start) : -1;
    if (row0 >= 0) {
        load_tile_affine_async<D, LD, NT, BN>(dK, kbase + row0 * a.k_ss, p.r * a.k_ss, a.d);
        load_tile_affine_async<D, LD, NT, BN>(dV, vbase + row0 * a.v_ss, p.r * a.v_ss, a.d);
    } else {
        gather_keys(s_krows, BN, p, kt, kb_hi, a, b);
        __syncthreads();
        load_tile_async<D, LD>(dK, s_krows, BN, kbase, a.k_ss, a.d, a.vec & 2);
        load_tile_async<D, LD>(dV, s_krows, BN, vbase, a.v_ss, a.d, a.vec & 4);
    }
    cp_async_commit();
}

// Whether every (row, key) of a tile is attended: rows [t0, t0+m) and keys [k0, k0+n)
// all valid, all in one segment, every key inside every row's band, and no padding
// mask (padded keys need the per-key test). Then no mask is needed.
__device__ __forceinline__ bool full_tile(const Pattern& p, i64 t0, i64 m, i64 t_end, i64 k0, i64 n, i64 k_end,
                                          const AttnParams& a) {
    const i64 seg = div32(t0, p.per_seg);
    if (a.kpad != nullptr || !(t0 + m <= t_end && k0 + n <= k_end && div32(t0 + m - 1, p.per_seg) == seg &&
                               div32(k0, p.per_seg) == seg && div32(k0 + n - 1, p.per_seg) == seg))
        return false;
    // The band's lower edge grows with the row: the last row's bounds the keys from
    // below, the first row's upper edge bounds them from above.
    i64 lo_last, hi_last, lo_first, hi_first;
    band_keys(a, t0 + m - 1, &lo_last, &hi_last);
    band_keys(a, t0, &lo_first, &hi_first);
    return k0 >= lo_last && k0 + n <= hi_first;
}

// Block-mask state of a tile, over the (query block, key block) pairs its rows and keys
// touch: every pair removed (skip the tile: no loads, no MMA), every pair kept (no block
// test), or mixed (mask_blocks on each score).
#define TILE_REMOVED 0
#define TILE_KEPT 1
#define TILE_MIXED 2

// Whether a kernel instance reads the block mask: the instances that do are their own
// kernels (`_bm_` in the name), so the others compile as if no mask existed.
enum BlockMasking { BM_IGNORE = 0, BM_READ = 1 };

// Whether mask block `blk` holds a selected position of pattern p in [lo, hi]: with
// dilation a tile's positions are r apart, so a block inside its span may hold none.
__device__ __forceinline__ bool block_holds(const AttnParams& a, const Pattern& p, i64 blk, i64 lo, i64 hi) {
    const i64 x0 = max64(blk * a.bm_size, lo), x1 = min64((blk + 1) * a.bm_size, hi + 1);
    return x0 < x1 && sel_below(p, x1) > sel_below(p, x0);
}

// The block-mask state of query selected indices [tq, tq_end) against key selected indices
// [tk, tk_end) of head h, batch b (TILE_KEPT without a mask). The blocks follow from the
// global positions of the first and last index of each side.
__device__ __forceinline__ int tile_blocks(const AttnParams& a, const Pattern& p, i64 b, i64 h, i64 tq, i64 tq_end,
                                           i64 tk, i64 tk_end) {
    if (a.bmask == nullptr) return TILE_KEPT;
    if (tq >= tq_end || tk >= tk_end) return TILE_REMOVED;
    const i64 q0 = sel_pos(p, tq), q1 = sel_pos(p, tq_end - 1), k0 = sel_pos(p, tk), k1 = sel_pos(p, tk_end - 1);
    bool kept = false, removed = false;
    for (i64 qb = div32(q0, a.bm_size); qb <= div32(q1, a.bm_size); ++qb) {
        if (!block_holds(a, p, qb, q0, q1)) continue;
        const unsigned char* row = block_row(a, b, h, (int)qb);
        for (i64 kb = div32(k0, a.bm_size); kb <= div32(k1, a.bm_size); ++kb) {
            if (!block_holds(a, p, kb, k0, k1)) continue;
            if (row[kb] != 0)
                kept = true;
            else
                removed = true;
        }
    }
    return kept ? (removed ? TILE_MIXED : TILE_KEPT) : TILE_REMOVED;
}

// The mask block of each of `n` selected indices t0.. of pattern p (-1 at or past t_hi, or
// without a block mask), for mask_blocks.
__device__ __forceinline__ void gather_blocks(int* s_blk, int n, const Pattern& p, i64 t0, i64 t_hi,
                                              const AttnParams& a) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        s_blk[i] = a.bmask != nullptr && t0 + i < t_hi ? (int)div32(sel_pos(p, t0 + i), a.bm_size) : -1;
}

// Sets to -inf this thread's scores (rows g, g + 8 of the accumulator layout) of pairs the
// block mask removes: qblk[0], qblk[8] the rows' mask blocks, kblk the tile's keys' (-1:
// no key, removed too).
template <int NS>
__device__ __forceinline__ void mask_blocks(float (*s)[4], const AttnParams& a, i64 b, i64 h, const int* qblk,
                                            const int* kblk, int c) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int qb = qblk[8 * i];
        const unsigned char* row = qb < 0 ? nullptr : block_row(a, b, h, qb);
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int kb = kblk[j * 8 + 2 * c + e];
                if (row == nullptr || kb < 0 || row[kb] == 0) s[j][2 * i + e] = NEG_INF;
            }
        }
    }
}
