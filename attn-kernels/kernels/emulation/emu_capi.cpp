// emu_capi.cpp: the CUDA kernels of ../*.cu on the CPU (emu_runtime.hpp) behind one C entry,
// so Rust code (attn_kernels::cuda::emulation) can run its own launch plans against them.
//
// Build (no GPU, no CUDA toolkit):
//   g++ -std=c++20 -O2 -pthread -shared -fPIC attn-kernels/kernels/emulation/emu_capi.cpp -o libattn_cuda_emu.so
//
// attn_emu_launch(name, gx, gy, gz, threads, smem, order, args): runs kernel `name` over the
// grid with `smem` bytes of dynamic shared memory, its blocks in grid order (`order` 0) or in
// the permutation seed `order` draws (a GPU runs blocks in any order), `args` pointing at
// each argument's value in order (as cuLaunchKernel's kernelParams). Returns 0, 1 for an unknown kernel name, 2 when
// a block left cp.async copies unwaited, 3 when a block wrote past its dynamic shared
// memory, 4 when a vector access (global or shared memory) was off its alignment (a fault
// on the GPU), 5 when a block misused the Hopper instructions (an mbarrier, a wgmma
// descriptor or a TMA copy: emu_hopper.hpp's faults), left their work in flight, or
// deadlocked. Launches are serialised (the emulator has one block state).
//
// attn_emu_encode_tiled_2d(maps, index, ...): the emulated cuTensorMapEncodeTiled of a 2-D
// map of 16-bit elements into entry `index` of an array of the maps the sm_90a forward
// reads (attn_emu_tensor_map_bytes() bytes each); 0, or 1 where the driver would refuse it.
#include "emu_runtime.hpp"
#include "emu_hopper.hpp"

#include "../prelude.cu"
#include "../dilated_rows.cu"
#include "../mma_tiles.cu"
#include "../attend_tile.cu"
#include "../dilated_fwd_mma.cu"
#include "../dilated_fwd_mma3.cu"
#include "../dilated_bwd_mma.cu"
#include "../dilated_bwd_dq_mma.cu"
#include "../epilogue.cu"
#include "../tma_mbarrier.cu"
#include "../wgmma.cu"
#include "../dilated_fwd_wgmma.cu"
#include "../dilated_bwd_wgmma.cu"

#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace {

template <class... P, std::size_t... I>
std::tuple<P...> unpack(void** a, std::index_sequence<I...>) {
    return std::tuple<P...>{*static_cast<std::remove_reference_t<P>*>(a[I])...};
}

// Run a kernel whose parameters are read from `args` by its own signature, with `smem`
// bytes of dynamic shared memory; 2 when a block ended with cp.async copies never waited
// for, 3 when a block wrote past its dynamic shared memory, 4 for a misaligned vector
// access (global or shared memory).
template <class... P>
int run(void (*kernel)(P...), Dim3 grid, unsigned threads, unsigned smem, unsigned long long order, void** args) {
    const std::tuple<P...> vals = unpack<P...>(args, std::index_sequence_for<P...>{});
    emu::g_unwaited_blocks = 0;
    emu::g_smem_overruns = 0;
    emu::g_misaligned = 0;
    emu::g_hopper_faults = emu::g_hopper_unwaited = emu::g_deadlocks = 0;
    emu::hopper_install();
    emu::launch(grid, threads, [=] { std::apply(kernel, vals); }, smem, order);
    if (emu::g_hopper_faults + emu::g_hopper_unwaited + emu::g_deadlocks != 0) return 5;
    return emu::g_unwaited_blocks != 0 ? 2 : emu::g_smem_overruns != 0 ? 3 : emu::g_misaligned != 0 ? 4 : 0;
}

