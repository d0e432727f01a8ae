// stofc ONNX Runtime custom-op library: the attention kernels' frozen launch ABI.
//
// THE machine-readable tables of the attention kernels' argument lists, in order:
//   STOFC_ATTENTION_ABI: the block-wise and row-wise kernels
//     (templates/attention/{block,block_wgmma,row}.cu.j2), as
//     stofc/runtime/attention.py (AttentionOp.bind) passes it;
//   STOFC_ATTENTION_WS_ABI and STOFC_ATTENTION_WS_COMBINE_ABI: the warp-specialised
//     kernel (templates/attention/block_ws.cu.j2) and its combine kernel (entry
//     `<entry>_combine` of the same module), as stofc/runtime/attention_ws.py
//     (WsLaunchData.bind) passes them.
// The CUDA twin of SparseAttention builds its argument structs and its cuLaunchKernel
// parameter arrays from these tables (cuda_attention.cc, cuda_attention_ws.cc), and
// tests/unit/test_ortlib_abi.py and tests/unit/test_ortlib_ws.py check them against the
// templates' signatures, against the argument tuples the Python runtime builds, and
// against the tables in OPS.md.
//
// One row per argument: X(name, type), type one of
//   ptr (a device pointer, 8 bytes), i64 (long long), i32 (int), f32 (float),
//   map (a CUtensorMap: 128 bytes, 64-byte aligned, passed by value as a
//   `const __grid_constant__` parameter; cuTensorMapEncodeTiled fills it on the host).
// Names are the block-wise template's (resp. the ws template's) parameter names.
//
// kAttentionKernelAbi is the `kernel_abi` attribute value a SparseAttention node
// must carry for the CUDA twin to launch it. Change a table => bump it.
#ifndef STOFC_ORT_ATTENTION_ABI_H
#define STOFC_ORT_ATTENTION_ABI_H

#include <cstdint>

#define STOFC_ATTENTION_ABI(X) \
    X(q, ptr)                  \
    X(k, ptr)                  \
    X(v, ptr)                  \
    X(o, ptr)                  \
    X(q_sb, i64)               \
    X(q_ss, i64)               \
    X(q_sh, i64)               \
    X(k_sb, i64)               \
    X(k_ss, i64)               \
    X(k_sh, i64)               \
    X(v_sb, i64)               \
    X(v_ss, i64)               \
    X(v_sh, i64)               \
    X(o_sb, i64)               \
    X(o_ss, i64)               \
    X(o_sh, i64)               \
    X(tile_row_ptr, ptr)       \
    X(tile_key, ptr)           \
    X(tile_part, ptr)          \
    X(bitmaps, ptr)            \
    X(gather_keys, ptr)        \
    X(q_perm, ptr)             \
    X(permuted, i32)           \
    X(fmt_head_stride, i32)    \
    X(row_order, ptr)          \
    X(kv_len, ptr)             \
    X(key_bits, ptr)           \
    X(key_words, i32)          \
    X(bias, ptr)               \
    X(bias_sb, i64)            \
    X(bias_sh, i64)            \
    X(bias_sq, i64)            \
    X(B, i32)                  \
    X(H, i32)                  \
    X(L, i32)                  \
    X(scale, f32)              \
    X(kv_group, i32)           \
    X(softcap, f32)

#define STOFC_ATTENTION_WS_ABI(X) \
    X(tma_q, map)                 \
    X(tma_k, map)                 \
    X(tma_v, map)                 \
    X(o, ptr)                     \
    X(o_sb, i64)                  \
    X(o_ss, i64)                  \
    X(o_sh, i64)                  \
    X(entry_key, ptr)             \
    X(entry_part, ptr)            \
    X(bitmaps, ptr)               \
    X(items, ptr)                 \
    X(item_order, ptr)            \
    X(items_head_stride, i32)     \
    X(order_head_stride, i32)     \
    X(kv_len, ptr)                \
    X(key_bits, ptr)              \
    X(key_words, i32)             \
    X(bias, ptr)                  \
    X(bias_sb, i64)               \
    X(bias_sh, i64)               \
    X(bias_sq, i64)               \
    X(part_o, ptr)                \
    X(part_ml, ptr)               \
    X(slots, i32)                 \
    X(B, i32)                     \
    X(H, i32)                     \
    X(L, i32)                     \
    X(scale, f32)                 \
    X(kv_group, i32)              \
    X(softcap, f32)               \
    X(n_work, i32)

