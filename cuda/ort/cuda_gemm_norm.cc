// stofc ONNX Runtime custom-op library: the CUDA twins of FusedGemm and AddLayerNorm.
//
// FusedGemm mirrors SegmentRunner._compile_vendor / _run_vendor with cuBLASLt
// (stofc/runtime/segments.py, segment_cublas.py): cuBLASLt computes x @ w in fp32
// (CUBLAS_COMPUTE_32F) with the epilogue it can fold (BIAS; GELU_BIAS / GELU for the
// tanh GELU without a residual; the residual as C with beta = 1 when nothing is
// applied after it), writing the GEMM result into ORT
// scratch; the stofc Add+Norm kernel named by `epilogue_kernel` (compiled for
// exactly the rest: the activation, then the residual) then writes y. When nothing
// is left (no activation), cuBLASLt writes y directly. Difference from the Python
// path: w is [K, N] here (OPS.md), so the A operand is "N" with ld N where Python
// passes its [N, K] copy transposed; the product is the same.
//
// AddLayerNorm launches the stofc Add+Norm kernel named by `epilogue_kernel`
// (compiled for: residual present, LayerNorm/RMSNorm, beta present, sum output,
// and a float x / float gamma-beta: entry "..._f32in_f32p_...", bf16 packages).
// bf16 packages' pre-LN FusedGemm has a float bias: cuBLASLt writes y = x@w + bias
// in float (Ctype = Dtype = CUDA_R_32F, A/B bf16, CUBLAS_COMPUTE_32F), no residual.
// FusedGemm with hopper_gemm (OPS.md; stofc.kernels.gemm_ws): a run with M >= hopper_gemm_min_m
// rows, 16-byte aligned operands and K, N multiples of 8 launches that kernel instead (one
// pass: act(x @ w + bias), w read as stored, x and w through TMA tensor maps kept per
// address and shape); other runs take the cuBLASLt path above.
// Both: ORT's compute stream, scratch and cuBLASLt workspace from ORT's allocator,
// no device synchronisation; the cuBLASLt handle (one per context) and each
// shape's descriptors and algorithm are created at the first run of that shape
// (cuda_lt_gemm.h, shared with GatedGemm). The algorithm is the heuristic's best
// (result 0), or for an M listed in lt_algo_m its result number lt_algo_rank (the
// tuner's choice; OPS.md).
#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

#include "cublas_lt.h"
#include "cuda_attention_ws.h"
#include "cuda_lt_gemm.h"
#include "cuda_module.h"
#include "ops.h"

namespace stofc_ort {
namespace {

const char* act_name(Activation a) {
    return a == Activation::kGeluErf ? "gelu_erf" : a == Activation::kGeluTanh ? "gelu_tanh" : "none";
}

/// Launches the stofc Add+Norm kernel (templates/norm/add_norm.cu.j2) on `stream`:
/// (x, bias, residual, gamma, beta, out, pre_norm, M, N, eps), grid ceil(M / rows).
void launch_add_norm(CUfunction fn, const EpilogueLaunch& e, CUstream stream, const void* x, const void* residual,
                     const void* gamma, const void* beta, void* out, void* pre, int64_t M, int64_t N, float eps) {
    if (M > 0x7fffffffLL || N > 0x7fffffffLL) throw OpError("tensor too large for the Add+Norm kernel");
    if (N % 8) throw OpError("the row width " + std::to_string(N) + " is not a multiple of 8 (16-byte vectors)");
    const void* dummy = x;  // never read: the kernel is compiled without the absent operands
    const void* bias = dummy;
    residual = residual ? residual : dummy;
    gamma = gamma ? gamma : dummy;
    beta = beta ? beta : dummy;
    void* pre_ptr = pre ? pre : out;
    int m = static_cast<int>(M), n = static_cast<int>(N);
    void* args[] = {&x, &bias, &residual, &gamma, &beta, &out, &pre_ptr, &m, &n, &eps};
    const int64_t grid = (M + e.rows - 1) / e.rows;
    // the Add+Norm template waits on its grid dependency (pdl.cuh): PDL on sm_90
    launch_kernel(driver(), fn, grid, e.threads, 0, stream, args, true, "cuLaunchKernel(add_norm)");
}

/// A TMA map of a row-major [rows, cols] 16-bit matrix in 64 x 64 boxes (rank 4, unit outer
/// extents: the kernel's tma_load_4d; stofc/runtime/gemm_ws.py encodes the same).
TensorMapShape matrix_map(int64_t rows, int64_t cols) {
    TensorMapShape m;
    const uint64_t pitch = static_cast<uint64_t>(cols) * 2;
    m.dims[0] = static_cast<uint64_t>(cols);
    m.dims[1] = static_cast<uint64_t>(rows);
    m.dims[2] = m.dims[3] = 1;
    m.strides[0] = pitch;
    m.strides[1] = m.strides[2] = pitch * static_cast<uint64_t>(rows);
    m.box[0] = m.box[1] = 64;
    m.box[2] = m.box[3] = 1;
    return m;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

std::string dtype_mismatch(const EpilogueLaunch& e) {
    return "kernel " + e.kernel.entry + " is compiled for " + (e.bf16 ? "bfloat16" : "float16") +
           " but the node's data has the other type; rewrite the package for this dtype";
}

}  // namespace

struct FusedGemmCuda {
    GemmAttrs attrs;
    EpilogueLaunch epi;
    LtGemm lt;  // cuBLASLt, with lt_algo_m / lt_algo_rank: which heuristic result each M uses
    HopperGemmLaunch hopper;  // the one-pass Hopper GEMM for runs of >= hopper.min_m rows
    std::unique_ptr<CudaModule> module, hopper_module;
    std::mutex mu;
    ScratchAllocator scratch_alloc;  // ORT's allocator, asked once
    StreamContext streams;           // ORT's stream -> its CUDA context
    TensorMapCache maps;             // the Hopper GEMM's x and w maps
    std::vector<std::pair<CUcontext, int>> sm_counts;  // SMs of each context's device

