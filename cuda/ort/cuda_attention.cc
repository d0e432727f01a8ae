// stofc ONNX Runtime custom-op library: the CUDA twin of SparseAttention (kernel_abi 4).
//
// Launches the package's attention kernel with exactly the argument list of
// attention_abi.h on ORT's compute stream. Block- and row-wise kernels
// (STOFC_ATTENTION_ABI = stofc/runtime/attention.py, AttentionOp.bind): grid
// H * B * rows * blocks_per_tile_row (rows = ceil(S/T), or R for a residue-permuted
// plan), block_threads threads, smem_bytes dynamic shared memory. The warp-specialised
// kernel (STOFC_ATTENTION_WS_ABI = stofc/runtime/attention_ws.py, WsLaunchData.bind;
// cuda_attention_ws.cc): a persistent grid over H * B * items of the run's pair rows,
// 256, 384, 512 or 640 threads, tensor maps of q, k and v encoded on the host, then its
// combine kernel when the plan splits rows; a plan of one consumer warpgroup runs three
// blocks an SM (ws_blocks_per_sm), its kernel loaded with the largest shared-memory
// carveout. The device arrays come from the node's `launch_plan` file (launch_plan.h), read
// at session creation and uploaded once per CUDA context at the first run (cuMemAlloc +
// cuMemcpyHtoDAsync on ORT's stream, from host memory this kernel keeps alive). A run
// given key_state (input 5, KeyPrep's output) points kv_len and the key bits into it;
// otherwise it takes them from ORT's allocator and fills them with the embedded key-prep
// kernel (key_prep.cu, cuda_key_prep.cc) on the same stream. The ws workspace (split
// rows' partial results) is ORT scratch too. No device synchronisation; nothing
// allocated per run but ORT scratch; no host-device copy inside a run after the first.
//
// Run-time variants (variant_* attributes): each is a launch like the base (its own
// kernel, plan, threads, blocks per tile row, shared memory), checked the same way at
// session creation; every run launches the first variant eligible for its B and S
// (cuda_attrs.h, select_attention_variant), else the base. The first run in a context
// loads every module and uploads every plan (plans shared by file). Packed QKV (k and
// v omitted): k and v point into q's rows, all three with q's strides (OPS.md).
#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "attention_abi.h"
#include "cuda_attention_ws.h"
#include "cuda_module.h"
#include "launch_plan.h"
#include "ops.h"

namespace stofc_ort {

static_assert(kCudaLaunchAbi == kAttentionKernelAbi, "one kernel_abi for every CUDA twin");

namespace {

/// The plan's arrays in one device allocation of one context: `at[i]` is the byte offset
/// of AttentionPlan::device_arrays()[i].
struct DevicePlan {
    CUcontext ctx = nullptr;
    CUdeviceptr base = 0;
    std::vector<size_t> at;
    const void* ptr(int i, size_t byte_offset = 0) const {
        return reinterpret_cast<const void*>(base + at[static_cast<size_t>(i)] + byte_offset);
    }
};

/// A DevicePlan's addresses in a fixed-size value (a run copies it without allocating).
struct PlanArrays {
    static constexpr size_t kMax = 8;  // kinds 0, 1 upload 7 arrays, kind 2 six
    CUdeviceptr at[kMax] = {};
    PlanArrays() = default;
    explicit PlanArrays(const DevicePlan& p) {
        if (p.at.size() > kMax) throw OpError("launch plan has more device arrays than this library knows", ORT_FAIL);
        for (size_t i = 0; i < p.at.size(); ++i) at[i] = p.base + p.at[i];
    }
    const void* ptr(int i, size_t byte_offset = 0) const {
        return reinterpret_cast<const void*>(at[static_cast<size_t>(i)] + byte_offset);
    }
};

/// One `*.plan.bin` and its uploads (one per CUDA context); shared by the launches
/// (base, variants) that name the same file.
struct PlanSlot {
    std::shared_ptr<const AttentionPlan> plan;
    std::vector<DevicePlan> uploads;
};

/// One launch the node can make: the base (`kernel`, `launch_plan`, ...) or a run-time
/// variant (`variant_*[i]`), with its plan and its module.
struct LaunchUnit {
    AttentionLaunch launch;
    std::shared_ptr<PlanSlot> slot;
    std::unique_ptr<CudaModule> module;
};

/// Runs `fn`; an OpError is prefixed with `attr` ("attribute 'variant_launch_plans[1]': ...")
/// unless attr is empty (the base launch: its messages name their files already).
template <typename Fn>
void naming(const std::string& attr, Fn&& fn) {
    if (attr.empty()) return fn();
    try {
        fn();
    } catch (const OpError& e) {
        throw OpError("attribute '" + attr + "': " + e.what(), e.code);
    }
}

/// "block-wise", "row-wise", "warp-specialised" (messages).
std::string kind_label(KernelKind kind) {
    return kind == KernelKind::kWs ? "warp-specialised" : std::string(kind_name(kind)) + "-wise";
}

/// "name[index]" for variant `index`, "" for the base launch (index < 0).
std::string variant_attr(const char* name, int index) {
    return index < 0 ? std::string() : std::string(name) + "[" + std::to_string(index) + "]";
}

}  // namespace

struct SparseAttentionCuda {
    AttentionAttrs attrs;
    LaunchUnit base;
    std::vector<LaunchUnit> variants;  // attribute order: the first eligible one runs
    std::vector<AttentionLaunch> variant_launches;
    std::mutex mu;
    std::vector<std::pair<CUcontext, int>> prepared;  // contexts where every module and plan is
                                                      // ready, with their GPU's SM count
    TensorMapCache maps;              // ws launches: q, k, v tensor maps by (address, shape)
    ScratchAllocator scratch_alloc;   // ORT's allocator, asked once
    StreamContext streams;            // ORT's stream -> its CUDA context

