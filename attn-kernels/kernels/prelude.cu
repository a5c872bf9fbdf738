// prelude.cu: shared definitions of the dilated-attention kernels: element types,
// launch parameters, pattern index math on GLOBAL positions, warp reductions, LSE merge.
//
// Header-free on purpose (no cuda_fp16.h / cuda_bf16.h / mma.h): f16 and bf16 are
// stored as 16-bit integers and converted with PTX `cvt`, and the tensor-core path
// uses `mma.sync` directly, so NVRTC needs no include path at run time.
//
// Index space: a pattern (w, r, off) selects positions s*w + off + j*r inside segment s.
// Every full segment holds `per_seg = ceil((w - off) / r)` selected positions, so the
// t-th selected position of the whole sequence is sel_pos(t) and the number of selected
// positions below x is sel_below(x). Two selected positions are in the same segment iff
// t_a / per_seg == t_b / per_seg, and p_a <= p_b iff t_a <= t_b, so every mask test is
// done on selected indices. The ragged last segment needs no special case: blocks never
// ask for indices past their own end.

// Which dtypes to instantiate: define ATTN_ONLY_F32 / ATTN_ONLY_F16 / ATTN_ONLY_BF16 for
// one (the runtime compiles one module per dtype); none defined means all of them.
#if !defined(ATTN_ONLY_F32) && !defined(ATTN_ONLY_F16) && !defined(ATTN_ONLY_BF16)
#define ATTN_WANT_F32 1
#define ATTN_WANT_F16 1
#define ATTN_WANT_BF16 1
#endif
#if defined(ATTN_ONLY_F32)
#define ATTN_WANT_F32 1
#endif
#if defined(ATTN_ONLY_F16)
#define ATTN_WANT_F16 1
#endif
#if defined(ATTN_ONLY_BF16)
#define ATTN_WANT_BF16 1
#endif
#ifndef ATTN_WANT_F32
#define ATTN_WANT_F32 0
#endif
#ifndef ATTN_WANT_F16
#define ATTN_WANT_F16 0
#endif
#ifndef ATTN_WANT_BF16
#define ATTN_WANT_BF16 0
#endif

typedef long long i64;
typedef unsigned short u16;
typedef unsigned int u32;

#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.44269504088896341f

// One pattern of a fused forward launch: its blocks are grid.x indices from `first` up to
// the next entry's, `blocks` row blocks for each of its heads from head0 (disjoint from
// every other pattern's heads, so no two blocks write the same rows). Mirrored by
// `FusedPattern` in src/cuda/plan/params.rs.
#define MAX_FUSED 8
struct FusedPattern {
    i64 first, blocks, head0;
    i64 w, r, fixed_off;
    i64 band_left, band_right;
};

// Launch parameters of the attention kernels; mirrored by `AttnParams` in
// src/cuda/plan/params.rs (same field order, `#[repr(C)]`).
struct AttnParams {
    i64 q_sb, q_ss, q_sh;  // strides (elements) of q: batch, seq, head
    i64 k_sb, k_ss, k_sh;  // k (head stride between key/value heads)
    i64 v_sb, v_ss, v_sh;  // v
    i64 g_sb, g_ss, g_sh;  // grad_out (backward), or the output (a forward with out_direct)
    i64 nq, nk;            // rows of the q block and of the k/v block
    i64 q_start, k_start;  // position of row 0 of each block (relative to its packed sequence)
    i64 heads;             // query heads (layout of the f32 partial, lse, delta, dq)
    i64 kv_heads;          // key/value heads (layout of dk, dv)
    i64 kv_group;          // query heads per key/value head: head h reads kv head h / kv_group
    i64 head0;             // first head of this launch
    i64 head_step;         // blockIdx.y steps heads by this (kv_group in the backward: no dk/dv races)
    i64 w, r;              // the pattern
    i64 fixed_off;         // >= 0: offset of every head (HeadGroups); -1: head % r (LongNet)
    i64 d;                 // head_dim
    i64 band_left;         // the band in selected indices of the pattern (a band (L, R) of
    i64 band_right;        // positions is (L / r, R / r)): -1 = unbounded side; causal: right 0
    const unsigned char* kpad;  // key padding flags (1 = padded) of k-block row 0, or null
    i64 kpad_sb;           // batch stride of kpad
    const unsigned char* bmask;  // block mask (1 = kept) [batch][heads][q blocks][k blocks], or null
    i64 bm_sb, bm_sh;      // its batch and head strides (0 where one serves all)
    i64 bm_nbk;            // key blocks a row of it (its row stride)
    i64 bm_size;           // positions a block
    float scale;           // softmax scale
    float out_scale;       // the head's output scale (backward, and a forward with out_direct)
    int vec;               // bit 0: q, 1: k, 2: v, 3: grad_out (or direct output) rows allow 16-byte access
    int out_direct;        // forward: 1 = write the output (times out_scale) and lse of the rows it
                           // computes (the only launch covering them); 0 = LSE-merge into the f32 partial.
                           // backward: 1 = write dk/dv (dq for the dq kernel) in E into the gradients
    int fused;             // the fused tensor-core forward: this launch runs fuse[0..fused] (fused_block)
    int work_batch;        // a persistent launch: batch elements, each with the fused table's blocks
    FusedPattern fuse[MAX_FUSED];
    unsigned* work;        // a persistent launch: [next item, blocks done], zero between launches
    i64 work_items;        // a persistent launch: items (the table's blocks x work_batch)
    i64 head_base;         // global index of local query head 0 (a head window's first head, else 0)
    i64 kv_base;           // global index of local key/value head 0 (else 0)
};

