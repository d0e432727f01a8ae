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

#include <cstdint>
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
    CUresult (*FuncGetAttribute)(int*, CUfunction_attribute, CUfunction);
    CUresult (*MemAlloc)(CUdeviceptr*, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
    CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
    /// Optional (CUDA 12+ drivers): nullptr when the driver lacks it; launches then go without
    /// programmatic dependent launch (launch_kernel).
    CUresult (*LaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
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

/// Launches `fn` on `stream` over grid x 1 x 1 blocks of `block` x 1 x 1 threads with `smem`
/// bytes of dynamic shared memory; OpError naming `what` on failure. `waits_on_grid`: the
/// kernel's template keeps cuda/stofc/pdl.cuh's contract (every thread calls pdl_wait() before
/// its first global access that another kernel may race). Such a kernel is launched with
/// programmatic dependent launch (cuLaunchKernelEx with
/// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: its blocks may start while the
/// previous kernel on the stream finishes, and wait in pdl_wait()) when the function's PTX was
/// generated for compute_90 or newer (CU_FUNC_ATTRIBUTE_PTX_VERSION >= 90, asked once per
/// function: below that pdl_wait() compiles to nothing), the driver has cuLaunchKernelEx and
/// $STOFC_NO_PDL is unset or "0" (read once; for A/B measurements). Otherwise cuLaunchKernel.
void launch_kernel(const Driver& d, CUfunction fn, int64_t grid, int64_t block, unsigned smem, CUstream stream,
                   void** args, bool waits_on_grid, const char* what);

/// Whether launch_kernel would launch `fn` with programmatic dependent launch.
bool pdl_launch(const Driver& d, CUfunction fn);

/// Drops what pdl_launch remembers of `fn`: called before its module is unloaded, since a
/// module loaded later may get the same handle for a function compiled otherwise.
void pdl_forget(CUfunction fn);

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