    /// Everything a run derives from its shape, kept for the shapes seen last (the key: the
    /// stream, B, S, the inputs present, the bias strides, packed QKV): the launch picked,
    /// its scalars, function(s), device plan and scratch layout. A run of a kept shape
    /// derives nothing and takes no lock but this cache's.
    struct ShapeLaunch {
        CUstream stream;
        int64_t B, S, bias_sb, bias_sh;
        bool has_kpm, has_bias, has_key_state, packed;
        int pick;
        AttentionLaunchScalars sc;
        WsLaunchScalars wsc;
        CUcontext cuctx;
        CUfunction fn, combine;
        PlanArrays dp;
        size_t words_at, part_o_at, part_ml_at, scratch_bytes;
        bool same(const AttentionCall& c, CUstream s) const {
            return stream == s && B == c.B && S == c.S && bias_sb == c.bias_sb && bias_sh == c.bias_sh &&
                   has_kpm == c.has_kpm && has_bias == c.has_bias && has_key_state == c.has_key_state &&
                   packed == c.packed;
        }
    };
    static constexpr size_t kShapeCache = 16;
    std::mutex shapes_mu;
    std::vector<ShapeLaunch> shapes;  // most recently derived last

    SparseAttentionCuda(const OrtKernelInfo* info, const std::string& dir) : attrs(info, dir) {
        const OrtAttrSource src(info);
        base.launch = checked_attrs([&] { return parse_attention_launch(src); });
        variant_launches = checked_attrs([&] { return parse_attention_variants(src, base.launch); });
        std::vector<std::pair<std::string, std::shared_ptr<PlanSlot>>> slots;  // by resolved path
        const auto bind = [&](LaunchUnit& u, int index) {
            const int64_t d = u.launch.variant.head_dim;  // the kernel's, from its entry name
            if (d && d != attrs.head_dim)
                throw OpError("attribute " + u.launch.label + " names " + u.launch.kernel.entry +
                                  ", compiled for head_dim " + std::to_string(d) + ", but the node's head_dim is " +
                                  std::to_string(attrs.head_dim) + "; rewrite the package",
                              ORT_INVALID_GRAPH);
            naming(variant_attr("variant_launch_plans", index), [&] {
                const std::string path = resolve_package_path(dir, u.launch.plan_file);
                for (auto& s : slots)
                    if (s.first == path) u.slot = s.second;
                if (!u.slot) {
                    u.slot = std::make_shared<PlanSlot>();
                    u.slot->plan = load_attention_plan(path);
                    slots.emplace_back(path, u.slot);
                }
                check_plan(u, index);
            });
            naming(variant_attr("variant_kernels", index), [&] {
                const bool ws = u.launch.variant.kind == KernelKind::kWs;  // + its combine kernel
                u.module = load_package_module(dir, u.launch.kernel, ws ? std::vector<std::string>{"_combine"}
                                                                        : std::vector<std::string>{});
                // several ws blocks an SM (one consumer warpgroup: three) must share its shared
                // memory: the largest carveout, set when the module is loaded (as the Python
                // runtime's load_kernel does), never per launch
                if (ws && ws_blocks_per_sm(u.slot->plan->ws.consumers) > 1)
                    u.module->set_carveout(CU_SHAREDMEM_CARVEOUT_MAX_SHARED);
            });
        };
        bind(base, -1);
        variants.resize(variant_launches.size());
        for (size_t i = 0; i < variants.size(); ++i) {
            variants[i].launch = variant_launches[i];
            bind(variants[i], static_cast<int>(i));
        }
    }

