// dilated_bwd_mma.cu: tensor-core backward (sm_80+) for f16/bf16, f32 accumulation.
//
// A block of BN / 16 warps (4 or 8) owns BN (64 or 128) consecutive SELECTED key indices
// of one (batch, head, pattern); warp w owns 16 keys and keeps their dK, dV in registers. Query tiles of BM
// (32, or 64: half the tiles, so half the barriers and K/V fragment reloads a key block,
// for twice the S^T and dP^T registers) selected indices (the queries of the keys' segments, causal-bounded) stream through
// shared memory with the dilation gather fused into the loads. Per tile, in the keys'
// frame: S^T = K Q^T, dP^T = V dO^T, P^T = exp(scale S^T - lse_q) (the head's FINAL lse;
// computed as ex2 of the base-2 exponent, the scale and log2 e folded into one multiply-add),
// dS^T = P^T (out_scale dP^T - delta_q); dV += P^T dO, dK += dS^T Q from registers, and
// dQ += dS K through shared memory with f32 atomics into dq_acc. A key's queries are its
// segment cut by the band (window / causal); padded keys are gathered as row -1 (no
// gradient); a block mask (the `_bm_` instances) skips a query tile whose every (query block, key block) pair
// with the block's keys is removed and zeroes the removed pairs' P^T, dS^T in a mixed
// one (global positions, as the row kernels). Query head h reads key/value head h / kv_group; dK, dV rows are per
// key/value head (see the write at the end for why that is race-free).
// PIPE: the query tiles load by cp.async into two stages (the next tile's Q, dO, lse and
// delta load while this one runs, started after the tile's one barrier; tiles inside one
// segment by stepped pointers, without the gather), K/V with the first tile; without it,
// each tile loads before its compute.
// Both give the same bits. BN = 128 halves the dQ atomics per query tile and key (each
// adds the products of twice the keys), FlashAttention-2's backward block.
// With `a.out_direct` (a whole call whose key rows have one writer) dK and dV go straight
// into the gradients in the input dtype, with no f32 accumulators and no epilogue.
// DQ = false: dK and dV only (no dS^T tile, no atomics); the deterministic backward adds
// dQ with the query-major kernel (dilated_bwd_dq_mma.cu), so no sum depends on the order
// blocks run in.
// Fragment layouts: see mma_tiles.cu.

// dQ (BM x D) += scale dS (BM x BN) K (BN x D) of one query tile, dS^T in sDS: the warps
// form RG = BM / 16 row groups; warp w takes query rows (w % RG) * 16 and NJ of the
// head-dim n-blocks; atomics (paired columns) because other key blocks add to the same rows.
template <class E, int D, int BN, int BM>
__device__ __forceinline__ void bwd_mma_dq(const u16* sDS, const u16* sK, const i64* qrows, float* dq_acc, i64 b,
                                           i64 h, const AttnParams& a) {
    constexpr int LD = D + 8, LDS = BM + 8, NO = D / 8, RG = BM / 16, WARPS = BN / 16;
    constexpr int NJ = NO / (WARPS / RG);
    static_assert(WARPS % RG == 0 && NJ >= 2 && NJ % 2 == 0, "dQ needs n-block pairs a warp");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    __syncthreads();  // sDS complete
    const int qr0 = (warp % RG) * 16;
#pragma unroll
    for (int jj = 0; jj < NJ; jj += 2) {
        const int j = (warp / RG) * NJ + jj;
        float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 af[4], bf[4];
            // A = dS (rows = queries) from dS^T in shared memory: transposed 8x8 loads.
            ldsm_x4_trans(af, sDS + (kk * 16 + ((lane >> 4) & 1) * 8 + (lane & 7)) * LDS + qr0 + ((lane >> 3) & 1) * 8);
            ldsm_x4_trans(bf, sK + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + j * 8 + ((lane >> 4) & 1) * 8);
            mma16816(acc[0], af, bf, E());
            mma16816(acc[1], af, bf + 2, E());
        }
#if defined(ATTN_CPU_EMULATION) || __CUDA_ARCH__ >= 900
        // Elements 2i and 2i + 1 of a fragment are one row's adjacent columns: one paired
        // reduction (8-byte aligned: d and the column are even).
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const i64 r = qrows[qr0 + g + i * 8], col = (j + n) * 8 + 2 * c;
                if (r < 0 || col >= a.d) continue;
                float* at = dq_acc + ((b * a.nq + r) * a.heads + h) * a.d + col;
                if (col + 1 < a.d && (a.d & 1) == 0) {
                    atomic_add2(at, a.scale * acc[n][2 * i], a.scale * acc[n][2 * i + 1]);
                } else {
                    atomicAdd(at, a.scale * acc[n][2 * i]);
                    if (col + 1 < a.d) atomicAdd(at + 1, a.scale * acc[n][2 * i + 1]);
                }
            }
        }