#define STOFC_ATTENTION_WS_COMBINE_ABI(X) \
    X(o, ptr)                             \
    X(o_sb, i64)                          \
    X(o_ss, i64)                          \
    X(o_sh, i64)                          \
    X(combine, ptr)                       \
    X(combine_head_stride, i32)           \
    X(part_o, ptr)                        \
    X(part_ml, ptr)                       \
    X(slots, i32)                         \
    X(B, i32)                             \
    X(H, i32)                             \
    X(L, i32)

namespace stofc_ort {

// 4: the kernels the twins launch with programmatic dependent launch (cuda_driver.h
// launch_kernel: ws attention and its combine, Add+Norm, the Hopper GEMM) wait on their grid
// dependency (cuda/stofc/pdl.cuh), so kernels of an older package must not be launched so.
constexpr int64_t kAttentionKernelAbi = 4;

// The warp-specialised kernel's launch shape (templates/attention/block_ws.cu.j2,
// stofc/runtime/attention_ws.py): a producer warpgroup and 1 to 4 consumer warpgroups
// (the plan's `consumers`), 64 query rows (one 64-row tile row) per consumer, 64x64 mask
// tiles, ws_blocks_per_sm(consumers) blocks resident on an SM; the combine kernel runs
// 256 threads.
constexpr int kWsCombineThreads = 256;
// blocks per split pair row of the combine kernel (COMBINE_GROUPS, stofc/kernels/attention/ws.py)
constexpr int kWsCombineGroups = 16;
constexpr int kWsTile = 64;
constexpr int ws_threads(int consumers) { return 128 * (consumers + 1); }
constexpr int ws_rows(int consumers) { return kWsTile * consumers; }
// Blocks of `consumers` consumer warpgroups resident on one SM: the persistent grid's blocks
// per SM (launch_plan.cc ws_scalars) and the kernel's __launch_bounds__ minimum. The Python
// twin is ws_plan.WS_BLOCKS_PER_SM (tests/unit/test_ortlib_abi.py ties them): one consumer
// runs three blocks an SM (they must share its shared memory: the twin asks for the largest
// carveout, cuda_attention.cc), wider blocks one.
constexpr int ws_blocks_per_sm(int consumers) { return consumers == 1 ? 3 : 1; }
constexpr int kWsBox = 64;  // TMA box: 64 elements of head_dim (one 128-byte panel) x 64 rows
// ints per work item: (pair row, begin, end, slot, shared) (ITEM_FIELDS, stofc/kernels/attention/ws_plan.py)
constexpr int kWsItemFields = 5;

namespace abi {
using ptr = const void*;
using i64 = long long;
using i32 = int;
using f32 = float;
/// A CUtensorMap by value (the kernel's TmaDesc: 16 words, 64-byte aligned).
struct alignas(64) map {
    unsigned long long words[16];
};
static_assert(sizeof(map) == 128, "a CUtensorMap is 128 bytes");
}  // namespace abi

/// The attention kernel's arguments, one field per table row, in order.
struct AttentionArgs {
#define STOFC_ABI_FIELD(name, type) abi::type name;
    STOFC_ATTENTION_ABI(STOFC_ABI_FIELD)
#undef STOFC_ABI_FIELD
};

/// The ws kernel's arguments (STOFC_ATTENTION_WS_ABI).
struct WsAttentionArgs {
#define STOFC_ABI_FIELD(name, type) abi::type name;
    STOFC_ATTENTION_WS_ABI(STOFC_ABI_FIELD)
#undef STOFC_ABI_FIELD
};

/// The ws combine kernel's arguments (STOFC_ATTENTION_WS_COMBINE_ABI).
struct WsCombineArgs {
#define STOFC_ABI_FIELD(name, type) abi::type name;
    STOFC_ATTENTION_WS_COMBINE_ABI(STOFC_ABI_FIELD)
#undef STOFC_ABI_FIELD
};

#define STOFC_ABI_COUNT(name, type) +1
/// Number of arguments in each table.
constexpr int kAttentionArgCount = 0 STOFC_ATTENTION_ABI(STOFC_ABI_COUNT);
constexpr int kWsArgCount = 0 STOFC_ATTENTION_WS_ABI(STOFC_ABI_COUNT);
constexpr int kWsCombineArgCount = 0 STOFC_ATTENTION_WS_COMBINE_ABI(STOFC_ABI_COUNT);
#undef STOFC_ABI_COUNT

}  // namespace stofc_ort

#endif  // STOFC_ORT_ATTENTION_ABI_H
