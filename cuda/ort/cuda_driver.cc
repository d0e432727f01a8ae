// stofc ONNX Runtime custom-op library: dlopen of the CUDA driver.
#include "cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

#include "common.h"

namespace stofc_ort {
namespace {

template <typename F>
void resolve(void* lib, const char* name, F& out) {
    void* sym = dlsym(lib, name);
    if (!sym)
        throw OpError(std::string("the CUDA driver (libcuda.so.1) lacks ") + name +
                          "; update the NVIDIA driver",
                      ORT_FAIL);
    out = reinterpret_cast<F>(sym);
}

Driver load() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        throw OpError(std::string("cannot load the CUDA driver libcuda.so.1 (") + dlerror() +
                          "); the CUDA twins of the stofc ops need an NVIDIA GPU and driver",
                      ORT_FAIL);
    Driver d{};
    resolve(lib, "cuGetErrorString", d.GetErrorString);
    resolve(lib, "cuStreamGetCtx", d.StreamGetCtx);
    resolve(lib, "cuStreamIsCapturing", d.StreamIsCapturing);
    resolve(lib, "cuCtxPushCurrent_v2", d.CtxPushCurrent);
    resolve(lib, "cuCtxPopCurrent_v2", d.CtxPopCurrent);
    resolve(lib, "cuCtxGetDevice", d.CtxGetDevice);
    resolve(lib, "cuDeviceGetAttribute", d.DeviceGetAttribute);
    resolve(lib, "cuModuleLoadData", d.ModuleLoadData);
    resolve(lib, "cuModuleUnload", d.ModuleUnload);
    resolve(lib, "cuModuleGetFunction", d.ModuleGetFunction);
    resolve(lib, "cuFuncSetAttribute", d.FuncSetAttribute);
    resolve(lib, "cuMemAlloc_v2", d.MemAlloc);
    resolve(lib, "cuMemFree_v2", d.MemFree);
    resolve(lib, "cuMemcpyHtoDAsync_v2", d.MemcpyHtoDAsync);
    resolve(lib, "cuLaunchKernel", d.LaunchKernel);
    // optional: drivers before CUDA 12 lack it; the ws twin names the driver update needed
    d.TensorMapEncodeTiled = reinterpret_cast<decltype(d.TensorMapEncodeTiled)>(dlsym(lib, "cuTensorMapEncodeTiled"));
    return d;  // the handle stays open for the life of the process
}

}  // namespace

void Driver::check(CUresult r, const char* what) const {
    if (r == CUDA_SUCCESS) return;
    const char* msg = nullptr;
    if (GetErrorString) GetErrorString(r, &msg);
    throw OpError(std::string(what) + " failed: " + (msg ? msg : "unknown CUDA error") + " (CUresult " +
                      std::to_string(static_cast<int>(r)) + ")",
                  ORT_FAIL);
}

const Driver& driver() {
    static std::once_flag once;
    static Driver d{};
    static std::string error;
    std::call_once(once, [] {
        try {
            d = load();
        } catch (const OpError& e) {
            error = e.what();
        }
    });
    if (!error.empty()) throw OpError(error, ORT_FAIL);
    return d;
}

}  // namespace stofc_ort
