// stofc ONNX Runtime custom-op library: one node's cuBLASLt GEMMs (FusedGemm, GatedGemm).
//
// y = x @ w (+ bias by cuBLASLt's epilogue) (+ C with beta = 1) in the row-major
// convention of OPS.md (x [M, K], w [K, N], y [M, N]), fp32 compute. Per CUDA context
// one cuBLASLt handle; per shape (M, N, K, types, epilogue, heuristic rank) the
// descriptors and the algorithm, created at the first run of that shape (never under
// CUDA graph capture). The algorithm is the heuristic's best (result 0), or for an M
// listed in lt_algo_m its result number lt_algo_rank (the tuner's choice; OPS.md).
// Not thread-safe: the node holds its own mutex around bind + matmul.
#ifndef STOFC_ORT_CUDA_LT_GEMM_H
#define STOFC_ORT_CUDA_LT_GEMM_H

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "cublas_lt.h"
#include "cuda_attrs.h"
#include "cuda_driver.h"

namespace stofc_ort {

/// The descriptors and algorithm of one shape.
struct LtPlan {
    LtDesc desc = nullptr;
    LtLayout a = nullptr, b = nullptr, c = nullptr;
    alignas(8) unsigned char heuristic[kLtHeuristicBytes] = {};  // its algo is uint64_t[8]
    size_t workspace = 0;
    const void* bias = nullptr;  // the bias pointer the descriptor holds
};

/// A plan bound to its context's handle: what one run uses.
struct LtBound {
    LtHandle handle = nullptr;
    LtPlan* plan = nullptr;
    size_t workspace() const { return plan->workspace; }
};

class LtGemm {
  public:
    explicit LtGemm(LtAlgoChoice algo) : algo_(std::move(algo)) {}

    /// The plan of one shape in context `ctx` (created at its first use, refused while
    /// `stream` captures a graph). A and B are `dtype`; C and D `out_dtype`; `epilogue`
    /// the cublasLtEpilogue_t; `bias` the bias pointer (set before the heuristic).
    LtBound bind(CUcontext ctx, CUstream stream, int64_t M, int64_t N, int64_t K, int dtype, int out_dtype,
                 int epilogue, const void* bias);

    /// D = x @ w (+ bias) (+ c when given, beta = 1) on `stream`, `workspace` of
    /// bound.workspace() bytes.
    void matmul(const LtBound& bound, const void* w, const void* x, const void* bias, const void* c, void* d,
                void* workspace, CUstream stream) const;

  private:
    struct Context {
        CUcontext ctx = nullptr;
        LtHandle handle = nullptr;
        /// (M, N, K, A/B dtype, C/D dtype, Lt epilogue, heuristic rank) -> plan. The rank
        /// follows from M (lt_algo_m / lt_algo_rank), so each M's plan holds its own algorithm.
        std::map<std::tuple<int64_t, int64_t, int64_t, int, int, int, int64_t>, std::unique_ptr<LtPlan>> plans;
    };
    Context& context(CUcontext ctx, CUstream stream);

    LtAlgoChoice algo_;
    std::vector<std::unique_ptr<Context>> contexts_;
};

}  // namespace stofc_ort

#endif  // STOFC_ORT_CUDA_LT_GEMM_H