    /// The plan must be built for the node's mask and the launch's kernel kind.
    void check_plan(const LaunchUnit& u, int index) const {
        const MaskData& m = *attrs.mask;
        const AttentionPlan& p = *u.slot->plan;
        if (p.tile != m.tile || p.seq_len != m.seq_len || p.tile_rows != m.tile_rows ||
            p.num_heads != m.num_heads || m.spec_hash.compare(0, 32, p.spec_hash) != 0)
            throw OpError("launch plan '" + p.path + "' was not built for mask file '" + m.path +
                              "'; rewrite the package with 'stofc compile'",
                          ORT_INVALID_GRAPH);
        if (p.kind != u.launch.variant.kind)
            throw OpError("launch plan '" + p.path + "' is for a " + kind_label(p.kind) + " kernel but " +
                              u.launch.label + " names " + u.launch.kernel.entry + ", a " +
                              kind_label(u.launch.variant.kind) + " kernel; rewrite the package with 'stofc compile'",
                          ORT_INVALID_GRAPH);
        if (p.kind == KernelKind::kRow && p.tile % u.launch.blocks_per_tile_row)
            throw OpError("attribute '" + (index < 0 ? std::string("blocks_per_tile_row")
                                                     : variant_attr("variant_blocks_per_tile_row", index)) +
                              "' = " + std::to_string(u.launch.blocks_per_tile_row) + " does not divide the tile " +
                              std::to_string(p.tile) + "; rewrite the package",
                          ORT_INVALID_GRAPH);
        if (p.kind == KernelKind::kWs && u.launch.block_threads != ws_threads(p.ws.consumers))
            throw OpError("attribute '" + (index < 0 ? std::string("block_threads")
                                                     : variant_attr("variant_block_threads", index)) +
                              "' = " + std::to_string(u.launch.block_threads) + " but launch plan '" + p.path +
                              "' is for blocks of " + std::to_string(p.ws.consumers) +
                              " consumer warpgroups (" + std::to_string(ws_threads(p.ws.consumers)) +
                              " threads); rewrite the package",
                          ORT_INVALID_GRAPH);
    }

    ~SparseAttentionCuda() {
        const auto free_slot = [](PlanSlot& s) {
            if (s.uploads.empty()) return;
            const Driver& drv = driver();
            for (auto& u : s.uploads) {
                ScopedContext scope(drv, u.ctx);
                drv.MemFree(u.base);
            }
            s.uploads.clear();
        };
        free_slot(*base.slot);
        for (auto& v : variants) free_slot(*v.slot);  // a shared slot is freed once (cleared)
    }

    /// `slot`'s plan in `ctx`, uploaded on `stream` the first time (outside graph capture).
    /// Called with `mu` held.
    static DevicePlan device_plan(PlanSlot& slot, CUcontext ctx, CUstream stream) {
        for (auto& u : slot.uploads)
            if (u.ctx == ctx) return u;
        require_not_capturing(stream, "uploading the attention launch plan");
        const Driver& drv = driver();
        const AttentionPlan& p = *slot.plan;
        const std::vector<HostArray> arrays = p.device_arrays();
        DevicePlan u;
        u.ctx = ctx;
        size_t off = 0;
        for (const HostArray& a : arrays) {
            u.at.push_back(off);
            off = align256(off + a.bytes);
        }
        ScopedContext scope(drv, ctx);
        drv.check(drv.MemAlloc(&u.base, off), "cuMemAlloc(attention launch plan)");
        for (size_t i = 0; i < arrays.size(); ++i)
            if (arrays[i].bytes)
                drv.check(drv.MemcpyHtoDAsync(u.base + u.at[i], arrays[i].data, arrays[i].bytes, stream),
                          "cuMemcpyHtoDAsync(plan)");
        slot.uploads.push_back(u);
        return u;
    }

