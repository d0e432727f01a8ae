// stofc ONNX Runtime custom-op library: the attention launch plan (`*.plan.bin`) reader.
//
// The device arrays one attention kernel is launched with, precomputed at package
// time by stofc.package.maskbin.attention_launch_data exactly as the Python runtime
// computes them: for block- and row-wise kernels AttentionOp's walk list (gathered and
// residue-permuted variants included), its sentinels, gather_keys, q_perm and the
// longest-first tile-row orders; for the warp-specialised kernel WsLaunchData's pair-row
// walk, work items, per-run-length orders and combine table (stofc/package/ws_launch.py).
// Layout: maskbin.py and OPS.md. The reader validates every index a kernel follows, so a
// damaged file fails session creation.
#ifndef STOFC_ORT_LAUNCH_PLAN_H
#define STOFC_ORT_LAUNCH_PLAN_H

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda_attrs.h"

namespace stofc_ort {

/// The warp-specialised kernel's tables (plan kind 2). Per format head f: items
/// [f * n_items, ...) of kWsItemFields ints (pair row, begin, end, slot, shared), orders
/// [f * orders_per_head, ...), combine rows [f * n_split, ...) of 3 ints (pair row, first
/// slot, chunks). A pair row is the block's `consumers` (1 to 4) tile rows: ws_rows(consumers)
/// query rows.
struct WsTables {
    int pairs = 0, slots = 0, n_items = 0, n_split = 0, split = 0, orders_per_head = 0, consumers = 0;
    int period = 1;  // residue split (1, 2 or 4): the walk is the split mask's (residue.py)
    std::vector<int32_t> entry_key, entry_part, items, orders, combine, order_ptr, items_upto;
    bool splits = false;  // some pair row is split: workspace and the combine kernel
};

/// One array to upload: host bytes.
struct HostArray {
    const void* data;
    size_t bytes;
};

struct AttentionPlan {
    std::string path, spec_hash;
    KernelKind kind = KernelKind::kBlock;
    int tile = 0, tile_rows = 0, seq_len = 0;
    int num_heads = 1;  // the mask format's heads (1 = shared)
    // block- and row-wise
    bool permuted = false;
    int fmt_head_stride = 0;
    std::vector<int32_t> row_ptr, col_idx, part_idx, gather_keys, q_perm, row_orders;
    std::vector<uint64_t> bitmaps;  // every kind
    WsTables ws;                    // kind ws only

    /// Tile rows a run of `seq_len` covers (all of them for a permuted plan).
    int rows_for(int64_t seq_len) const {
        return permuted ? tile_rows : static_cast<int>((seq_len + tile - 1) / tile);
    }
    /// Offset of the order for `rows` rows inside row_orders.
    size_t order_offset(int rows) const { return static_cast<size_t>(rows) * (rows - 1) / 2; }
    /// The arrays the kernel reads on the device, in upload order: block/row kPlan*,
    /// ws kWs* below.
    std::vector<HostArray> device_arrays() const;
};

/// Upload order of a block- or row-wise plan's arrays.
enum : int { kPlanRowPtr, kPlanColIdx, kPlanPartIdx, kPlanBitmaps, kPlanGatherKeys, kPlanQPerm, kPlanOrders };
/// Upload order of a ws plan's arrays.
enum : int { kWsEntryKey, kWsEntryPart, kWsBitmaps, kWsItems, kWsOrders, kWsCombine };

/// The scalar part of one attention launch, computed from the run's shapes exactly as
/// stofc/runtime/attention.py (AttentionOp.bind) computes it for contiguous
/// [B, S, H*D] tensors; pure host code, unit-tested against AttentionOp.bind.
struct AttentionLaunchShape {
    int64_t B = 0, S = 0, H = 0, D = 0;
    int64_t Hkv = 0;  // K/V heads (0: = H)
    bool has_key_bits = false, has_bias = false;
    int64_t bias_sb = 0, bias_sh = 0;  // element strides of bias (0 = broadcast)
    int64_t blocks_per_tile_row = 1;
    float scale = 1.0f;
    float softcap = 0.0f;
    bool packed = false;  // q is packed QKV [B, S, (H + 2*Hkv)*D] (k and v omitted)
};
struct AttentionLaunchScalars {
    int rows = 0;              // tile rows launched
    int64_t grid = 0;          // H * B * rows * blocks_per_tile_row
    size_t order_offset = 0;   // elements into row_orders
    long long q_sb = 0, q_ss = 0, q_sh = 0;
    long long k_sb = 0, k_ss = 0, k_sh = 0;  // also v (its own tensor like k, or q's packed rows)
    long long o_sb = 0, o_ss = 0, o_sh = 0;  // out: always contiguous [B, S, H*D]
    long long k_offset = 0, v_offset = 0;    // elements from q's data to k's / v's (packed QKV only)
    int permuted = 0, fmt_head_stride = 0, key_words = 0;
    long long bias_sb = 0, bias_sh = 0, bias_sq = 0;
    int B = 0, H = 0, L = 0;
    float scale = 0.0f;
    int kv_group = 1;      // query heads per K/V head
    float softcap = 0.0f;
};
AttentionLaunchScalars attention_scalars(const AttentionPlan& plan, const AttentionLaunchShape& shape);

/// One rank-4 TMA tensor map of a [B, S, heads, D] view of 16-bit elements, as
/// stofc/runtime/attention_ws.py (WsLaunchData._map) encodes it: dims innermost first
/// (D, heads, S, B), byte strides of dims 1..3 (head, seq, batch), box (64, 1, 64 P, 1) and
/// element strides (1, 1, P, 1) for the plan's residue period P (64 rows, P apart).
struct TensorMapShape {
    uint64_t dims[4] = {0, 0, 0, 0};
    uint64_t strides[3] = {0, 0, 0};
    uint32_t box[4] = {0, 0, 0, 0};
    uint32_t elem[4] = {1, 1, 1, 1};
    long long offset = 0;  // elements from q's data to the view's first element (packed k, v)
};

/// The ws launches' scalars beyond attention_scalars' (WsLaunchData.bind): the work items
/// of the run's pair rows, the grids, head strides, tensor maps and workspace.
struct WsLaunchScalars {
    int pairs = 0;             // pair rows the run covers: min(pairs, ceil(ceil(S / period) / rows))
    int threads = 0;           // ws_threads(consumers)
    int64_t order_offset = 0;  // elements into each head's orders: order_ptr[pairs - 1]
    int64_t items = 0;         // items per head launched: items_upto[pairs]
    int64_t n_work = 0;        // H * B * period * items: the works of the persistent grid
    int64_t grid = 0;          // min(n_work, sm_count * ws_blocks_per_sm(consumers))
    int64_t combine_grid = 0;  // H * B * period * n_split * kWsCombineGroups (0: no row split)
    int items_head_stride = 0, order_head_stride = 0, combine_head_stride = 0, slots = 0;
    TensorMapShape q, k, v;
    size_t part_o_bytes = 0, part_ml_bytes = 0;  // float32 workspace (0 when no row is split)
};
/// `sm_count`: the GPU's multiprocessors (the persistent grid's bound: ws_blocks_per_sm
/// blocks on each).
WsLaunchScalars ws_scalars(const AttentionPlan& plan, const AttentionLaunchShape& shape,
                           const AttentionLaunchScalars& base, int64_t sm_count);

/// Reads and validates `path` (thrown OpError names the file and the defect).
std::shared_ptr<const AttentionPlan> load_attention_plan(const std::string& path);

}  // namespace stofc_ort

#endif  // STOFC_ORT_LAUNCH_PLAN_H
