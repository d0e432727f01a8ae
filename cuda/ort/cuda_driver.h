// stofc ONNX Runtime custom-op library: the CUDA driver API, loaded at run time.
//
// Nothing CUDA is linked: the first CUDA-EP kernel that needs the driver
// dlopen()s "libcuda.so.1" (the GPU machine's own driver) and resolves the few
// entry points below by their versioned ABI names (cuda.h's #defines: cuMemAlloc_v2, ...;
// cuTensorMapEncodeTiled has no versioned name and is optional). Types come from cuda.h of the
// nvidia-cuda-runtime wheel. `check` turns a CUresult into an OpError that names
// the call and the driver's message.
#ifndef STOFC_ORT_CUDA_DRIVER_H
#define STOFC_ORT_CUDA_DRIVER_H

#include <cuda.h>

#include <string>

namespace stofc_ort {

struct Driver {
    CUresult (*GetErrorString)(CUresult, const char**);
    CUresult (*StreamGetCtx)(CUstream, CUcontext*);
    CUresult (*StreamIsCapturing)(CUstream, CUstreamCaptureStatus*);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext*);
    CUresult (*CtxGetDevice)(CUdevice*);
    CUresult (*DeviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
    CUresult (*ModuleLoadData)(CUmodule*, const void*);
    CUresult (*ModuleUnload)(CUmodule);
    CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
    CUresult (*FuncSetAttribute)(CUfunction, CUfunction_attribute, int);
    CUresult (*MemAlloc)(CUdeviceptr*, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
    CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
    /// Host-only (no device call): encodes a TMA tensor map. Optional (CUDA 12+ drivers):
    /// nullptr when the driver lacks it; only the warp-specialised attention kernel needs it.
    CUresult (*TensorMapEncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                     const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                     CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

    /// Throws OpError "<what> failed: <driver message>" unless r == CUDA_SUCCESS.
    void check(CUresult r, const char* what) const;
};

/// The process-wide driver table; throws OpError when libcuda.so.1 or an entry
/// point is missing.
const Driver& driver();

/// Makes `ctx` current for the scope (the stream's context, which is ORT's).
struct ScopedContext {
    const Driver& drv;
    explicit ScopedContext(const Driver& d, CUcontext ctx) : drv(d) { d.check(d.CtxPushCurrent(ctx), "cuCtxPushCurrent"); }
    ~ScopedContext() {
        CUcontext popped;
        drv.CtxPopCurrent(&popped);
    }
    ScopedContext(const ScopedContext&) = delete;
    ScopedContext& operator=(const ScopedContext&) = delete;
};

}  // namespace stofc_ort

#endif  // STOFC_ORT_CUDA_DRIVER_H
