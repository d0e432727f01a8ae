// stofc ONNX Runtime custom-op library: dlopen of the CUDA driver.
#include "cuda_driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

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
    resolve(lib, "cuFuncGetAttribute", d.FuncGetAttribute);
    resolve(lib, "cuMemAlloc_v2", d.MemAlloc);
    resolve(lib, "cuMemFree_v2", d.MemFree);
    resolve(lib, "cuMemcpyHtoDAsync_v2", d.MemcpyHtoDAsync);
    resolve(lib, "cuLaunchKernel", d.LaunchKernel);
    // optional: drivers before CUDA 12 lack them; the ws twin names the driver update needed,
    // launch_kernel goes without programmatic dependent launch
    d.LaunchKernelEx = reinterpret_cast<decltype(d.LaunchKernelEx)>(dlsym(lib, "cuLaunchKernelEx"));
    d.TensorMapEncodeTiled = reinterpret_cast<decltype(d.TensorMapEncodeTiled)>(dlsym(lib, "cuTensorMapEncodeTiled"));
    return d;  // the handle stays open for the life of the process
}

bool pdl_disabled() {
    static const bool off = [] {
        const char* v = std::getenv("STOFC_NO_PDL");
        return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
    }();
    return off;
}

/// What pdl_launch learnt per function (PTX_VERSION >= 90), until pdl_forget.
struct PdlCache {
    std::mutex mu;
    std::unordered_map<CUfunction, bool> ptx90;
};

PdlCache& pdl_cache() {
    static PdlCache* cache = new PdlCache;  // never destroyed: modules may unload at exit
    return *cache;
}

}  // namespace

bool pdl_launch(const Driver& d, CUfunction fn) {
    if (d.LaunchKernelEx == nullptr || pdl_disabled()) return false;
    PdlCache& c = pdl_cache();
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.ptx90.find(fn);
    if (it != c.ptx90.end()) return it->second;
    int ptx = 0;
    d.check(d.FuncGetAttribute(&ptx, CU_FUNC_ATTRIBUTE_PTX_VERSION, fn), "cuFuncGetAttribute(PTX_VERSION)");
    return c.ptx90.emplace(fn, ptx >= 90).first->second;
}

void pdl_forget(CUfunction fn) {
    PdlCache& c = pdl_cache();
    std::lock_guard<std::mutex> lock(c.mu);
    c.ptx90.erase(fn);
}

void launch_kernel(const Driver& d, CUfunction fn, int64_t grid, int64_t block, unsigned smem, CUstream stream,
                   void** args, bool waits_on_grid, const char* what) {
    if (grid < 1 || grid > 0x7fffffffLL || block < 1 || block > 1024)
        throw OpError(std::string(what) + ": a launch of " + std::to_string(grid) + " blocks of " +
                      std::to_string(block) + " threads is out of range");
    const auto g = static_cast<unsigned>(grid), b = static_cast<unsigned>(block);
    if (!waits_on_grid || !pdl_launch(d, fn)) {
        d.check(d.LaunchKernel(fn, g, 1, 1, b, 1, 1, smem, stream, args, nullptr), what);
        return;
    }
    CUlaunchAttribute attr{};
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig cfg{};
    cfg.gridDimX = g;
    cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = b;
    cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.sharedMemBytes = smem;
    cfg.hStream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    d.check(d.LaunchKernelEx(&cfg, fn, args, nullptr), what);
}

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
