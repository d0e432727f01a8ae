// stofc ONNX Runtime custom-op library: the warp-specialised attention kernel's launches.
//
// The CUDA twin of SparseAttention (cuda_attention.cc) hands a ws run here once its
// plan is uploaded and its scratch taken: the main kernel (STOFC_ATTENTION_WS_ABI) with
// the q, k and v tensor maps, then, when the plan splits pair rows, the combine kernel
// (STOFC_ATTENTION_WS_COMBINE_ABI, entry `<entry>_combine` of the same module) on the
// same stream. Tensor maps are encoded on the host with cuTensorMapEncodeTiled (no
// device call, nothing a CUDA graph capture records: the launch copies the 128 bytes
// into its parameters) and kept per (address, dtype, shape, strides) in a small cache.
#ifndef STOFC_ORT_CUDA_ATTENTION_WS_H
#define STOFC_ORT_CUDA_ATTENTION_WS_H

#include <mutex>
#include <vector>

#include "attention_abi.h"
#include "cuda_driver.h"
#include "launch_plan.h"

namespace stofc_ort {

/// Encoded tensor maps by (dtype, address, dims, strides, box); at most kCapacity, the
/// oldest dropped first. Thread-safe (its own mutex).
class TensorMapCache {
  public:
    static constexpr size_t kCapacity = 64;
    /// The map of the 16-bit tensor at `address` described by `shape` (OpError when the
    /// driver lacks cuTensorMapEncodeTiled, the address or a stride is not 16-byte aligned,
    /// or the driver refuses).
    abi::map get(const Driver& drv, bool bf16, const void* address, const TensorMapShape& shape);

  private:
    struct Entry {
        bool bf16;
        const void* address;
        TensorMapShape shape;
        abi::map map;
    };
    std::mutex mu_;
    std::vector<Entry> entries_;
};

/// The device side of one ws run (cuda_attention.cc fills it).
struct WsLaunch {
    CUfunction main, combine;
    CUstream stream;
    unsigned smem;  // the main kernel's dynamic shared memory
    bool bf16;
    const void *q, *k, *v;  // the views' first elements (packed: inside q)
    void* o;
    const void *entry_key, *entry_part, *bitmaps, *items, *item_order, *combine_rows;
    const void *kv_len, *key_bits, *bias;
    void *part_o, *part_ml;  // nullptr when the plan splits no row
};

/// Launches the persistent main kernel (grid wsc.grid = min(n_work, SMs *
/// ws_blocks_per_sm(consumers)), wsc.threads threads, n_work works) and, when rows are split, the combine kernel (grid
/// wsc.combine_grid = H B n_split kWsCombineGroups, kWsCombineThreads threads).
void launch_ws(const Driver& drv, TensorMapCache& maps, const WsLaunch& l, const AttentionLaunchScalars& sc,
               const WsLaunchScalars& wsc);

}  // namespace stofc_ort

#endif  // STOFC_ORT_CUDA_ATTENTION_WS_H