    struct Ready {
        CUfunction fn;
        DevicePlan plan;
        int sm_count;  // the context's GPU's multiprocessors (the ws kernel's persistent grid)
    };

    /// The function and device plan of `unit` in `ctx`. The first run in a context loads
    /// every launch's module, uploads every plan and asks the device's SM count (not while
    /// capturing), so a later run that picks another variant, e.g. under CUDA graph capture,
    /// needs no first-use work.
    Ready ready(LaunchUnit& unit, CUcontext ctx, CUstream stream) {
        std::lock_guard<std::mutex> lock(mu);
        auto at = std::find_if(prepared.begin(), prepared.end(), [&](const auto& p) { return p.first == ctx; });
        if (at == prepared.end()) {
            const auto prepare = [&](LaunchUnit& u) {
                u.module->function(ctx, stream, static_cast<int>(u.launch.smem_bytes));
                device_plan(*u.slot, ctx, stream);
            };
            prepare(base);
            for (auto& v : variants) prepare(v);
            at = prepared.insert(prepared.end(), {ctx, multiprocessor_count(ctx)});
        }
        return {unit.module->function(ctx, stream, static_cast<int>(unit.launch.smem_bytes)),
                device_plan(*unit.slot, ctx, stream), at->second};
    }

    /// What a run of shape `c` on `stream` launches (launch `unit`, variant `pick`), derived
    /// and kept (ShapeLaunch). An empty batch or sequence is returned with B = 0, not kept.
    ShapeLaunch derive(const AttentionCall& c, LaunchUnit& unit, int pick, CUstream stream) {
        const AttentionLaunch& launch = unit.launch;
        const AttentionPlan& p = *unit.slot->plan;
        AttentionLaunchShape shape;
        shape.B = c.B;
        shape.S = c.S;
        shape.H = c.H;
        shape.Hkv = c.Hkv;
        shape.D = c.D;
        shape.softcap = attrs.softcap;
        shape.has_key_bits = c.has_kpm;
        shape.has_bias = c.has_bias;
        shape.bias_sb = c.bias_sb;
        shape.bias_sh = c.bias_sh;
        shape.blocks_per_tile_row = launch.blocks_per_tile_row;
        shape.scale = attrs.scale;
        shape.packed = c.packed;
        ShapeLaunch sl{};
        sl.stream = stream;
        sl.B = c.B;
        sl.S = c.S;
        sl.bias_sb = c.bias_sb;
        sl.bias_sh = c.bias_sh;
        sl.has_kpm = c.has_kpm;
        sl.has_bias = c.has_bias;
        sl.has_key_state = c.has_key_state;
        sl.packed = c.packed;
        sl.pick = pick;
        sl.sc = attention_scalars(p, shape);
        if (c.B == 0 || c.S == 0) {
            sl.B = 0;
            return sl;
        }
        sl.cuctx = streams.of(stream);
        const Ready r = ready(unit, sl.cuctx, stream);
        sl.fn = r.fn;
        sl.dp = PlanArrays(r.plan);
        const bool ws = launch.variant.kind == KernelKind::kWs;
        sl.wsc = ws ? ws_scalars(p, shape, sl.sc, r.sm_count) : WsLaunchScalars();
        if (std::max({ws ? sl.wsc.n_work : sl.sc.grid, sl.wsc.combine_grid}) > 0x7fffffff)
            throw OpError("batch * heads * tile rows (or work items) is too large for one launch");
        sl.combine = ws ? unit.module->function(sl.cuctx, stream, static_cast<int>(launch.smem_bytes), 1) : nullptr;
        sl.words_at = align256(static_cast<size_t>(c.B) * 4);
        size_t bytes = c.has_key_state
                           ? 0
                           : sl.words_at + std::max<size_t>(static_cast<size_t>(c.B) * sl.sc.key_words * 8, 8);
        sl.part_o_at = align256(bytes);
        sl.part_ml_at = align256(sl.part_o_at + sl.wsc.part_o_bytes);
        if (sl.wsc.part_o_bytes) bytes = sl.part_ml_at + sl.wsc.part_ml_bytes;
        sl.scratch_bytes = bytes;
        std::lock_guard<std::mutex> lock(shapes_mu);
        if (shapes.size() >= kShapeCache) shapes.erase(shapes.begin());
        shapes.push_back(sl);
        return sl;
    }

