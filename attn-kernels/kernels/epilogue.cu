// epilogue.cu: row-wise helper kernels around the attention kernels: write an f32
// accumulator as the output dtype (times a scale) into a strided tensor,
// delta = dot(grad_out, out) - grad_lse per row for the backward, and fill an f32 buffer with one
// value (the -inf lse of rows no pattern selects, before a direct forward).

// dst(b, s, h, :) = from_f(scale * src[((b*seq + s)*heads + h)*d + :]); dst strides a_*.
template <class E>
__device__ void store_rows(const float* src, typename E::S* dst, const RowParams& p) {
    const i64 n = p.batch * p.seq * p.heads * p.d;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 c = i % p.d, row = i / p.d;
        i64 h = row % p.heads, s = (row / p.heads) % p.seq, b = row / (p.heads * p.seq);
        dst[b * p.a_sb + s * p.a_ss + h * p.a_sh + c] = E::from_f(p.scale * src[i]);
    }
}

// delta[(b*seq + s)*heads + h] = sum_c go(b,s,h,c) * out(b,s,h,c) - grad_lse[row]; go strides a_*,
// out strides b_*; grad_lse (null: none) is read only where the row's lse is finite (a row that
// attends nothing takes no gradient from its LSE). One warp per row.
template <class E>
__device__ void delta_rows(const typename E::S* go, const typename E::S* out, const float* grad_lse, const float* lse,
                           float* delta, const RowParams& p) {
    const int lane = threadIdx.x & 31;
    const i64 rows = p.batch * p.seq * p.heads;
    const i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (row >= rows) return;
    const i64 h = row % p.heads, s = (row / p.heads) % p.seq, b = row / (p.heads * p.seq);
    const typename E::S* g = go + b * p.a_sb + s * p.a_ss + h * p.a_sh;
    const typename E::S* o = out + b * p.b_sb + s * p.b_ss + h * p.b_sh;
    float acc = 0.f;
    for (i64 c = lane; c < p.d; c += 32) acc += E::to_f(g[c]) * E::to_f(o[c]);
    acc = warp_sum(acc);
    if (lane == 0) delta[row] = grad_lse != nullptr && lse[row] != NEG_INF ? acc - grad_lse[row] : acc;
}

// dst[0..n) = value.
__device__ void fill_f32(float* dst, float value, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) dst[i] = value;
}

#define ATTN_EPILOGUE_KERNELS(NAME, E)                                                                      \
    extern "C" __global__ void store_rows_##NAME(const float* src, E::S* dst, RowParams p) {                \
        store_rows<E>(src, dst, p);                                                                         \
    }                                                                                                       \
    extern "C" __global__ void delta_rows_##NAME(const E::S* go, const E::S* out, const float* grad_lse,       \
                                                 const float* lse, float* delta, RowParams p) {             \
        delta_rows<E>(go, out, grad_lse, lse, delta, p);                                                    \
    }                                                                                                       \
    extern "C" __global__ void fill_lse_##NAME(float* dst, float value, i64 n) { fill_f32(dst, value, n); }

#if ATTN_WANT_F32
ATTN_EPILOGUE_KERNELS(f32, F32E)
#endif
#if ATTN_WANT_F16
ATTN_EPILOGUE_KERNELS(f16, F16E)
#endif
#if ATTN_WANT_BF16
ATTN_EPILOGUE_KERNELS(bf16, BF16E)
#endif