// Parameters of the row-wise epilogue kernels; mirrored by `RowParams`.
struct RowParams {
    i64 batch, seq, heads, d;
    i64 a_sb, a_ss, a_sh;  // strides of the first strided tensor
    i64 b_sb, b_ss, b_sh;  // strides of the second strided tensor
    float scale;
    int pad;
};

struct F32E {
    typedef float S;
    static __device__ __forceinline__ float to_f(float x) { return x; }
    static __device__ __forceinline__ float from_f(float x) { return x; }
};

// ATTN_CPU_EMULATION: the CPU harness (kernels/emulation/) runs these kernels as C++
// threads and supplies emu_* stand-ins for the few PTX instructions used here.
#ifndef ATTN_DYNAMIC_SMEM
#define ATTN_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif
// A vector access needs its natural alignment on the GPU (a misaligned one faults); the
// emulation counts every one that lacks it.
#ifdef ATTN_CPU_EMULATION
#define ATTN_ALIGNED(p, bytes) emu_check_aligned((p), (bytes))
#else
#define ATTN_ALIGNED(p, bytes) ((void)0)
#endif

struct BF16E {
    typedef u16 S;
    static __device__ __forceinline__ float to_f(u16 x) { return __uint_as_float(((u32)x) << 16); }
    static __device__ __forceinline__ u16 from_f(float x) {
#ifdef ATTN_CPU_EMULATION
        return emu_f32_to_bf16(x);
#else
        u16 r;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
        return r;
#endif
    }
};

struct F16E {
    typedef u16 S;
    static __device__ __forceinline__ float to_f(u16 x) {
#ifdef ATTN_CPU_EMULATION
        return emu_f16_to_f32(x);
#else
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
#endif
    }
    static __device__ __forceinline__ u16 from_f(float x) {
#ifdef ATTN_CPU_EMULATION
        return emu_f32_to_f16(x);
#else
        u16 r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
        return r;
#endif
    }
};

struct Pattern {
    i64 w, r, off, per_seg;
};

// Positions, selected indices, segment lengths and rates are below 2^31 (the host checks
// and caps them), so their divisions run in 32 bits: a 64-bit division is a called
// routine whose registers spill around every call.
__device__ __forceinline__ i64 div32(i64 a, i64 b) { return (i64)((unsigned)a / (unsigned)b); }
__device__ __forceinline__ i64 mod32(i64 a, i64 b) { return (i64)((unsigned)a % (unsigned)b); }

__device__ __forceinline__ Pattern make_pattern(const AttnParams& a, i64 head) {
    Pattern p;
    p.w = a.w;
    p.r = a.r;
    p.off = a.fixed_off >= 0 ? a.fixed_off : mod32(head + a.head_base, a.r);
    // off < r <= w, so every full segment selects at least one position.
    p.per_seg = div32(a.w - p.off + a.r - 1, a.r);
    return p;
}