    void compute(OrtKernelContext* context) {
        Ort::KernelContext ctx(context);
        const Input q = get_input(ctx, 0), k = get_input(ctx, 1), v = get_input(ctx, 2);
        const Input kpm = get_input(ctx, 3), bias = get_input(ctx, 4), key_state = get_input(ctx, 5);
        const AttentionCall c = check_attention(attrs, q, k, v, kpm, bias, key_state);
        const int pick = select_attention_variant(variant_launches, c.B, c.S, attrs.mask->tile);
        LaunchUnit& unit = pick < 0 ? base : variants[static_cast<size_t>(pick)];
        const AttentionLaunch& launch = unit.launch;
        const AttentionVariant& var = launch.variant;
        if ((q.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16) != var.bf16)
            throw OpError("kernel " + launch.kernel.entry + " is compiled for " + (var.bf16 ? "bfloat16" : "float16") +
                          " but q has the other type; rewrite the package for this dtype");
        if (c.has_kpm != var.has_key_bits || c.has_bias != var.has_bias)
            throw OpError("kernel " + launch.kernel.entry + " is compiled for key_padding_mask " +
                          (var.has_key_bits ? "present" : "absent") + " and bias " +
                          (var.has_bias ? "present" : "absent") + ", the node's inputs differ; rewrite the package");
        if ((attrs.softcap > 0.0f) != var.softcap)
            throw OpError("kernel " + launch.kernel.entry + " is compiled " + (var.softcap ? "with" : "without") +
                          " logit soft-capping but the node's softcap attribute is " + std::to_string(attrs.softcap) +
                          "; rewrite the package");
        auto out = ctx.GetOutput(0, c.out_shape());
        auto stream = static_cast<CUstream>(ctx.GetGPUComputeStream());
        ShapeLaunch sl{};
        bool hit = false;
        {
            std::lock_guard<std::mutex> lock(shapes_mu);
            for (const ShapeLaunch& kept : shapes)
                if (kept.same(c, stream)) {
                    sl = kept;  // a copy: another run may evict the entry
                    hit = true;
                }
        }
        if (!hit) sl = derive(c, unit, pick, stream);
        if (sl.B == 0) return;  // an empty batch or sequence: nothing to write
        const Driver& drv = driver();
        const AttentionLaunchScalars& sc = sl.sc;
        const WsLaunchScalars& wsc = sl.wsc;
        const bool ws = var.kind == KernelKind::kWs;
        const auto& dp = sl.dp;
        const CUfunction attn = sl.fn;
        const CUcontext cuctx = sl.cuctx;

        // ORT scratch, one allocation: kv_len [B] int32, then (256-aligned) the packed key
        // bits [B, key_words] uint64 unless key_state (KeyPrep's output, size checked by
        // check_attention) holds them; then (ws, split rows) the float32 workspace part_o,
        // part_ml (256-aligned each).
        const int key_words = sc.key_words;
        const size_t words_at = sl.words_at, part_o_at = sl.part_o_at, part_ml_at = sl.part_ml_at;
        std::optional<Scratch> scratch;  // on the stack: no host allocation per run
        if (sl.scratch_bytes)
            scratch.emplace(scratch_alloc.get(ctx, q.value.GetTensorMemoryInfo().GetDeviceId()), sl.scratch_bytes);
        CUdeviceptr kv_len = 0, words = 0;
        if (c.has_key_state) {
            kv_len = reinterpret_cast<CUdeviceptr>(key_state.value.GetTensorRawData());
            words = kv_len + static_cast<CUdeviceptr>(words_at);
        } else {
            kv_len = scratch->at(0);
            words = scratch->at(words_at);
            launch_key_prep(cuctx, stream, c.has_kpm ? kpm.value.GetTensorRawData() : nullptr,
                            c.has_kpm ? check_key_padding_mask(kpm) : 0, static_cast<int>(c.B),
                            static_cast<int>(c.S), key_words, kv_len, words);
        }
        const void* q_data = q.value.GetTensorRawData();
        const char* q_bytes = static_cast<const char*>(q_data);  // packed QKV: K, V inside q's rows
        constexpr long long kElem = 2;                            // float16 / bfloat16
        const void* k_data = c.packed ? q_bytes + sc.k_offset * kElem : k.value.GetTensorRawData();
        const void* v_data = c.packed ? q_bytes + sc.v_offset * kElem : v.value.GetTensorRawData();
        const void* bias_data = c.has_bias ? bias.value.GetTensorRawData() : q_data;  // never read without bias

        if (ws) {
            WsLaunch l{attn,
                       sl.combine,
                       stream,
                       static_cast<unsigned>(launch.smem_bytes),
                       var.bf16,
                       q_data,
                       k_data,
                       v_data,
                       out.GetTensorMutableRawData(),
                       dp.ptr(kWsEntryKey),
                       dp.ptr(kWsEntryPart),
                       dp.ptr(kWsBitmaps),
                       dp.ptr(kWsItems),
                       dp.ptr(kWsOrders, static_cast<size_t>(wsc.order_offset) * 4),
                       dp.ptr(kWsCombine),
                       reinterpret_cast<const void*>(kv_len),
                       reinterpret_cast<const void*>(words),
                       bias_data,
                       wsc.part_o_bytes ? reinterpret_cast<void*>(scratch->at(part_o_at)) : nullptr,
                       wsc.part_o_bytes ? reinterpret_cast<void*>(scratch->at(part_ml_at)) : nullptr};
            launch_ws(drv, maps, l, sc, wsc);
            return;
        }

        // The attention kernel: one AttentionArgs field per row of attention_abi.h.
        AttentionArgs a{};
        a.q = q_data;
        a.k = k_data;
        a.v = v_data;
        a.o = out.GetTensorMutableRawData();
        a.q_sb = sc.q_sb;
        a.q_ss = sc.q_ss;
        a.q_sh = sc.q_sh;
        a.k_sb = a.v_sb = sc.k_sb;
        a.k_ss = a.v_ss = sc.k_ss;
        a.k_sh = a.v_sh = sc.k_sh;
        a.o_sb = sc.o_sb;
        a.o_ss = sc.o_ss;
        a.o_sh = sc.o_sh;
        a.tile_row_ptr = dp.ptr(kPlanRowPtr);
        a.tile_key = dp.ptr(kPlanColIdx);
        a.tile_part = dp.ptr(kPlanPartIdx);
        a.bitmaps = dp.ptr(kPlanBitmaps);
        a.gather_keys = dp.ptr(kPlanGatherKeys);
        a.q_perm = dp.ptr(kPlanQPerm);
        a.permuted = sc.permuted;
        a.fmt_head_stride = sc.fmt_head_stride;
        a.row_order = dp.ptr(kPlanOrders, sc.order_offset * 4);
        a.kv_len = reinterpret_cast<const void*>(kv_len);
        a.key_bits = reinterpret_cast<const void*>(words);
        a.key_words = sc.key_words;
        a.bias = bias_data;
        a.bias_sb = sc.bias_sb;
        a.bias_sh = sc.bias_sh;
        a.bias_sq = sc.bias_sq;
        a.B = sc.B;
        a.H = sc.H;
        a.L = sc.L;
        a.scale = sc.scale;
        a.kv_group = sc.kv_group;
        a.softcap = sc.softcap;
#define STOFC_ABI_ADDR(name, type) static_cast<void*>(&a.name),
        void* args[] = {STOFC_ATTENTION_ABI(STOFC_ABI_ADDR)};
#undef STOFC_ABI_ADDR
        static_assert(sizeof(args) / sizeof(args[0]) == kAttentionArgCount, "one pointer per ABI row");
        drv.check(drv.LaunchKernel(attn, static_cast<unsigned>(sc.grid), 1, 1, static_cast<unsigned>(launch.block_threads),
                                   1, 1, static_cast<unsigned>(launch.smem_bytes), stream, args, nullptr),
                  "cuLaunchKernel(SparseAttention)");
    }
};

SparseAttentionCuda* make_sparse_attention_cuda(const OrtKernelInfo* info, const std::string& dir) {
    return new SparseAttentionCuda(info, dir);
}
OrtStatusPtr compute(SparseAttentionCuda* k, OrtKernelContext* c) {
    return guarded("SparseAttention", [&] { k->compute(c); });
}
void destroy(SparseAttentionCuda* k) { delete k; }

}  // namespace stofc_ort