    FusedGemmCuda(const OrtKernelInfo* info, const std::string& dir)
        : attrs(info),
          epi(checked_attrs([&] { return parse_epilogue_launch(OrtAttrSource(info), "FusedGemm"); })),
          lt(checked_attrs([&] { return parse_lt_algo_choice(OrtAttrSource(info)); })),
          hopper(checked_attrs([&] { return parse_hopper_gemm(OrtAttrSource(info)); })) {
        const std::string act = act_name(attrs.activation);
        // Without an epilogue kernel only cuBLASLt can apply the activation: the tanh GELU
        // (split_fused_gemm; every run checks the split against its inputs).
        if (epi.present ? epi.tag.act != act : act != "none" && act != "gelu_tanh")
            throw OpError("attribute epilogue='" + (epi.present ? epi.tag.str() : std::string("")) +
                              "' does not apply activation '" + act + "'; rewrite the package",
                          ORT_INVALID_GRAPH);
        if (epi.present && (epi.x_fp32 || epi.params_fp32))
            throw OpError("attribute epilogue_kernel names " + epi.kernel.entry +
                              ", an Add+Norm kernel for float inputs; FusedGemm's epilogue reads its own "
                              "GEMM result in the input type; rewrite the package",
                          ORT_INVALID_GRAPH);
        if (epi.present) module = load_package_module(dir, epi.kernel);
        if (hopper.present) {
            if (hopper.act != act)
                throw OpError("attribute hopper_gemm names " + hopper.kernel.entry + ", compiled for activation '" +
                                  hopper.act + "', but the node applies '" + act + "'; rewrite the package",
                              ORT_INVALID_GRAPH);
            hopper_module = load_package_module(dir, hopper.kernel);
        }
    }

    /// SMs of `ctx`'s device (asked once per context; call with `mu` held).
    int sm_count(CUcontext ctx) {
        for (const auto& e : sm_counts)
            if (e.first == ctx) return e.second;
        sm_counts.emplace_back(ctx, multiprocessor_count(ctx));
        return sm_counts.back().second;
    }

    /// Whether this run takes the Hopper GEMM: enough rows, a 16-bit output, aligned
    /// operands (the TMA's and the 16-byte stores' needs); a kernel that does not fit the
    /// node (dtype, bias, a residual) is an error, not a fallback.
    bool use_hopper(int64_t M, int64_t N, int64_t K, bool bf16, bool f32_out, const Input& x, const Input& w,
                    const Input& bias, const Input& res, const void* y) const {
        if (!hopper.present || M < hopper.min_m || f32_out) return false;
        if (hopper.bf16 != bf16 || hopper.bias != bias.present() || res.present())
            throw OpError("kernel " + hopper.kernel.entry + " (attribute hopper_gemm) is compiled for " +
                          (hopper.bf16 ? "bfloat16" : "float16") + (hopper.bias ? " with" : " without") +
                          " a bias and no residual, which is not this node's inputs; rewrite the package");
        if (M > 0x7fffffffLL || N % 8 || K % 8 || N < 64 || K < 64) return false;  // twin_choice's shapes
        return aligned16(x.value.GetTensorRawData()) && aligned16(w.value.GetTensorRawData()) && aligned16(y) &&
               (!bias.present() || aligned16(bias.value.GetTensorRawData()));
    }

