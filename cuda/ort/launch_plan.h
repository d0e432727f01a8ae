// stofc ONNX Runtime custom-op library: the attention launch plan (`*.plan.bin`) reader.
//
// The device arrays one attention kernel is launched with, precomputed at package
// time by stofc.package.maskbin.attention_launch_data exactly as
// stofc/runtime/attention.py (AttentionOp) computes them: the walk list (gathered
// and residue-permuted variants included), its sentinels, gather_keys, q_perm and
// the longest-first tile-row orders. Layout: maskbin.py and OPS.md. The reader
// validates every index a kernel follows, so a damaged file fails session creation.
#ifndef STOFC_ORT_LAUNCH_PLAN_H
#define STOFC_ORT_LAUNCH_PLAN_H

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace stofc_ort {

struct AttentionPlan {
    std::string path, spec_hash;
    bool block = true;  // kind: block-wise (else row-wise)
    int tile = 0, tile_rows = 0, seq_len = 0;
    bool permuted = false;
    int fmt_head_stride = 0;
    std::vector<int32_t> row_ptr, col_idx, part_idx, gather_keys, q_perm, row_orders;
    std::vector<uint64_t> bitmaps;

    /// Tile rows a run of `seq_len` covers (all of them for a permuted plan).
    int rows_for(int64_t seq_len) const {
        return permuted ? tile_rows : static_cast<int>((seq_len + tile - 1) / tile);
    }
    /// Offset of the order for `rows` rows inside row_orders.
    size_t order_offset(int rows) const { return static_cast<size_t>(rows) * (rows - 1) / 2; }
};

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

/// Reads and validates `path` (thrown OpError names the file and the defect).
std::shared_ptr<const AttentionPlan> load_attention_plan(const std::string& path);

}  // namespace stofc_ort

#endif  // STOFC_ORT_LAUNCH_PLAN_H
