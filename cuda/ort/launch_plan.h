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

/// Reads and validates `path` (thrown OpError names the file and the defect).
std::shared_ptr<const AttentionPlan> load_attention_plan(const std::string& path);

}  // namespace stofc_ort

#endif  // STOFC_ORT_LAUNCH_PLAN_H