// Number of selected positions < x.
__device__ __forceinline__ i64 sel_below(const Pattern& p, i64 x) {
    i64 full = div32(x, p.w), rem = mod32(x, p.w);
    i64 tail = rem > p.off ? div32(rem - p.off + p.r - 1, p.r) : 0;
    return full * p.per_seg + tail;
}

// Global position of the t-th selected position.
__device__ __forceinline__ i64 sel_pos(const Pattern& p, i64 t) {
    return div32(t, p.per_seg) * p.w + p.off + mod32(t, p.per_seg) * p.r;
}

__device__ __forceinline__ i64 min64(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 max64(i64 a, i64 b) { return a > b ? a : b; }
__device__ __forceinline__ int min32(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int max32(int a, int b) { return a > b ? a : b; }

#define SEL_UNBOUNDED ((i64)1 << 62)

// The band in selected indices: inside one segment selected positions are r apart, so a
// query at selected index t sees the keys of its segment with indices t - band_left ..=
// t + band_right (a position band (L, R) is (L / r, R / r)). Callers always intersect
// with the segment, which is what makes the index form exact, and it needs no division.
// Selected key indices [*lo, *hi) the band admits for the query with selected index t.
__device__ __forceinline__ void band_keys(const AttnParams& a, i64 t, i64* lo, i64* hi) {
    *lo = a.band_left < 0 ? 0 : max64(t - a.band_left, 0);
    *hi = a.band_right < 0 ? SEL_UNBOUNDED : t + a.band_right + 1;
}

// Selected query indices [*lo, *hi) whose band admits the key with selected index tk.
__device__ __forceinline__ void band_queries(const AttnParams& a, i64 tk, i64* lo, i64* hi) {
    *lo = a.band_right < 0 ? 0 : max64(tk - a.band_right, 0);
    *hi = a.band_left < 0 ? SEL_UNBOUNDED : tk + a.band_left + 1;
}

// Whether row `krow` of the k block of batch b is padding.
__device__ __forceinline__ bool key_padded(const AttnParams& a, i64 b, i64 krow) {
    return a.kpad != nullptr && a.kpad[b * a.kpad_sb + krow] != 0;
}

// The query block of position qpos (relative to its packed sequence); -1 without a
// block mask. 32 bits: positions are below 2^31.
__device__ __forceinline__ int block_of(const AttnParams& a, i64 qpos) {
    return a.bmask == nullptr ? -1 : (int)div32(qpos, a.bm_size);
}

// The block mask's row of query block qb (>= 0) of head h, batch b: its entry kb is key block kb's.
__device__ __forceinline__ const unsigned char* block_row(const AttnParams& a, i64 b, i64 h, int qb) {
    return a.bmask + b * a.bm_sb + h * a.bm_sh + (i64)qb * a.bm_nbk;
}

// Whether the block mask removes the key at position kpos for query block qb (-1: none)
// of head h, batch b. The row is found again per key: a pointer kept across the key loop
// costs the row kernels two registers.
__device__ __forceinline__ bool block_removed(const AttnParams& a, i64 b, i64 h, int qb, i64 kpos) {
    return qb >= 0 && block_row(a, b, h, qb)[div32(kpos, a.bm_size)] == 0;
}

// The first selected index of pattern p at or past the block after the one holding
// position pos: where a loop over selected indices resumes past a removed block.
__device__ __forceinline__ i64 next_block_start(const AttnParams& a, const Pattern& p, i64 pos) {
    return sel_below(p, (div32(pos, a.bm_size) + 1) * a.bm_size);
}

// The query head of blockIdx.y and the key/value head it reads.
__device__ __forceinline__ i64 launch_head(const AttnParams& a) { return a.head0 + (i64)blockIdx.y * a.head_step; }

// The pattern, row block and head of fused grid index x: `a` with the pattern fields of
// the entry whose range holds x (entry 0 starts at 0, so every field is rewritten). The
// entries are read at constant indices (a dynamic index would copy them to local memory).
__device__ __forceinline__ void fused_item(AttnParams& a, i64 x, i64* bx, i64* h) {
    i64 first = 0, blocks = 1;
#pragma unroll
    for (int j = 0; j < MAX_FUSED; ++j) {
        if (j < a.fused && x >= a.fuse[j].first) {
            first = a.fuse[j].first;
            blocks = a.fuse[j].blocks;
            a.head0 = a.fuse[j].head0;
            a.w = a.fuse[j].w;
            a.r = a.fuse[j].r;
            a.fixed_off = a.fuse[j].fixed_off;
            a.band_left = a.fuse[j].band_left;
            a.band_right = a.fuse[j].band_right;
        }
    }
    *h = a.head0 + div32(x - first, blocks);
    *bx = mod32(x - first, blocks);
}

// The pattern, row block and head of this block: `a` as launched, or, in a fused launch,
// the fused_item of blockIdx.x.
__device__ __forceinline__ void fused_block(AttnParams& a, i64* bx, i64* h) {
    *bx = blockIdx.x;
    *h = launch_head(a);
    if (a.fused > 0) fused_item(a, blockIdx.x, bx, h);
}

// A persistent launch (a grid sized to the machine): each block takes work items from the
// counter a.work[0] until a.work_items are taken, item i being fused grid index
// i / work_batch of batch element i % work_batch, so items run in the table's order
// (heaviest patterns first) and every batch element of a row block together. The last
// block to finish sets both counters back to zero: the next launch finds them zeroed with
// no fill. `run(a, bx, h, b)` computes one item.
template <class Run>
__device__ __forceinline__ void persistent_items(AttnParams& a, Run run) {
    __shared__ unsigned s_item;
    for (;;) {
        if (threadIdx.x == 0) s_item = atomicAdd(a.work, 1u);
        __syncthreads();  // the item visible, and the previous item's shared memory free
        const unsigned item = s_item;
        __syncthreads();  // every thread has read it before thread 0 takes the next
        if ((i64)item >= a.work_items) break;
        i64 bx, h;
        fused_item(a, div32(item, a.work_batch), &bx, &h);
        run(a, bx, h, mod32(item, a.work_batch));
    }
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned done = atomicAdd(a.work + 1, 1u);
        if (done == gridDim.x * gridDim.y * gridDim.z - 1) {  // every other block has stopped taking items
            a.work[0] = 0;
            a.work[1] = 0;
        }
    }
}

// Key/value head of query head h (heads index gridDim.y: at most 65535), from its global
// index under a head window: global head head_base + h reads global key/value head
// (head_base + h) / kv_group, local head kv_base less.
__device__ __forceinline__ i64 kv_head_of(const AttnParams& a, i64 h) {
    return div32(h + a.head_base, a.kv_group) - a.kv_base;
}

// x from lane (lane ^ O) of a full warp. Inline PTX with immediate operands: the
// intrinsic with a register mask becomes a called routine whose registers spill.
template <int O>
__device__ __forceinline__ float shfl_xor(float x) {
#ifdef ATTN_CPU_EMULATION
    return __shfl_xor_sync(0xffffffffu, x, O);
#else
    float y;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x), "n"(O));
    return y;
