// stofc ONNX Runtime custom-op library: the warp-specialised attention kernel's launches
// (cuda_attention_ws.h; the Python twin is stofc/runtime/attention_ws.py, WsLaunchData.bind).
#include "cuda_attention_ws.h"

#include <cstdint>
#include <cstring>
#include <string>

#include "common.h"

namespace stofc_ort {
namespace {

bool same_shape(const TensorMapShape& a, const TensorMapShape& b) {
    return std::memcmp(a.dims, b.dims, sizeof a.dims) == 0 && std::memcmp(a.strides, b.strides, sizeof a.strides) == 0 &&
           std::memcmp(a.box, b.box, sizeof a.box) == 0 && std::memcmp(a.elem, b.elem, sizeof a.elem) == 0;
}

std::string shape_text(const TensorMapShape& s) {
    return "dims [" + std::to_string(s.dims[0]) + ", " + std::to_string(s.dims[1]) + ", " + std::to_string(s.dims[2]) +
           ", " + std::to_string(s.dims[3]) + "], byte strides [" + std::to_string(s.strides[0]) + ", " +
           std::to_string(s.strides[1]) + ", " + std::to_string(s.strides[2]) + "], row step " +
           std::to_string(s.elem[2]);
}

abi::map encode(const Driver& drv, bool bf16, const void* address, const TensorMapShape& s) {
    if (!drv.TensorMapEncodeTiled)
        throw OpError("the CUDA driver (libcuda.so.1) lacks cuTensorMapEncodeTiled, which the warp-specialised "
                      "attention kernel needs; update the NVIDIA driver to one for CUDA 12 or later",
                      ORT_FAIL);
    if (reinterpret_cast<uintptr_t>(address) % 16 || s.strides[0] % 16 || s.strides[1] % 16 || s.strides[2] % 16)
        throw OpError("the warp-specialised attention kernel reads q, k and v with the Tensor Memory Accelerator, "
                      "which needs 16-byte aligned addresses and strides (" +
                      shape_text(s) + "); pass tensors whose head_dim rows are multiples of 8 elements");
    CUtensorMap map;
    const cuuint64_t dims[4] = {s.dims[0], s.dims[1], s.dims[2], s.dims[3]};
    const cuuint64_t strides[3] = {s.strides[0], s.strides[1], s.strides[2]};
    const cuuint32_t box[4] = {s.box[0], s.box[1], s.box[2], s.box[3]};
    const cuuint32_t element_strides[4] = {s.elem[0], s.elem[1], s.elem[2], s.elem[3]};
    // the settings of stofc/runtime/tensor_map.py encode_tiled: 128-byte swizzle (the
    // kernel's smem panels), L2 promotion 128B, out-of-bounds elements read as zero
    const CUresult r = drv.TensorMapEncodeTiled(
        &map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, const_cast<void*>(address),
        dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    drv.check(r, ("cuTensorMapEncodeTiled(" + shape_text(s) + ")").c_str());
    abi::map out;
    static_assert(sizeof(out) == sizeof(map), "a CUtensorMap is 128 bytes");
    std::memcpy(&out, &map, sizeof out);
    return out;
}

}  // namespace

abi::map TensorMapCache::get(const Driver& drv, bool bf16, const void* address, const TensorMapShape& shape) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Entry& e : entries_)
        if (e.bf16 == bf16 && e.address == address && same_shape(e.shape, shape)) return e.map;
    const abi::map map = encode(drv, bf16, address, shape);
    if (entries_.size() >= kCapacity) entries_.erase(entries_.begin());
    entries_.push_back(Entry{bf16, address, shape, map});
    return map;
}

void launch_ws(const Driver& drv, TensorMapCache& maps, const WsLaunch& l, const AttentionLaunchScalars& sc,
               const WsLaunchScalars& wsc) {
    if (wsc.grid == 0) return;  // no work item covers the run (cannot happen for S >= 1)
    WsAttentionArgs a{};
    a.tma_q = maps.get(drv, l.bf16, l.q, wsc.q);
    a.tma_k = maps.get(drv, l.bf16, l.k, wsc.k);
    a.tma_v = maps.get(drv, l.bf16, l.v, wsc.v);
    a.o = l.o;
    a.o_sb = sc.o_sb;
    a.o_ss = sc.o_ss;
    a.o_sh = sc.o_sh;
    a.entry_key = l.entry_key;
    a.entry_part = l.entry_part;
    a.bitmaps = l.bitmaps;
    a.items = l.items;
    a.item_order = l.item_order;
    a.items_head_stride = wsc.items_head_stride;
    a.order_head_stride = wsc.order_head_stride;
    a.kv_len = l.kv_len;
    a.key_bits = l.key_bits;
    a.key_words = sc.key_words;
    a.bias = l.bias;
    a.bias_sb = sc.bias_sb;
    a.bias_sh = sc.bias_sh;
    a.bias_sq = sc.bias_sq;
    a.part_o = l.part_o;
    a.part_ml = l.part_ml;
    a.slots = wsc.slots;
    a.B = sc.B;
    a.H = sc.H;
    a.L = sc.L;
    a.scale = sc.scale;
    a.kv_group = sc.kv_group;
    a.softcap = sc.softcap;
    a.n_work = static_cast<int>(wsc.n_work);
#define STOFC_ABI_ADDR(name, type) static_cast<void*>(&a.name),
    void* args[] = {STOFC_ATTENTION_WS_ABI(STOFC_ABI_ADDR)};
#undef STOFC_ABI_ADDR
    static_assert(sizeof(args) / sizeof(args[0]) == kWsArgCount, "one pointer per ABI row");
    // both kernels wait on their grid dependency (templates/attention/block_ws.cu.j2, pdl.cuh):
    // programmatic dependent launch on sm_90 (cuda_driver.h launch_kernel)
    launch_kernel(drv, l.main, wsc.grid, wsc.threads, l.smem, l.stream, args, true,
                  "cuLaunchKernel(SparseAttention, warp-specialised)");
    if (wsc.combine_grid == 0) return;
    // the split rows' chunks, merged by their log-sum-exp into o (stream order: after the main kernel)
    WsCombineArgs m{};
    m.o = l.o;
    m.o_sb = sc.o_sb;
    m.o_ss = sc.o_ss;
    m.o_sh = sc.o_sh;
    m.combine = l.combine_rows;
    m.combine_head_stride = wsc.combine_head_stride;
    m.part_o = l.part_o;
    m.part_ml = l.part_ml;
    m.slots = wsc.slots;
    m.B = sc.B;
    m.H = sc.H;
    m.L = sc.L;
#define STOFC_ABI_ADDR(name, type) static_cast<void*>(&m.name),
    void* cargs[] = {STOFC_ATTENTION_WS_COMBINE_ABI(STOFC_ABI_ADDR)};
#undef STOFC_ABI_ADDR
    static_assert(sizeof(cargs) / sizeof(cargs[0]) == kWsCombineArgCount, "one pointer per ABI row");
    launch_kernel(drv, l.combine, wsc.combine_grid, kWsCombineThreads, 0, l.stream, cargs, true,
                  "cuLaunchKernel(SparseAttention, warp-specialised combine)");
}

}  // namespace stofc_ort