    void launch_hopper(CUfunction fn, CUcontext ctx, CUstream stream, bool bf16, int64_t M, int64_t N, int64_t K,
                       const void* x, const void* w, const void* bias, void* y) {
        const Driver& drv = driver();
        const int sms = sm_count(ctx);
        abi::map xm = maps.get(drv, bf16, x, matrix_map(M, K));
        abi::map wm = maps.get(drv, bf16, w, matrix_map(K, N));
        const void* b = bias ? bias : y;  // never read: the kernel is compiled without a bias
        int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
        void* args[] = {&xm, &wm, &b, &y, &m, &n, &k};
        const int64_t grid = std::min<int64_t>(hopper.tiles(M, N), sms);
        launch_kernel(drv, fn, grid, HopperGemmLaunch::kThreads, static_cast<unsigned>(hopper.smem()), stream, args,
                      true, "cuLaunchKernel(gemm_ws)");  // waits on its grid dependency (pdl.cuh)
    }

    void compute(OrtKernelContext* context) {
        Ort::KernelContext ctx(context);
        const Input x = get_input(ctx, 0), w = get_input(ctx, 1), bias = get_input(ctx, 2), res = get_input(ctx, 3);
        const GemmShapes g = check_fused_gemm(x, w, bias, res);
        const bool f32_out = check_fused_gemm_types(x, w, bias, res, attrs.activation != Activation::kNone) ==
                             ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
        const int64_t K = g.K, N = g.N, M = g.M;
        const std::vector<int64_t>& yshape = g.y;
        const GemmSplit split = checked_attrs([&] {
            GemmSplit s = split_fused_gemm(bias.present(), act_name(attrs.activation), res.present(),
                                           attrs.residual_after_activation);
            check_epilogue_matches(epi, s.rest, "FusedGemm");
            return s;
        });
        auto out = ctx.GetOutput(0, yshape);
        if (M == 0 || N == 0) return;
        if (K == 0) throw OpError("input x has K = 0 columns; FusedGemm on CUDA needs K >= 1");
        const bool bf16 = x.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
        if (epi.present && epi.bf16 != bf16) throw OpError(dtype_mismatch(epi));
        const int dtype = bf16 ? kCudaR16BF : kCudaR16F;
        const size_t elem = 2;  // the scratch GEMM result (never with a float y: nothing follows it)

        auto stream = static_cast<CUstream>(ctx.GetGPUComputeStream());
        const CUcontext cuctx = streams.of(stream);
        // both modules at every run, so the first run (whatever its M) loads them outside any
        // CUDA graph capture, as the attention twin prepares all its variants
        CUfunction fn = module ? module->function(cuctx, stream) : nullptr;
        CUfunction hopper_fn =
            hopper_module ? hopper_module->function(cuctx, stream, static_cast<int>(hopper.smem())) : nullptr;
        std::lock_guard<std::mutex> lock(mu);  // descriptors are shared by this node's runs
        const void* bias_ptr = bias.present() ? bias.value.GetTensorRawData() : nullptr;
        if (use_hopper(M, N, K, bf16, f32_out, x, w, bias, res, out.GetTensorMutableRawData())) {
            launch_hopper(hopper_fn, cuctx, stream, bf16, M, N, K, x.value.GetTensorRawData(),
                          w.value.GetTensorRawData(), bias_ptr, out.GetTensorMutableRawData());
            return;
        }
        const LtBound plan = lt.bind(cuctx, stream, M, N, K, dtype, f32_out ? kCudaR32F : dtype, split.lt_epilogue,
                                     bias_ptr);
        const bool direct = split.rest_is_identity();
        const size_t gemm_bytes = direct ? 0 : align256(static_cast<size_t>(M * N) * elem);
        Scratch scratch(scratch_alloc.get(ctx, x.value.GetTensorMemoryInfo().GetDeviceId()),
                        gemm_bytes + std::max<size_t>(plan.workspace(), 256));
        void* y = out.GetTensorMutableRawData();
        void* gemm_out = direct ? y : reinterpret_cast<void*>(scratch.at(0));
        void* workspace = reinterpret_cast<void*>(scratch.at(gemm_bytes));
        lt.matmul(plan, w.value.GetTensorRawData(), x.value.GetTensorRawData(), bias_ptr,
                  split.lt_residual ? res.value.GetTensorRawData() : nullptr, gemm_out, workspace, stream);
        if (direct) return;
        launch_add_norm(fn, epi, stream, gemm_out, split.rest.residual ? res.value.GetTensorRawData() : nullptr,
                        nullptr, nullptr, y, nullptr, M, N, 0.0f);
    }
};

struct AddLayerNormCuda {
    NormAttrs attrs;
    EpilogueLaunch epi;
    std::unique_ptr<CudaModule> module;
    StreamContext streams;  // ORT's stream -> its CUDA context