#endif
}

// p[0] += x, p[1] += y in global memory (p 8-byte aligned): one vector reduction on sm_90
// (`red.global.add.v2.f32`), two f32 atomics before it.
__device__ __forceinline__ void atomic_add2(float* p, float x, float y) {
#if defined(ATTN_CPU_EMULATION) || __CUDA_ARCH__ < 900
    ATTN_ALIGNED(p, 8);
    atomicAdd(p, x);
    atomicAdd(p + 1, y);
#else
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(x), "f"(y) : "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float x) {
    x += shfl_xor<16>(x);
    x += shfl_xor<8>(x);
    x += shfl_xor<4>(x);
    x += shfl_xor<2>(x);
    return x + shfl_xor<1>(x);
}

// LSE merge of two partials (SPEC.md): merged lse and the weights of each side.
// Two -inf inputs give (-inf, 0, 0), never NaN.
__device__ __forceinline__ void lse_merge(float la, float lb, float* l, float* wa, float* wb) {
    if (la == NEG_INF && lb == NEG_INF) {
        *l = NEG_INF; *wa = 0.f; *wb = 0.f;
    } else if (lb == NEG_INF) {
        *l = la; *wa = 1.f; *wb = 0.f;
    } else if (la == NEG_INF) {
        *l = lb; *wa = 0.f; *wb = 1.f;
    } else {
        float m = fmaxf(la, lb);
        float lse = m + logf(expf(la - m) + expf(lb - m));
        *l = lse; *wa = expf(la - lse); *wb = expf(lb - lse);
    }
}

// Maximum head_dim of the row kernels: 32 lanes x ROW_CHUNKS values per lane.
#define ROW_CHUNKS 8
