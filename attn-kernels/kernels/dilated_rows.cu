// dilated_rows.cu: one warp per selected row, f32 accumulation, any dtype and head_dim
// <= 256. Forward (merge into the f32 partial) for f32, and the backward of every
// dtype: dq (one warp per query row) and dk/dv (one warp per key row), no atomics.
// Lane `l` owns head dims l, l+32, ...; the dilation gather is the sel_pos() in each load.
// Keys a query sees: its segment, the band (window / causal), not padding and not in a
// block the block mask removes (the key loops jump over a removed block whole); query head
// h reads key/value head h / kv_group.

template <class E>
__device__ __forceinline__ void load_row(float* dst, const typename E::S* row, int lane, i64 d) {
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        i64 col = lane + 32 * c;
        dst[c] = col < d ? E::to_f(row[col]) : 0.f;
    }
}

template <class E>
__device__ __forceinline__ float row_dot(const float* x, const typename E::S* row, int lane, i64 d) {
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        i64 col = lane + 32 * c;
        if (col < d) s += x[c] * E::to_f(row[col]);
    }
    return warp_sum(s);
}

// Forward: attend selected query t of head h to the keys of its segment in the k block,
// then LSE-merge into (o_acc, lse_acc) = f32 [batch, nq, heads, d] and [batch, nq, heads].
template <class E>
__device__ void fwd_rows(const typename E::S* q, const typename E::S* k, const typename E::S* v, float* o_acc,
                         float* lse_acc, const AttnParams& a) {
    typedef typename E::S S;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 h = launch_head(a), kvh = kv_head_of(a, h), b = blockIdx.z;
    const Pattern p = make_pattern(a, h);
    const i64 q_hi = sel_below(p, a.q_start + a.nq);
    const i64 t = sel_below(p, a.q_start) + (i64)blockIdx.x * nw + warp;
    if (t >= q_hi) return;
    const i64 seg = div32(t, p.per_seg), qpos = sel_pos(p, t);
    i64 b_lo, b_hi;
    band_keys(a, t, &b_lo, &b_hi);
    const i64 k_lo = max64(max64(sel_below(p, a.k_start), seg * p.per_seg), b_lo);
    const i64 k_hi = min64(min64(sel_below(p, a.k_start + a.nk), (seg + 1) * p.per_seg), b_hi);
    const i64 qrow = qpos - a.q_start;
    float qv[ROW_CHUNKS], acc[ROW_CHUNKS];
    load_row<E>(qv, q + b * a.q_sb + qrow * a.q_ss + h * a.q_sh, lane, a.d);
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) acc[c] = 0.f;
    float m = NEG_INF, l = 0.f;
    const int qb = block_of(a, qpos);
    for (i64 tk = k_lo; tk < k_hi; ++tk) {
        const i64 kpos = sel_pos(p, tk), krow = kpos - a.k_start;
        if (block_removed(a, b, h, qb, kpos)) {  // resume at the next block's first key
            tk = next_block_start(a, p, kpos) - 1;
            continue;
        }
        if (key_padded(a, b, krow)) continue;
        const S* kp = k + b * a.k_sb + krow * a.k_ss + kvh * a.k_sh;
        const S* vp = v + b * a.v_sb + krow * a.v_ss + kvh * a.v_sh;
        const float s = row_dot<E>(qv, kp, lane, a.d) * a.scale;
        const float m_new = fmaxf(m, s);
        const float alpha = expf(m - m_new);  // m = -inf gives 0
        const float pk = expf(s - m_new);
        l = l * alpha + pk;
#pragma unroll
        for (int c = 0; c < ROW_CHUNKS; ++c) {
            i64 col = lane + 32 * c;
            float vv = col < a.d ? E::to_f(vp[col]) : 0.f;
            acc[c] = acc[c] * alpha + pk * vv;
        }
        m = m_new;
    }
    const float lse = l > 0.f ? m + logf(l) : NEG_INF;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const i64 ri = (b * a.nq + qrow) * a.heads + h;
    float merged, wa, wb;
    lse_merge(lse_acc[ri], lse, &merged, &wa, &wb);
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        i64 col = lane + 32 * c;
        if (col < a.d) {
            float* o = o_acc + ri * a.d + col;
            *o = merged == NEG_INF ? 0.f : wa * *o + wb * acc[c] * inv;
        }
    }
    __syncwarp();
    if (lane == 0) lse_acc[ri] = merged;
}