    AddLayerNormCuda(const OrtKernelInfo* info, const std::string& dir)
        : attrs(info),
          epi(checked_attrs([&] { return parse_epilogue_launch(OrtAttrSource(info), "AddLayerNorm"); })) {
        if (!epi.present || epi.tag.norm != (attrs.rms ? "rmsnorm" : "layernorm"))
            throw OpError(std::string("attribute epilogue_kernel must name an Add+Norm kernel compiled for ") +
                              (attrs.rms ? "RMSNorm" : "LayerNorm") + "; rewrite the package",
                          ORT_INVALID_GRAPH);
        module = load_package_module(dir, epi.kernel);
    }

    void compute(OrtKernelContext* context) {
        Ort::KernelContext ctx(context);
        const Input x = get_input(ctx, 0), res = get_input(ctx, 1), gamma = get_input(ctx, 2), beta = get_input(ctx, 3);
        const NormShapes shapes = check_add_layer_norm(x, res, gamma, beta);
        const ONNXTensorElementDataType t =
            epi.bf16 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
        auto out = ctx.GetOutput(0, x.shape);
        if (out.GetTensorTypeAndShapeInfo().GetElementType() != t) throw OpError(dtype_mismatch(epi));
        check_add_layer_norm_types(t, x, res, gamma, beta);
        const bool x_fp32 = x.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
        const bool params_fp32 = gamma.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
        if (epi.x_fp32 != x_fp32 || epi.params_fp32 != params_fp32)
            throw OpError("kernel " + epi.kernel.entry + " is compiled for x " + (epi.x_fp32 ? "float" : type_name(t)) +
                          " and gamma/beta " + (epi.params_fp32 ? "float" : type_name(t)) + " but the node gives x " +
                          type_name(x.type) + " and gamma " + type_name(gamma.type) + "; rewrite the package");
        const int64_t M = shapes.M, C = shapes.C;
        void* sum = nullptr;
        if (ctx.GetOutputCount() > 1) {
            auto s = ctx.GetOutput(1, x.shape);
            if (static_cast<OrtValue*>(s) != nullptr) sum = s.GetTensorMutableRawData();
        }
        checked_attrs([&] {
            check_epilogue_matches(epi, add_layer_norm_epilogue(res.present(), attrs.rms, beta.present(), sum != nullptr),
                                   "AddLayerNorm");
            return 0;
        });
        if (M == 0 || C == 0) return;
        auto stream = static_cast<CUstream>(ctx.GetGPUComputeStream());
        CUfunction fn = module->function(streams.of(stream), stream);
        launch_add_norm(fn, epi, stream, x.value.GetTensorRawData(), res.present() ? res.value.GetTensorRawData() : nullptr,
                        gamma.value.GetTensorRawData(), beta.present() ? beta.value.GetTensorRawData() : nullptr,
                        out.GetTensorMutableRawData(), sum, M, C, attrs.epsilon);
    }
};

FusedGemmCuda* make_fused_gemm_cuda(const OrtKernelInfo* info, const std::string& dir) {
    return new FusedGemmCuda(info, dir);
}
AddLayerNormCuda* make_add_layer_norm_cuda(const OrtKernelInfo* info, const std::string& dir) {
    return new AddLayerNormCuda(info, dir);
}
OrtStatusPtr compute(FusedGemmCuda* k, OrtKernelContext* c) {
    return guarded("FusedGemm", [&] { k->compute(c); });
}
OrtStatusPtr compute(AddLayerNormCuda* k, OrtKernelContext* c) {
    return guarded("AddLayerNorm", [&] { k->compute(c); });
}
void destroy(FusedGemmCuda* k) { delete k; }
void destroy(AddLayerNormCuda* k) { delete k; }

}  // namespace stofc_ort
