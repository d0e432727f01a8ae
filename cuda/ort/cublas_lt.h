// stofc ONNX Runtime custom-op library: cuBLASLt, loaded at run time.
//
// Nothing is linked: the first FusedGemm CUDA run dlopen()s cuBLASLt
// ($STOFC_CUBLASLT if set, else "libcublasLt.so.13", then "libcublasLt.so.12";
// ONNX Runtime's CUDA EP has usually loaded one already) and resolves the entry
// points below. The handful of enum values used are cuBLASLt's (stable since 11.x),
// the same numbers stofc/runtime/segment_cublas.py passes through ctypes.
#ifndef STOFC_ORT_CUBLAS_LT_H
#define STOFC_ORT_CUBLAS_LT_H

#include <cstddef>
#include <cstdint>

namespace stofc_ort {

using LtHandle = void*;
using LtDesc = void*;
using LtLayout = void*;
using LtPref = void*;

constexpr int kLtTransA = 3, kLtTransB = 4, kLtEpilogue = 7, kLtBiasPointer = 8;
constexpr int kLtPrefMaxWorkspace = 1;
constexpr int kLtComputeF32 = 68;      // CUBLAS_COMPUTE_32F
constexpr int kCudaR32F = 0, kCudaR16F = 2, kCudaR16BF = 14;
constexpr int kOpN = 0, kOpT = 1;
constexpr size_t kLtHeuristicBytes = 96;  // cublasLtMatmulHeuristicResult_t
constexpr size_t kLtHeuristicWorkspaceOffset = 64;  // its size_t workspaceSize
// as segment_cublas.LT_WORKSPACE (none: its comment gives the measurements)
constexpr uint64_t kLtMaxWorkspace = 0;

struct CublasLt {
    int (*Create)(LtHandle*);
    int (*MatmulDescCreate)(LtDesc*, int, int);
    int (*MatmulDescSetAttribute)(LtDesc, int, const void*, size_t);
    int (*MatrixLayoutCreate)(LtLayout*, int, uint64_t, uint64_t, int64_t);
    int (*MatmulPreferenceCreate)(LtPref*);
    int (*MatmulPreferenceSetAttribute)(LtPref, int, const void*, size_t);
    int (*MatmulAlgoGetHeuristic)(LtHandle, LtDesc, LtLayout, LtLayout, LtLayout, LtLayout, LtPref, int, void*,
                                  int*);
    int (*Matmul)(LtHandle, LtDesc, const void*, const void*, LtLayout, const void*, LtLayout, const void*,
                  const void*, LtLayout, void*, LtLayout, const void*, void*, size_t, void*);

    /// Throws OpError "<what> failed with cuBLAS status N" unless status == 0.
    void check(int status, const char* what) const;
};

/// The process-wide cuBLASLt table; throws OpError when no cuBLASLt can be loaded.
const CublasLt& cublas_lt();

}  // namespace stofc_ort

#endif  // STOFC_ORT_CUBLAS_LT_H