// Backward, dq: for selected query t, dq += scale * sum_k p_k (out_scale * go.v_k - delta) k,
// p_k = exp(scale q.k - lse_final). Accumulates into dq_acc (f32 [batch, nq, heads, d]).
template <class E>
__device__ void bwd_dq_rows(const typename E::S* q, const typename E::S* k, const typename E::S* v,
                            const typename E::S* go, const float* lse, const float* delta, float* dq_acc,
                            const AttnParams& a) {
    typedef typename E::S S;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 h = launch_head(a), kvh = kv_head_of(a, h), b = blockIdx.z;
    const Pattern p = make_pattern(a, h);
    const i64 q_hi = sel_below(p, a.q_start + a.nq);
    const i64 t = sel_below(p, a.q_start) + (i64)blockIdx.x * nw + warp;
    if (t >= q_hi) return;
    const i64 seg = div32(t, p.per_seg), qpos = sel_pos(p, t);
    i64 b_lo, b_hi;
    band_keys(a, t, &b_lo, &b_hi);
    const i64 k_lo = max64(max64(sel_below(p, a.k_start), seg * p.per_seg), b_lo);
    const i64 k_hi = min64(min64(sel_below(p, a.k_start + a.nk), (seg + 1) * p.per_seg), b_hi);
    const i64 qrow = qpos - a.q_start;
    const i64 ri = (b * a.nq + qrow) * a.heads + h;
    const float lse_row = lse[ri], delta_row = delta[ri];
    if (lse_row == NEG_INF) return;  // the row attends nothing: no gradient
    float qv[ROW_CHUNKS], gv[ROW_CHUNKS], acc[ROW_CHUNKS];
    load_row<E>(qv, q + b * a.q_sb + qrow * a.q_ss + h * a.q_sh, lane, a.d);
    load_row<E>(gv, go + b * a.g_sb + qrow * a.g_ss + h * a.g_sh, lane, a.d);
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) acc[c] = 0.f;
    const int qb = block_of(a, qpos);
    for (i64 tk = k_lo; tk < k_hi; ++tk) {
        const i64 kpos = sel_pos(p, tk), krow = kpos - a.k_start;
        if (block_removed(a, b, h, qb, kpos)) {
            tk = next_block_start(a, p, kpos) - 1;
            continue;
        }
        if (key_padded(a, b, krow)) continue;
        const S* kp = k + b * a.k_sb + krow * a.k_ss + kvh * a.k_sh;
        const S* vp = v + b * a.v_sb + krow * a.v_ss + kvh * a.v_sh;
        const float pk = expf(row_dot<E>(qv, kp, lane, a.d) * a.scale - lse_row);
        const float dp = row_dot<E>(gv, vp, lane, a.d) * a.out_scale;
        const float ds = pk * (dp - delta_row);
#pragma unroll
        for (int c = 0; c < ROW_CHUNKS; ++c) {
            i64 col = lane + 32 * c;
            if (col < a.d) acc[c] += ds * E::to_f(kp[col]);
        }
    }
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        i64 col = lane + 32 * c;
        if (col < a.d) dq_acc[ri * a.d + col] += a.scale * acc[c];
    }
}

