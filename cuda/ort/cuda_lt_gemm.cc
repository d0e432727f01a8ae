// stofc ONNX Runtime custom-op library: one node's cuBLASLt GEMMs (see cuda_lt_gemm.h).
#include "cuda_lt_gemm.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "common.h"
#include "cuda_module.h"

namespace stofc_ort {

LtGemm::Context& LtGemm::context(CUcontext ctx, CUstream stream) {
    for (auto& l : contexts_)
        if (l->ctx == ctx) return *l;
    require_not_capturing(stream, "creating the cuBLASLt handle");
    const CublasLt& L = cublas_lt();
    auto l = std::make_unique<Context>();
    l->ctx = ctx;
    ScopedContext scope(driver(), ctx);
    L.check(L.Create(&l->handle), "cublasLtCreate");
    contexts_.push_back(std::move(l));
    return *contexts_.back();
}

LtBound LtGemm::bind(CUcontext ctx, CUstream stream, int64_t M, int64_t N, int64_t K, int dtype, int out_dtype,
                     int epilogue, const void* bias) {
    Context& lt = context(ctx, stream);
    const int64_t rank = algo_.rank_for(M);
    auto& slot = lt.plans[{M, N, K, dtype, out_dtype, epilogue, rank}];
    if (slot) return {lt.handle, slot.get()};
    const CublasLt& L = cublas_lt();
    auto p = std::make_unique<LtPlan>();
    L.check(L.MatmulDescCreate(&p->desc, kLtComputeF32, kCudaR32F), "cublasLtMatmulDescCreate");
    const int32_t opn = kOpN;
    const uint32_t ep = static_cast<uint32_t>(epilogue);
    L.check(L.MatmulDescSetAttribute(p->desc, kLtTransA, &opn, sizeof opn), "cublasLtMatmulDescSetAttribute");
    L.check(L.MatmulDescSetAttribute(p->desc, kLtTransB, &opn, sizeof opn), "cublasLtMatmulDescSetAttribute");
    L.check(L.MatmulDescSetAttribute(p->desc, kLtEpilogue, &ep, sizeof ep), "cublasLtMatmulDescSetAttribute");
    if (bias) {  // as segment_cublas.CublasLt._plan: the bias pointer is set before the heuristic
        L.check(L.MatmulDescSetAttribute(p->desc, kLtBiasPointer, &bias, sizeof bias),
                "cublasLtMatmulDescSetAttribute");
        p->bias = bias;
    }
    // Column-major views: w [K, N] row-major = N x K (ld N); x [M, K] = K x M; y [M, N] = N x M.
    L.check(L.MatrixLayoutCreate(&p->a, dtype, N, K, N), "cublasLtMatrixLayoutCreate");
    L.check(L.MatrixLayoutCreate(&p->b, dtype, K, M, K), "cublasLtMatrixLayoutCreate");
    L.check(L.MatrixLayoutCreate(&p->c, out_dtype, N, M, N), "cublasLtMatrixLayoutCreate");
    LtPref pref = nullptr;
    L.check(L.MatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    const uint64_t max_ws = kLtMaxWorkspace;
    L.check(L.MatmulPreferenceSetAttribute(pref, kLtPrefMaxWorkspace, &max_ws, sizeof max_ws),
            "cublasLtMatmulPreferenceSetAttribute");
    const int requested = static_cast<int>(rank) + 1;
    std::vector<uint64_t> results(kLtHeuristicBytes / 8 * static_cast<size_t>(requested));  // 8-aligned
    int count = 0;
    L.check(L.MatmulAlgoGetHeuristic(lt.handle, p->desc, p->a, p->b, p->c, p->c, pref, requested, results.data(),
                                     &count),
            "cublasLtMatmulAlgoGetHeuristic");
    if (count < 1)
        throw OpError("cuBLASLt has no algorithm for " + std::to_string(M) + "x" + std::to_string(N) + "x" +
                          std::to_string(K) + " epilogue " + std::to_string(epilogue),
                      ORT_FAIL);
    const int chosen = std::min(requested, count) - 1;
    std::memcpy(p->heuristic, reinterpret_cast<const unsigned char*>(results.data()) + chosen * kLtHeuristicBytes,
                kLtHeuristicBytes);
    std::memcpy(&p->workspace, p->heuristic + kLtHeuristicWorkspaceOffset, sizeof(size_t));
    slot = std::move(p);
    return {lt.handle, slot.get()};
}

void LtGemm::matmul(const LtBound& bound, const void* w, const void* x, const void* bias, const void* c, void* d,
                    void* workspace, CUstream stream) const {
    const CublasLt& L = cublas_lt();
    LtPlan& p = *bound.plan;
    if (bias && bias != p.bias) {  // an initializer: set once, not at every run
        L.check(L.MatmulDescSetAttribute(p.desc, kLtBiasPointer, &bias, sizeof bias),
                "cublasLtMatmulDescSetAttribute");
        p.bias = bias;
    }
    const float one = 1.0f, zero = 0.0f;
    L.check(L.Matmul(bound.handle, p.desc, &one, w, p.a, x, p.b, c ? &one : &zero, c ? c : d, p.c, d, p.c,
                     p.heuristic, workspace, p.workspace, stream),
            "cublasLtMatmul");
}

}  // namespace stofc_ort
