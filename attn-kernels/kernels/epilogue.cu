// epilogue.cu: row-wise helper kernels around the attention kernels: write an f32
// accumulator as the output dtype (times a scale) into a strided tensor (8 values a
// thread with 16-byte accesses where the layout allows),
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

// store_rows with 8 values a thread: src read as two 16-byte vectors, dst written as 16-byte
// vectors, index math in 32 bits. The host launches it only where d % 8 == 0, dst's row
// strides are multiples of 8 elements, dst starts on a 16-byte boundary and the 8-value
// chunks number below 2^31 (`store_kernel` in src/cuda/exec/epilogue.rs).
template <class E>
__device__ void store_rows_v8(const float* src, typename E::S* dst, const RowParams& p) {
    typedef typename E::S S;
    const u32 cpr = (u32)p.d >> 3, heads = (u32)p.heads, seq = (u32)p.seq;
    const u32 n = (u32)(p.batch * p.seq * p.heads) * cpr;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const u32 row = i / cpr, c = (i - row * cpr) * 8;
        const u32 h = row % heads, bs = row / heads, s = bs % seq, b = bs / seq;
        const float* in = src + (i64)i * 8;  // contiguous: row * d + c == 8 i
        ATTN_ALIGNED(in, 16);
        const uint4 lo = *reinterpret_cast<const uint4*>(in), hi = *reinterpret_cast<const uint4*>(in + 4);
        const u32 bits[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        S* out = dst + (i64)b * p.a_sb + (i64)s * p.a_ss + (i64)h * p.a_sh + c;
        ATTN_ALIGNED(out, 16);
        if constexpr (sizeof(S) == 2) {
            u32 w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 x0 = E::from_f(p.scale * __uint_as_float(bits[2 * j]));
                const u32 x1 = E::from_f(p.scale * __uint_as_float(bits[2 * j + 1]));
                w[j] = x0 | (x1 << 16);
            }
            *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
        } else {
            u32 w[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) w[j] = __float_as_uint(p.scale * __uint_as_float(bits[j]));
            *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
            *reinterpret_cast<uint4*>(out + 4) = make_uint4(w[4], w[5], w[6], w[7]);
        }
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
    // Lane l sums columns 8l..8l+7, then 256 on, in order: the grouping of delta_rows_v8,
    // so both forms give the same bits.
    float acc = 0.f;
    for (i64 c0 = 8 * lane; c0 < p.d; c0 += 256) {
        for (i64 c = c0; c < c0 + 8 && c < p.d; ++c) acc += E::to_f(g[c]) * E::to_f(o[c]);
    }
    acc = warp_sum(acc);
    if (lane == 0) delta[row] = grad_lse != nullptr && lse[row] != NEG_INF ? acc - grad_lse[row] : acc;
}

// delta_rows with 16-byte loads (8 values of a 16-bit dtype a lane) and 32-bit index math,
// one warp a row; launched only where d % 8 == 0, both tensors' row strides are multiples of
// 8 elements, both start on a 16-byte boundary, the dtype is 16-bit and rows number below 2^31.
template <class E>
__device__ void delta_rows_v8(const typename E::S* go, const typename E::S* out, const float* grad_lse,
                              const float* lse, float* delta, const RowParams& p) {
    const u32 lane = threadIdx.x & 31, heads = (u32)p.heads, seq = (u32)p.seq, d = (u32)p.d;
    const u32 rows = (u32)(p.batch * p.seq * p.heads);
    const u32 row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (row >= rows) return;
    const u32 h = row % heads, bs = row / heads, s = bs % seq, b = bs / seq;
    const typename E::S* g = go + (i64)b * p.a_sb + (i64)s * p.a_ss + (i64)h * p.a_sh;
    const typename E::S* o = out + (i64)b * p.b_sb + (i64)s * p.b_ss + (i64)h * p.b_sh;
    float acc = 0.f;
    for (u32 c = lane * 8; c < d; c += 256) {
        ATTN_ALIGNED(g + c, 16);
        ATTN_ALIGNED(o + c, 16);
        const uint4 gv = *reinterpret_cast<const uint4*>(g + c), ov = *reinterpret_cast<const uint4*>(o + c);
        const u32 gw[4] = {gv.x, gv.y, gv.z, gv.w}, ow[4] = {ov.x, ov.y, ov.z, ov.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc += E::to_f((u16)(gw[j] & 0xffffu)) * E::to_f((u16)(ow[j] & 0xffffu));
            acc += E::to_f((u16)(gw[j] >> 16)) * E::to_f((u16)(ow[j] >> 16));
        }
    }
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
    extern "C" __global__ void fill_lse_##NAME(float* dst, float value, i64 n) { fill_f32(dst, value, n); }   \
    extern "C" __global__ void store_rows_v8_##NAME(const float* src, E::S* dst, RowParams p) {             \
        store_rows_v8<E>(src, dst, p);                                                                      \
    }
// The vector delta of the 16-bit dtypes.
#define ATTN_DELTA_V8_KERNEL(NAME, E)                                                                       \
    extern "C" __global__ void delta_rows_v8_##NAME(const E::S* go, const E::S* out, const float* grad_lse,   \
                                                    const float* lse, float* delta, RowParams p) {          \
        delta_rows_v8<E>(go, out, grad_lse, lse, delta, p);                                                 \
    }

#if ATTN_WANT_F32
ATTN_EPILOGUE_KERNELS(f32, F32E)
#endif
#if ATTN_WANT_F16
ATTN_EPILOGUE_KERNELS(f16, F16E)
ATTN_DELTA_V8_KERNEL(f16, F16E)
#endif
#if ATTN_WANT_BF16
ATTN_EPILOGUE_KERNELS(bf16, BF16E)
ATTN_DELTA_V8_KERNEL(bf16, BF16E)
#endif