// Backward, dk and dv: for selected key tk, sum over the queries of its segment in the q
// block that attend it. Accumulates into dk_acc, dv_acc (f32 [batch, nk, kv_heads, d]).
// Plain read-add-write: the host steps heads by kv_group (head_step), so within one launch
// every key/value head row has one writer; the group's launches run in stream order, which
// makes the group sum deterministic.
template <class E>
__device__ void bwd_dkv_rows(const typename E::S* q, const typename E::S* k, const typename E::S* v,
                             const typename E::S* go, const float* lse, const float* delta, float* dk_acc,
                             float* dv_acc, const AttnParams& a) {
    typedef typename E::S S;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 h = launch_head(a), kvh = kv_head_of(a, h), b = blockIdx.z;
    const Pattern p = make_pattern(a, h);
    const i64 k_hi = sel_below(p, a.k_start + a.nk);
    const i64 tk = sel_below(p, a.k_start) + (i64)blockIdx.x * nw + warp;
    if (tk >= k_hi) return;
    const i64 seg = div32(tk, p.per_seg), kpos = sel_pos(p, tk);
    const i64 krow = kpos - a.k_start;
    if (key_padded(a, b, krow)) return;  // a padded key has no gradient
    i64 b_lo, b_hi;
    band_queries(a, tk, &b_lo, &b_hi);
    const i64 q_lo = max64(max64(sel_below(p, a.q_start), seg * p.per_seg), b_lo);
    const i64 q_hi = min64(min64(sel_below(p, a.q_start + a.nq), (seg + 1) * p.per_seg), b_hi);
    float kv[ROW_CHUNKS], vv[ROW_CHUNKS], dk[ROW_CHUNKS], dv[ROW_CHUNKS];
    load_row<E>(kv, k + b * a.k_sb + krow * a.k_ss + kvh * a.k_sh, lane, a.d);
    load_row<E>(vv, v + b * a.v_sb + krow * a.v_ss + kvh * a.v_sh, lane, a.d);
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) dk[c] = dv[c] = 0.f;
    // The block mask's column of this key: entry qb * bm_nbk of it is query block qb's.
    const unsigned char* bcol = a.bmask == nullptr ? nullptr : block_row(a, b, h, 0) + div32(kpos, a.bm_size);
    for (i64 t = q_lo; t < q_hi; ++t) {
        const i64 qpos = sel_pos(p, t), qrow = qpos - a.q_start;
        if (bcol != nullptr && bcol[div32(qpos, a.bm_size) * a.bm_nbk] == 0) {  // a removed block: skip it whole
            t = next_block_start(a, p, qpos) - 1;
            continue;
        }
        const i64 ri = (b * a.nq + qrow) * a.heads + h;
        const float lse_row = lse[ri];
        const S* qp = q + b * a.q_sb + qrow * a.q_ss + h * a.q_sh;
        const S* gp = go + b * a.g_sb + qrow * a.g_ss + h * a.g_sh;
        // A row that attends nothing (lse -inf) adds nothing; masked rather than skipped,
        // so the warp's shuffles stay outside any branch.
        const float qk = row_dot<E>(kv, qp, lane, a.d);
        const float pk = lse_row == NEG_INF ? 0.f : expf(qk * a.scale - lse_row);
        const float dp = row_dot<E>(vv, gp, lane, a.d) * a.out_scale;
        const float ds = pk * (dp - delta[ri]);
#pragma unroll
        for (int c = 0; c < ROW_CHUNKS; ++c) {
            i64 col = lane + 32 * c;
            if (col < a.d) {
                dv[c] += pk * E::to_f(gp[col]);
                dk[c] += ds * E::to_f(qp[col]);
            }
        }
    }
    const i64 ri = (b * a.nk + krow) * a.kv_heads + kvh;
#pragma unroll
    for (int c = 0; c < ROW_CHUNKS; ++c) {
        i64 col = lane + 32 * c;
        if (col < a.d) {
            dk_acc[ri * a.d + col] += a.scale * dk[c];
            dv_acc[ri * a.d + col] += a.out_scale * dv[c];
        }
    }
}

#define ATTN_ROW_KERNELS(NAME, E)                                                                              \
    extern "C" __global__ void __launch_bounds__(128) dilated_fwd_rows_##NAME(                                 \
        const E::S* q, const E::S* k, const E::S* v, float* o_acc, float* lse_acc, AttnParams a) {             \
        fwd_rows<E>(q, k, v, o_acc, lse_acc, a);                                                               \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) dilated_bwd_dq_rows_##NAME(                              \
        const E::S* q, const E::S* k, const E::S* v, const E::S* go, const float* lse, const float* delta,     \
        float* dq_acc, AttnParams a) {                                                                         \
        bwd_dq_rows<E>(q, k, v, go, lse, delta, dq_acc, a);                                                    \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) dilated_bwd_dkv_rows_##NAME(                             \
        const E::S* q, const E::S* k, const E::S* v, const E::S* go, const float* lse, const float* delta,     \
        float* dk_acc, float* dv_acc, AttnParams a) {                                                          \
        bwd_dkv_rows<E>(q, k, v, go, lse, delta, dk_acc, dv_acc, a);                                           \
    }

#if ATTN_WANT_F32
ATTN_ROW_KERNELS(f32, F32E)
#endif
#if ATTN_WANT_F16
ATTN_ROW_KERNELS(f16, F16E)
#endif
#if ATTN_WANT_BF16
ATTN_ROW_KERNELS(bf16, BF16E)
#endif
