// stofc ONNX Runtime custom-op library: the CUDA twin of GatedGemm.
//
// Mirrors the vendor_glu family's run (stofc/kernels/glu.py, the CuPy executor in
// stofc/runtime/executors_glu.py): cuBLASLt computes t = x @ w (+ bias, its BIAS
// epilogue) in fp32 (CUBLAS_COMPUTE_32F) and writes t [M, 2F] in the element type into
// ORT scratch; the stofc gated-activation kernel named by `epilogue_kernel`
// (templates/gemm/glu.cu.j2, compiled for the node's activation and F, no bias) then
// writes y = act(t[:, :F]) * t[:, F:]. ORT's compute stream, scratch and cuBLASLt
// workspace from ORT's allocator, no device synchronisation; the cuBLASLt handle and
// each shape's descriptors are created at its first run (cuda_lt_gemm.h).
#include <algorithm>
#include <memory>
#include <mutex>
#include <string>

#include "cuda_lt_gemm.h"
#include "cuda_module.h"
#include "ops.h"

namespace stofc_ort {
namespace {

constexpr int kLtDefault = 1, kLtBias = 4;  // cublasLtEpilogue_t

/// Launches the gated-activation kernel: (x, bias, out, M, F), grid ceil(M / rows).
void launch_glu(CUfunction fn, const GluLaunch& g, CUstream stream, const void* x, void* out, int64_t M,
                int64_t F) {
    if (M > 0x7fffffffLL || F > 0x3fffffffLL) throw OpError("tensor too large for the gated-activation kernel");
    const void* bias = x;  // never read: the kernel is compiled without a bias (cuBLASLt added it)
    int m = static_cast<int>(M), f = static_cast<int>(F);
    void* args[] = {&x, &bias, &out, &m, &f};
    const int64_t grid = (M + g.rows - 1) / g.rows;
    const Driver& drv = driver();
    drv.check(drv.LaunchKernel(fn, static_cast<unsigned>(grid), 1, 1, static_cast<unsigned>(g.threads), 1, 1, 0,
                               stream, args, nullptr),
              "cuLaunchKernel(glu)");
}

}  // namespace

struct GatedGemmCuda {
    GatedAttrs attrs;
    GluLaunch glu;
    LtGemm lt;  // cuBLASLt, with lt_algo_m / lt_algo_rank
    std::unique_ptr<CudaModule> module;
    std::mutex mu;
    ScratchAllocator scratch_alloc;  // ORT's allocator, asked once
    StreamContext streams;           // ORT's stream -> its CUDA context

    GatedGemmCuda(const OrtKernelInfo* info, const std::string& dir)
        : attrs(info),
          glu(checked_attrs([&] {
              return parse_glu_launch(OrtAttrSource(info), gated_activation_name(attrs.activation));
          })),
          lt(checked_attrs([&] { return parse_lt_algo_choice(OrtAttrSource(info)); })) {
        module = load_package_module(dir, glu.kernel);
    }

    void compute(OrtKernelContext* context) {
        Ort::KernelContext ctx(context);
        const Input x = get_input(ctx, 0), w = get_input(ctx, 1), bias = get_input(ctx, 2);
        const GatedShapes g = check_gated_gemm(x, w, bias);
        const int64_t K = g.K, F = g.F, M = g.M;
        auto out = ctx.GetOutput(0, g.y);
        if (M == 0 || F == 0) return;
        if (K == 0) throw OpError("input x has K = 0 columns; GatedGemm on CUDA needs K >= 1");
        const bool bf16 = x.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
        if (!bf16 && x.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
            throw OpError("input x is " + type_name(x.type) + "; GatedGemm on CUDA takes float16 or bfloat16");
        if (glu.bf16 != bf16)
            throw OpError("kernel " + glu.kernel.entry + " is compiled for " + (glu.bf16 ? "bfloat16" : "float16") +
                          " but the node's data is " + type_name(x.type) + "; rewrite the package for this dtype");
        if (glu.features != F)
            throw OpError("kernel " + glu.kernel.entry + " is compiled for rows of " + std::to_string(glu.features) +
                          " but w gives F = " + std::to_string(F) + "; rewrite the package");
        if (F % 8) throw OpError("F = " + std::to_string(F) + " is not a multiple of 8 (16-byte vectors)");
        const int dtype = bf16 ? kCudaR16BF : kCudaR16F;

        auto stream = static_cast<CUstream>(ctx.GetGPUComputeStream());
        const CUcontext cuctx = streams.of(stream);
        CUfunction fn = module->function(cuctx, stream);
        std::lock_guard<std::mutex> lock(mu);  // descriptors are shared by this node's runs
        const void* bias_ptr = bias.present() ? bias.value.GetTensorRawData() : nullptr;
        const LtBound plan =
            lt.bind(cuctx, stream, M, 2 * F, K, dtype, dtype, bias_ptr ? kLtBias : kLtDefault, bias_ptr);
        const size_t gemm_bytes = align256(static_cast<size_t>(M * 2 * F) * 2);
        Scratch scratch(scratch_alloc.get(ctx, x.value.GetTensorMemoryInfo().GetDeviceId()),
                        gemm_bytes + std::max<size_t>(plan.workspace(), 256));
        void* t = reinterpret_cast<void*>(scratch.at(0));
        lt.matmul(plan, w.value.GetTensorRawData(), x.value.GetTensorRawData(), bias_ptr, nullptr, t,
                  reinterpret_cast<void*>(scratch.at(gemm_bytes)), stream);
        launch_glu(fn, glu, stream, t, out.GetTensorMutableRawData(), M, F);
    }
};

GatedGemmCuda* make_gated_gemm_cuda(const OrtKernelInfo* info, const std::string& dir) {
    return new GatedGemmCuda(info, dir);
}
OrtStatusPtr compute(GatedGemmCuda* k, OrtKernelContext* c) {
    return guarded("GatedGemm", [&] { k->compute(c); });
}
void destroy(GatedGemmCuda* k) { delete k; }

}  // namespace stofc_ort