#else
        // Before sm_90 (no vector reduction): one atomic an element, the fewest registers.
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = qr0 + g + (e >> 1) * 8;
                const i64 col = (j + n) * 8 + 2 * c + (e & 1);
                const i64 r = qrows[row];
                if (r >= 0 && col < a.d)
                    atomicAdd(dq_acc + ((b * a.nq + r) * a.heads + h) * a.d + col, a.scale * acc[n][e]);
            }
        }
#endif
    }
}

// Each key row's admitted query indices [s_qlo[i], s_qhi[i]) for the `rows` key rows
// gathered into s_krows from selected index tk0: its segment cut by the band (empty for
// padded keys and rows past the block), written by the thread that gathered the row.
__device__ __forceinline__ void key_row_queries(i64* s_qlo, i64* s_qhi, const i64* s_krows, int rows, const Pattern& p,
                                                i64 tk0, const AttnParams& a) {
    for (int i = threadIdx.x; i < rows; i += blockDim.x) {
        i64 lo = 0, hi = 0;
        if (s_krows[i] >= 0) {
            const i64 seg = div32(tk0 + i, p.per_seg);
            band_queries(a, tk0 + i, &lo, &hi);
            lo = max64(seg * p.per_seg, lo);
            hi = min64((seg + 1) * p.per_seg, hi);
        }
        s_qlo[i] = lo;
        s_qhi[i] = hi;
    }
}

// dK and dV of this thread's key rows (kr0 and kr0 + 8 of s_krows, the block's gather; -1:
// none) in the mma.m16n8k16 C layout (n-block j, columns 2c and 2c + 1): plain adds into the
// f32 accumulators, or with `a.out_direct` E values straight into the gradients at k's and
// v's strides (dk_acc and dv_acc then point at them).
template <class E, int NO>
__device__ __forceinline__ void bwd_store_dkv(const float (&dk)[NO][4], const float (&dv)[NO][4], const i64* s_krows,
                                              int kr0, int c, i64 b, i64 kvh, float* dk_acc, float* dv_acc,
                                              const AttnParams& a) {
    u16 *dko = reinterpret_cast<u16*>(dk_acc), *dvo = reinterpret_cast<u16*>(dv_acc);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const i64 r = s_krows[kr0 + 8 * i];
        if (r < 0) continue;
        const i64 ri = ((b * a.nk + r) * a.kv_heads + kvh) * a.d;
        u16* krow = dko + b * a.k_sb + r * a.k_ss + kvh * a.k_sh;
        u16* vrow = dvo + b * a.v_sb + r * a.v_ss + kvh * a.v_sh;
#pragma unroll
        for (int j = 0; j < NO; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const i64 col = j * 8 + 2 * c + e;
                if (col >= a.d) continue;
                const float gk = a.scale * dk[j][2 * i + e], gv = a.out_scale * dv[j][2 * i + e];
                if (a.out_direct) {
                    krow[col] = E::from_f(gk);
                    vrow[col] = E::from_f(gv);
                } else {
                    dk_acc[ri + col] += gk;
                    dv_acc[ri + col] += gv;
                }
            }
        }
    }
}

