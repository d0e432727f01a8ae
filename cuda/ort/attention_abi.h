// stofc ONNX Runtime custom-op library: the attention kernels' frozen launch ABI.
//
// THE machine-readable table of the argument list of the block-wise and row-wise
// attention kernels (templates/attention/{block,row}.cu.j2), in order, as
// stofc/runtime/attention.py (AttentionOp.bind) passes it. The CUDA twin of
// SparseAttention builds its argument struct and its cuLaunchKernel parameter
// array from this table (cuda_ops.cc), and tests/unit/test_ortlib_abi.py checks
// it against both templates' signatures, against the argument tuple that
// AttentionOp.bind builds, and against the table in OPS.md.
//
// One row per argument: X(name, type), type one of
//   ptr (a device pointer, 8 bytes), i64 (long long), i32 (int), f32 (float).
// Names are the block-wise template's parameter names.
//
// kAttentionKernelAbi is the `kernel_abi` attribute value a SparseAttention node
// must carry for the CUDA twin to launch it. Change the table => bump it.
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

namespace stofc_ort {

constexpr int64_t kAttentionKernelAbi = 3;

namespace abi {
using ptr = const void*;
using i64 = long long;
using i32 = int;
using f32 = float;
}  // namespace abi

/// The attention kernel's arguments, one field per table row, in order.
struct AttentionArgs {
#define STOFC_ABI_FIELD(name, type) abi::type name;
    STOFC_ATTENTION_ABI(STOFC_ABI_FIELD)
#undef STOFC_ABI_FIELD
};

/// Number of arguments in the table.
constexpr int kAttentionArgCount = 0
#define STOFC_ABI_COUNT(name, type) +1
    STOFC_ATTENTION_ABI(STOFC_ABI_COUNT)
#undef STOFC_ABI_COUNT
    ;

}  // namespace stofc_ort

#endif  // STOFC_ORT_ATTENTION_ABI_H