using Entry = int (*)(Dim3, unsigned, unsigned, unsigned long long, void**);
#define ATTN_EMU_ENTRY(f) \
    {#f, [](Dim3 g, unsigned t, unsigned m, unsigned long long o, void** a) { return run(&f, g, t, m, o, a); }}
#define ATTN_EMU_DTYPE(T)                                                                               \
    ATTN_EMU_ENTRY(dilated_fwd_rows_##T), ATTN_EMU_ENTRY(dilated_bwd_dq_rows_##T),                       \
        ATTN_EMU_ENTRY(dilated_bwd_dkv_rows_##T), ATTN_EMU_ENTRY(store_rows_##T), ATTN_EMU_ENTRY(delta_rows_##T), \
        ATTN_EMU_ENTRY(fill_lse_##T), ATTN_EMU_ENTRY(store_rows_v8_##T)
#define ATTN_EMU_MMA(T)                                                                                 \
    ATTN_EMU_ENTRY(dilated_fwd_mma_##T##_d32), ATTN_EMU_ENTRY(dilated_fwd_mma_##T##_d64),                \
        ATTN_EMU_ENTRY(dilated_fwd_mma_##T##_d128), ATTN_EMU_ENTRY(dilated_fwd_mma_##T##_d256),          \
        ATTN_EMU_ENTRY(dilated_fwd_mma_m128_##T##_d32), ATTN_EMU_ENTRY(dilated_fwd_mma_m128_##T##_d64),  \
        ATTN_EMU_ENTRY(dilated_fwd_mma_m128_##T##_d128), ATTN_EMU_ENTRY(dilated_fwd_mma_m128_##T##_d256), \
        ATTN_EMU_ENTRY(dilated_fwd_mma_m128w4_##T##_d32), ATTN_EMU_ENTRY(dilated_fwd_mma_m128w4_##T##_d64), \
        ATTN_EMU_ENTRY(dilated_fwd_mma_m128w4_##T##_d128),                                               \
        ATTN_EMU_ENTRY(dilated_fwd_mma_fused_##T##_d32), ATTN_EMU_ENTRY(dilated_fwd_mma_fused_##T##_d64),  \
        ATTN_EMU_ENTRY(dilated_fwd_mma_fused_##T##_d128), ATTN_EMU_ENTRY(dilated_fwd_mma_fused_##T##_d256), \
        ATTN_EMU_ENTRY(dilated_fwd_mma_persistent_##T##_d32), ATTN_EMU_ENTRY(dilated_fwd_mma_persistent_##T##_d64), \
        ATTN_EMU_ENTRY(dilated_fwd_mma_persistent_##T##_d128), ATTN_EMU_ENTRY(dilated_fwd_mma_persistent_##T##_d256), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_##T##_d32), ATTN_EMU_ENTRY(dilated_bwd_mma_##T##_d64),            \
        ATTN_EMU_ENTRY(dilated_bwd_mma_##T##_d128), ATTN_EMU_ENTRY(dilated_bwd_mma_pipelined_##T##_d32),  \
        ATTN_EMU_ENTRY(dilated_bwd_mma_pipelined_##T##_d64), ATTN_EMU_ENTRY(dilated_bwd_mma_pipelined_##T##_d128), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_k128_##T##_d64), ATTN_EMU_ENTRY(dilated_bwd_mma_k128_##T##_d128),      \
        ATTN_EMU_ENTRY(dilated_bwd_mma_pipelined_k128_##T##_d64),                                              \
        ATTN_EMU_ENTRY(dilated_bwd_mma_pipelined_k128_##T##_d128), ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_##T##_d32),  \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_##T##_d64), ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_##T##_d128),            \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_pipelined_##T##_d32), ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_pipelined_##T##_d64), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_pipelined_##T##_d128), ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_k128_##T##_d64),  \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_k128_##T##_d128),                                                      \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_pipelined_k128_##T##_d64),                                              \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_pipelined_k128_##T##_d128), ATTN_EMU_ENTRY(delta_rows_v8_##T),   \
        ATTN_EMU_ENTRY(dilated_bwd_dq_mma_##T##_d32), ATTN_EMU_ENTRY(dilated_bwd_dq_mma_##T##_d64),                \
        ATTN_EMU_ENTRY(dilated_bwd_dq_mma_##T##_d128),                                                   \
        ATTN_EMU_ENTRY(dilated_bwd_mma_q64_##T##_d32), ATTN_EMU_ENTRY(dilated_bwd_mma_q64_##T##_d64), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_q64_##T##_d128), ATTN_EMU_ENTRY(dilated_bwd_mma_k128_q64_##T##_d64), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_k128_q64_##T##_d128), ATTN_EMU_ENTRY(dilated_bwd_mma_pipelined_q64_##T##_d32), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_pipelined_q64_##T##_d64), ATTN_EMU_ENTRY(dilated_bwd_mma_pipelined_q64_##T##_d128), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_pipelined_k128_q64_##T##_d64), ATTN_EMU_ENTRY(dilated_bwd_mma_pipelined_k128_q64_##T##_d128), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_q64_##T##_d32), ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_q64_##T##_d64), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_q64_##T##_d128), ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_k128_q64_##T##_d64), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_k128_q64_##T##_d128), ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_pipelined_q64_##T##_d32), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_pipelined_q64_##T##_d64), ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_pipelined_q64_##T##_d128), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_pipelined_k128_q64_##T##_d64), ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_pipelined_k128_q64_##T##_d128)
// The instances that read the block mask (`_bm_`).
#define ATTN_EMU_MMA_BM(T)                                                                              \
    ATTN_EMU_ENTRY(dilated_fwd_mma_bm_##T##_d32), ATTN_EMU_ENTRY(dilated_fwd_mma_bm_##T##_d64),          \
        ATTN_EMU_ENTRY(dilated_fwd_mma_bm_##T##_d128), ATTN_EMU_ENTRY(dilated_fwd_mma_bm_##T##_d256),    \
        ATTN_EMU_ENTRY(dilated_bwd_mma_bm_##T##_d32), ATTN_EMU_ENTRY(dilated_bwd_mma_bm_##T##_d64),      \
        ATTN_EMU_ENTRY(dilated_bwd_mma_bm_##T##_d128), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_bm_##T##_d32), ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_bm_##T##_d64), \
        ATTN_EMU_ENTRY(dilated_bwd_mma_dkv_bm_##T##_d128), \
        ATTN_EMU_ENTRY(dilated_bwd_dq_mma_bm_##T##_d32), ATTN_EMU_ENTRY(dilated_bwd_dq_mma_bm_##T##_d64), \
        ATTN_EMU_ENTRY(dilated_bwd_dq_mma_bm_##T##_d128)
#define ATTN_EMU_MMA3(T)                                                                                \
    ATTN_EMU_ENTRY(dilated_fwd_mma3_##T##_d32), ATTN_EMU_ENTRY(dilated_fwd_mma3_##T##_d64),              \
        ATTN_EMU_ENTRY(dilated_fwd_mma3_##T##_d128), ATTN_EMU_ENTRY(dilated_fwd_mma3_##T##_d256),        \
        ATTN_EMU_ENTRY(dilated_fwd_mma3_m128_##T##_d32), ATTN_EMU_ENTRY(dilated_fwd_mma3_m128_##T##_d64), \
        ATTN_EMU_ENTRY(dilated_fwd_mma3_m128_##T##_d128), ATTN_EMU_ENTRY(dilated_fwd_mma3_m128w4_##T##_d32), \
        ATTN_EMU_ENTRY(dilated_fwd_mma3_m128w4_##T##_d64), ATTN_EMU_ENTRY(dilated_fwd_mma3_m128w4_##T##_d128), \
        ATTN_EMU_ENTRY(dilated_fwd_mma3_fused_##T##_d32), ATTN_EMU_ENTRY(dilated_fwd_mma3_fused_##T##_d64), \
        ATTN_EMU_ENTRY(dilated_fwd_mma3_fused_##T##_d128), ATTN_EMU_ENTRY(dilated_fwd_mma3_fused_##T##_d256), \
        ATTN_EMU_ENTRY(dilated_fwd_mma3_persistent_##T##_d32), ATTN_EMU_ENTRY(dilated_fwd_mma3_persistent_##T##_d64), \
        ATTN_EMU_ENTRY(dilated_fwd_mma3_persistent_##T##_d128), ATTN_EMU_ENTRY(dilated_fwd_mma3_persistent_##T##_d256)

// The sm_90a forward and backward (TMA tensor maps, wgmma).
#define ATTN_EMU_WGMMA(T)                                                                               \
    ATTN_EMU_ENTRY(dilated_fwd_wgmma_##T##_d32), ATTN_EMU_ENTRY(dilated_fwd_wgmma_##T##_d64),            \
        ATTN_EMU_ENTRY(dilated_fwd_wgmma_##T##_d128), ATTN_EMU_ENTRY(dilated_bwd_wgmma_##T##_d32),       \
        ATTN_EMU_ENTRY(dilated_bwd_wgmma_##T##_d64), ATTN_EMU_ENTRY(dilated_bwd_wgmma_##T##_d128)

const std::map<std::string, Entry>& table() {
    static const std::map<std::string, Entry> t = {
        ATTN_EMU_WGMMA(f16), ATTN_EMU_WGMMA(bf16), ATTN_EMU_DTYPE(f32), ATTN_EMU_DTYPE(f16), ATTN_EMU_DTYPE(bf16), ATTN_EMU_MMA(f16), ATTN_EMU_MMA(bf16), ATTN_EMU_MMA_BM(f16), ATTN_EMU_MMA_BM(bf16), ATTN_EMU_MMA3(f16),
        ATTN_EMU_MMA3(bf16),
    };
    return t;
}

}  // namespace

extern "C" int attn_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                               unsigned smem, unsigned long long order, void** args) {
    static std::mutex serial;
    const std::lock_guard<std::mutex> lock(serial);
    const auto it = table().find(name);
    if (it == table().end()) return 1;
    return it->second(Dim3{gx, gy, gz}, threads, smem, order, args);
}

extern "C" int attn_emu_encode_tiled_2d(void* maps, unsigned index, const void* base, unsigned long long dim0,
                                        unsigned long long dim1, unsigned long long stride1, unsigned box0,
                                        unsigned box1, unsigned swizzle) {
    if (swizzle > 3) return 1;
    EmuTensorMap* m = static_cast<EmuTensorMap*>(maps) + index;
    return emu::encode_tiled_2d(m, 2, base, dim0, dim1, stride1, box0, box1, static_cast<Swizzle>(swizzle));
}

extern "C" unsigned attn_emu_tensor_map_bytes() { return (unsigned)sizeof(EmuTensorMap); }

// The number of kernels this library runs (a Rust test checks it against the kernel list).
extern "C" int attn_emu_kernel_count() { return (int)table().size(); }