template <class E, int D, bool PIPE, int BN, bool DQ, int BM, BlockMasking MK = BM_IGNORE>
__device__ void bwd_mma(const u16* q, const u16* k, const u16* v, const u16* go, const float* lse, const float* delta,
                        float* dq_acc, float* dk_acc, float* dv_acc, const AttnParams& a) {
    constexpr int LD = D + 8, LDS = BM + 8, NQ = BM / 8, NO = D / 8, NT = 2 * BN;
    constexpr int ST = PIPE ? 2 : 1;  // query-tile stages
    ATTN_DYNAMIC_SMEM(smem_raw);
    u16* sK = reinterpret_cast<u16*>(smem_raw);
    u16* sV = sK + BN * LD;
    u16* sQs = sV + BN * LD;
    u16* sGs = sQs + ST * BM * LD;
    u16* sDS = sGs + ST * BM * LD;  // dS^T, [BN keys][LDS] (DQ only)
    __shared__ i64 s_krows[BN], s_qrows[ST][BM];
    __shared__ float s_lse[ST][BM], s_delta[ST][BM];  // lse in base 2 (times log2 e)
    __shared__ i64 s_qlo[BN], s_qhi[BN];  // each key row's admitted query indices (shared: fewer registers)
    __shared__ int s_kblk[BN], s_qblk[ST][BM];  // mask blocks of the key rows and each stage's queries

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const i64 h = launch_head(a), kvh = kv_head_of(a, h), b = blockIdx.z;
    const Pattern p = make_pattern(a, h);
    const float scale_log2 = a.scale * LOG2E;  // P = 2^(S scale log2 e - lse log2 e)
    const i64 k_hi = sel_below(p, a.k_start + a.nk);
    const i64 tk0 = sel_below(p, a.k_start) + (i64)blockIdx.x * BN;
    if (tk0 >= k_hi) return;  // uniform over the block
    const i64 tk_last = min64(tk0 + BN, k_hi) - 1;
    i64 band_lo, band_hi, unused;
    band_queries(a, tk0, &band_lo, &unused);
    band_queries(a, tk_last, &unused, &band_hi);
    const i64 qb_lo = max64(max64(sel_below(p, a.q_start), div32(tk0, p.per_seg) * p.per_seg), band_lo);
    const i64 qb_hi = min64(min64(sel_below(p, a.q_start + a.nq), (div32(tk_last, p.per_seg) + 1) * p.per_seg), band_hi);

    gather_keys(s_krows, BN, p, tk0, k_hi, a, b);
    __syncthreads();
    if (PIPE) {  // its own cp.async group, waited for with the first query tile's
        load_tile_async<D, LD>(sK, s_krows, BN, k + b * a.k_sb + kvh * a.k_sh, a.k_ss, a.d, a.vec & 2);
        load_tile_async<D, LD>(sV, s_krows, BN, v + b * a.v_sb + kvh * a.v_sh, a.v_ss, a.d, a.vec & 4);
        cp_async_commit();
    } else {
        load_tile<D, LD>(sK, s_krows, BN, k + b * a.k_sb + kvh * a.k_sh, a.k_ss, a.d, a.vec & 2);
        load_tile<D, LD>(sV, s_krows, BN, v + b * a.v_sb + kvh * a.v_sh, a.v_ss, a.d, a.vec & 4);
    }

    const int kr0 = warp * 16 + g;
    // Each key row's admitted query indices, read after the loop's barriers.
    key_row_queries(s_qlo, s_qhi, s_krows, BN, p, tk0, a);
    if (MK == BM_READ) gather_blocks(s_kblk, BN, p, tk0, k_hi, a);
    float dk[NO][4], dv[NO][4];
#pragma unroll
    for (int j = 0; j < NO; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
    }

    const u16* qbase = q + b * a.q_sb + h * a.q_sh;
    const u16* gbase = go + b * a.g_sb + h * a.g_sh;
    static_assert(NT >= BM, "a thread a query row of the tile");
    // PIPE: start the copies of query tile qt into stage st (one cp.async group) and load
    // thread i's row lse / delta into *pl / *pd (stored to shared memory after this tile's
    // compute, so their latency hides behind it).
    auto load_queries = [&](int st, i64 qt, float* pl, float* pd) {
        *pl = NEG_INF;
        *pd = 0.f;
        if (threadIdx.x < BM) {
            const i64 t = qt + threadIdx.x;
            const i64 r = t < qb_hi ? sel_pos(p, t) - a.q_start : -1;
            s_qrows[st][threadIdx.x] = r;
            if (MK == BM_READ) s_qblk[st][threadIdx.x] = a.bmask != nullptr && r >= 0 ? (int)div32(r + a.q_start, a.bm_size) : -1;
            if (r >= 0) {
                const i64 ri = (b * a.nq + r) * a.heads + h;
                *pl = lse[ri] * LOG2E;
                *pd = delta[ri];
            }
        }
        u16* dQ = sQs + st * BM * LD;
        u16* dG = sGs + st * BM * LD;
        const i64 row0 = (a.vec & 9) == 9 ? affine_row0(p, qt, BM, qb_hi, a.q_start) : -1;
        if (row0 >= 0) {
            load_tile_affine_async<D, LD, NT, BM>(dQ, qbase + row0 * a.q_ss, p.r * a.q_ss, a.d);
            load_tile_affine_async<D, LD, NT, BM>(dG, gbase + row0 * a.g_ss, p.r * a.g_ss, a.d);
        } else {
            __syncthreads();  // s_qrows[st] complete
            load_tile_async<D, LD>(dQ, s_qrows[st], BM, qbase, a.q_ss, a.d, a.vec & 1);
            load_tile_async<D, LD>(dG, s_qrows[st], BM, gbase, a.g_ss, a.d, a.vec & 8);
        }
        cp_async_commit();
    };
    // The block-mask state of query tile qt; the first tile at or past qt it keeps a pair of.
    auto tile_mask = [&](i64 qt) {
        return MK == BM_READ ? tile_blocks(a, p, b, h, qt, min64(qt + BM, qb_hi), tk0, tk_last + 1) : TILE_KEPT;
    };
    auto next_tile = [&](i64 qt) {
        while (qt < qb_hi && tile_mask(qt) == TILE_REMOVED) qt += BM;
        return qt;
    };
    i64 qt0 = next_tile(qb_lo);
    float next_lse = NEG_INF, next_delta = 0.f;
    if (PIPE && qt0 < qb_hi) {
        load_queries(0, qt0, &next_lse, &next_delta);
        if (threadIdx.x < BM) {
            s_lse[0][threadIdx.x] = next_lse;
            s_delta[0][threadIdx.x] = next_delta;
        }
    }

    int stage = 0;
    for (i64 qt_next; qt0 < qb_hi; qt0 = qt_next, stage ^= (PIPE ? 1 : 0)) {
        qt_next = next_tile(qt0 + BM);
        const bool more = PIPE && qt_next < qb_hi;
        if (PIPE) {  // wait for this tile, then start the next into the other stage
            cp_async_wait<0>();
            // This stage (and K/V, the first time) visible to every warp; every warp done
            // with the previous tile (its stage, lse, delta and sDS), so the other stage
            // can be refilled: one barrier a tile besides dQ's.
            __syncthreads();
            if (more) load_queries(stage ^ 1, qt_next, &next_lse, &next_delta);
        } else {
            __syncthreads();  // K/V loaded (first time); sQ, sG, sDS of the previous tile consumed
            gather_rows(s_qrows[0], BM, p, qt0, qb_hi, a.q_start);
            if (MK == BM_READ) gather_blocks(s_qblk[0], BM, p, qt0, qb_hi, a);
            __syncthreads();
            load_tile<D, LD>(sQs, s_qrows[0], BM, qbase, a.q_ss, a.d, a.vec & 1);
            load_tile<D, LD>(sGs, s_qrows[0], BM, gbase, a.g_ss, a.d, a.vec & 8);
            for (int i = threadIdx.x; i < BM; i += blockDim.x) {
                const i64 r = s_qrows[0][i];
                const i64 ri = (b * a.nq + r) * a.heads + h;
                s_lse[0][i] = r >= 0 ? lse[ri] * LOG2E : NEG_INF;
                s_delta[0][i] = r >= 0 ? delta[ri] : 0.f;
            }
            __syncthreads();
        }
        const u16* sQ = sQs + stage * BM * LD;
        const u16* sG = sGs + stage * BM * LD;
        const i64* qrows = s_qrows[stage];
        const float* tile_lse = s_lse[stage];
        const float* tile_delta = s_delta[stage];
        const bool full = full_tile(p, qt0, BM, qb_hi, tk0, BN, k_hi, a);
        const bool bmixed = tile_mask(qt0) == TILE_MIXED;
        const int* qblk = s_qblk[stage];

        float st[NQ][4], dpt[NQ][4];
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
        }
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            u32 kf[4], vf[4];
            ldsm_x4(kf, sK + (warp * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8);
            ldsm_x4(vf, sV + (warp * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int j = 0; j < NQ; j += 2) {  // B fragments of query n-blocks j and j + 1
                const int off = (j * 8 + ((lane >> 4) & 1) * 8 + (lane & 7)) * LD + ks * 16 + ((lane >> 3) & 1) * 8;
                u32 qf[4], gf[4];
                ldsm_x4(qf, sQ + off);
                ldsm_x4(gf, sG + off);
                mma16816(st[j], kf, qf, E());
                mma16816(st[j + 1], kf, qf + 2, E());
                mma16816(dpt[j], vf, gf, E());
                mma16816(dpt[j + 1], vf, gf + 2, E());
            }
        }

        // P^T and dS^T in registers (masked entries 0), dS^T also to shared memory for dQ.
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int kb = MK == BM_READ ? s_kblk[kr0 + 8 * i] : -1;
#pragma unroll
            for (int j = 0; j < NQ; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = j * 8 + 2 * c + e;
                    const i64 tq = qt0 + col;
                    const float lse_q = tile_lse[col];
                    const bool ok =
                        lse_q != NEG_INF &&
                        (full || (tq < qb_hi && tq >= s_qlo[kr0 + 8 * i] && tq < s_qhi[kr0 + 8 * i])) &&
                        (!bmixed || (kb >= 0 && qblk[col] >= 0 && block_row(a, b, h, qblk[col])[kb] != 0));
                    const float pt = ok ? exp2_approx(fmaf(st[j][2 * i + e], scale_log2, -lse_q)) : 0.f;
                    const float ds = pt * (dpt[j][2 * i + e] * a.out_scale - tile_delta[col]);
                    st[j][2 * i + e] = pt;
                    dpt[j][2 * i + e] = ds;
                    if (DQ) sDS[(kr0 + 8 * i) * LDS + col] = E::from_f(ds);
                }
            }
        }

        // dV += P^T dO, dK += dS^T Q (B operands [query][dim] from shared memory).
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            const u32 pa[4] = {pack2<E>(st[2 * kk][0], st[2 * kk][1]), pack2<E>(st[2 * kk][2], st[2 * kk][3]),
                               pack2<E>(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                               pack2<E>(st[2 * kk + 1][2], st[2 * kk + 1][3])};
            const u32 da[4] = {pack2<E>(dpt[2 * kk][0], dpt[2 * kk][1]), pack2<E>(dpt[2 * kk][2], dpt[2 * kk][3]),
                               pack2<E>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                               pack2<E>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
#pragma unroll
            for (int j = 0; j < NO; j += 2) {  // B = dO / Q as [query][dim], transposed loads
                const int off = (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + j * 8 + ((lane >> 4) & 1) * 8;
                u32 gf[4], qf[4];
                ldsm_x4_trans(gf, sG + off);
                ldsm_x4_trans(qf, sQ + off);
                mma16816(dv[j], pa, gf, E());
                mma16816(dv[j + 1], pa, gf + 2, E());
                mma16816(dk[j], da, qf, E());
                mma16816(dk[j + 1], da, qf + 2, E());
            }
        }
        if (DQ) bwd_mma_dq<E, D, BN, BM>(sDS, sK, qrows, dq_acc, b, h, a);
        if (more && threadIdx.x < BM) {  // read after the next tile's barrier
            s_lse[stage ^ 1][threadIdx.x] = next_lse;
            s_delta[stage ^ 1][threadIdx.x] = next_delta;
        }
    }
    if (PIPE) cp_async_wait<0>();  // no copy outlives the block (K/V's, where no query tile ran)

    // Each key/value head row belongs to this block only within one launch (the host
    // steps heads by kv_group, so no two blocks of a launch share a key/value head):
    // plain read-add-write into the f32 accumulators, and the group's launches add in
    // stream order (deterministic). With `a.out_direct` this block is the row's only writer
    // in the whole call (one pattern a head, as many key/value heads as query heads:
    // planned by the host): E values straight into the gradients at k's and v's strides
    // (dk_acc and dv_acc then point at them).
    bwd_store_dkv<E, NO>(dk, dv, s_krows, kr0, c, b, kvh, dk_acc, dv_acc, a);
}

// Dynamic shared memory (bytes) with ST query-tile stages of BM rows and BN keys a block,
// the dS^T tile where DQ; mirrored by `mma_bwd_smem_bytes` in src/cuda/plan/patterns.rs.
#define MMA_BWD_SMEM(D, ST, BN, DQ, BM) \
    ((2 * (BN) + (ST) * 2 * (BM)) * ((D) + 8) * 2 + ((DQ) ? (BN) * ((BM) + 8) * 2 : 0))

// The two kernels of one shape: SYNC (each query tile loads before its compute) and PIPE
// (two stages), BN keys a block over BN / 16 warps, query tiles of BM, dQ by atomics.
#define ATTN_MMA_BWD_PAIR(SYNC, PIPE, E, D, BN, BM)                                                              \
    extern "C" __global__ void __launch_bounds__(2 * (BN)) SYNC(                                             \
        const u16* q, const u16* k, const u16* v, const u16* go, const float* lse, const float* delta,       \
        float* dq_acc, float* dk_acc, float* dv_acc, AttnParams a) {                                         \
        bwd_mma<E, D, false, BN, true, BM>(q, k, v, go, lse, delta, dq_acc, dk_acc, dv_acc, a);                  \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(2 * (BN)) PIPE(                                             \
        const u16* q, const u16* k, const u16* v, const u16* go, const float* lse, const float* delta,       \
        float* dq_acc, float* dk_acc, float* dv_acc, AttnParams a) {                                         \
        bwd_mma<E, D, true, BN, true, BM>(q, k, v, go, lse, delta, dq_acc, dk_acc, dv_acc, a);                   \
    }

// The dK/dV-only pair of one shape (the deterministic backward's key-major half).
#define ATTN_MMA_BWD_DKV_PAIR(SYNC, PIPE, E, D, BN, BM)                                                          \
    extern "C" __global__ void __launch_bounds__(2 * (BN)) SYNC(                                             \
        const u16* q, const u16* k, const u16* v, const u16* go, const float* lse, const float* delta,       \
        float* dk_acc, float* dv_acc, AttnParams a) {                                                        \
        bwd_mma<E, D, false, BN, false, BM>(q, k, v, go, lse, delta, nullptr, dk_acc, dv_acc, a);                \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(2 * (BN)) PIPE(                                             \
        const u16* q, const u16* k, const u16* v, const u16* go, const float* lse, const float* delta,       \
        float* dk_acc, float* dv_acc, AttnParams a) {                                                        \
        bwd_mma<E, D, true, BN, false, BM>(q, k, v, go, lse, delta, nullptr, dk_acc, dv_acc, a);                 \
    }

// 64 keys a block: dilated_bwd_mma_[pipelined_]<dtype>_d<D>, and the dK/dV-only
// dilated_bwd_mma_dkv_[pipelined_]<dtype>_d<D>.
#define ATTN_MMA_BWD_KERNEL(NAME, E, D)                                                                                \
    ATTN_MMA_BWD_PAIR(dilated_bwd_mma_##NAME##_d##D, dilated_bwd_mma_pipelined_##NAME##_d##D, E, D, 64, 32)             \
    ATTN_MMA_BWD_DKV_PAIR(dilated_bwd_mma_dkv_##NAME##_d##D, dilated_bwd_mma_dkv_pipelined_##NAME##_d##D, E, D, 64, 32)

// 64 keys a block, 32-query tiles, query tiles loaded before their compute (the pipelined
// loads spill registers beside the mask's at head dim 128), reading the block mask:
// dilated_bwd_mma_bm_<dtype>_d<D> (dQ by atomics) and dilated_bwd_mma_dkv_bm_<dtype>_d<D>.
#define ATTN_MMA_BWD_KERNEL_BM(NAME, E, D)                                                             \
    extern "C" __global__ void __launch_bounds__(128) dilated_bwd_mma_bm_##NAME##_d##D(                 \
        const u16* q, const u16* k, const u16* v, const u16* go, const float* lse, const float* delta, \
        float* dq_acc, float* dk_acc, float* dv_acc, AttnParams a) {                                   \
        bwd_mma<E, D, false, 64, true, 32, BM_READ>(q, k, v, go, lse, delta, dq_acc, dk_acc, dv_acc, a); \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) dilated_bwd_mma_dkv_bm_##NAME##_d##D(             \
        const u16* q, const u16* k, const u16* v, const u16* go, const float* lse, const float* delta, \
        float* dk_acc, float* dv_acc, AttnParams a) {                                                  \
        bwd_mma<E, D, false, 64, false, 32, BM_READ>(q, k, v, go, lse, delta, nullptr, dk_acc, dv_acc, a); \
    }

// 128 keys a block (D >= 64: dQ splits D over 4 warp pairs): dilated_bwd_mma_[pipelined_]k128_<dtype>_d<D>
// and dilated_bwd_mma_dkv_[pipelined_]k128_<dtype>_d<D>.
#define ATTN_MMA_BWD_KERNEL_K128(NAME, E, D)                                                                         \
    ATTN_MMA_BWD_PAIR(dilated_bwd_mma_k128_##NAME##_d##D, dilated_bwd_mma_pipelined_k128_##NAME##_d##D, E, D, 128, 32) \
    ATTN_MMA_BWD_DKV_PAIR(dilated_bwd_mma_dkv_k128_##NAME##_d##D, dilated_bwd_mma_dkv_pipelined_k128_##NAME##_d##D, E,   \
                          D, 128, 32)

// Query tiles of 64 (the same kernels' names with q64_ before the dtype), 64 and 128 keys.
#define ATTN_MMA_BWD_KERNEL_Q64(NAME, E, D)                                                                        \
    ATTN_MMA_BWD_PAIR(dilated_bwd_mma_q64_##NAME##_d##D, dilated_bwd_mma_pipelined_q64_##NAME##_d##D, E, D, 64, 64) \
    ATTN_MMA_BWD_DKV_PAIR(dilated_bwd_mma_dkv_q64_##NAME##_d##D, dilated_bwd_mma_dkv_pipelined_q64_##NAME##_d##D, E, \
                          D, 64, 64)
#define ATTN_MMA_BWD_KERNEL_K128_Q64(NAME, E, D)                                                                     \
    ATTN_MMA_BWD_PAIR(dilated_bwd_mma_k128_q64_##NAME##_d##D, dilated_bwd_mma_pipelined_k128_q64_##NAME##_d##D, E, D, \
                      128, 64)                                                                                         \
    ATTN_MMA_BWD_DKV_PAIR(dilated_bwd_mma_dkv_k128_q64_##NAME##_d##D,                                                 \
                          dilated_bwd_mma_dkv_pipelined_k128_q64_##NAME##_d##D, E, D, 128, 64)

#if ATTN_WANT_F16
ATTN_MMA_BWD_KERNEL(f16, F16E, 32)
ATTN_MMA_BWD_KERNEL_BM(f16, F16E, 32)
ATTN_MMA_BWD_KERNEL_BM(f16, F16E, 64)
ATTN_MMA_BWD_KERNEL_BM(f16, F16E, 128)
ATTN_MMA_BWD_KERNEL(f16, F16E, 64)
ATTN_MMA_BWD_KERNEL(f16, F16E, 128)
ATTN_MMA_BWD_KERNEL_K128(f16, F16E, 64)
ATTN_MMA_BWD_KERNEL_K128(f16, F16E, 128)
ATTN_MMA_BWD_KERNEL_Q64(f16, F16E, 32)
ATTN_MMA_BWD_KERNEL_Q64(f16, F16E, 64)
ATTN_MMA_BWD_KERNEL_Q64(f16, F16E, 128)
ATTN_MMA_BWD_KERNEL_K128_Q64(f16, F16E, 64)
ATTN_MMA_BWD_KERNEL_K128_Q64(f16, F16E, 128)
#endif
#if ATTN_WANT_BF16
ATTN_MMA_BWD_KERNEL(bf16, BF16E, 32)
ATTN_MMA_BWD_KERNEL_BM(bf16, BF16E, 32)
ATTN_MMA_BWD_KERNEL_BM(bf16, BF16E, 64)
ATTN_MMA_BWD_KERNEL_BM(bf16, BF16E, 128)
ATTN_MMA_BWD_KERNEL(bf16, BF16E, 64)
ATTN_MMA_BWD_KERNEL(bf16, BF16E, 128)
ATTN_MMA_BWD_KERNEL_K128(bf16, BF16E, 64)
ATTN_MMA_BWD_KERNEL_K128(bf16, BF16E, 128)
ATTN_MMA_BWD_KERNEL_Q64(bf16, BF16E, 32)
ATTN_MMA_BWD_KERNEL_Q64(bf16, BF16E, 64)
ATTN_MMA_BWD_KERNEL_Q64(bf16, BF16E, 128)
ATTN_MMA_BWD_KERNEL_K128_Q64(bf16, BF16E, 64)
ATTN_MMA_BWD_KERNEL_K128_Q64(bf16, BF16E, 128)
#endif
