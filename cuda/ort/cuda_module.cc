// stofc ONNX Runtime custom-op library: CudaModule, Scratch, capture checks (cuda_module.h).
#include "cuda_module.h"

#include <fstream>
#include <iterator>

namespace stofc_ort {

std::vector<char> read_kernel_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f)
        throw OpError("kernel file '" + path + "' cannot be opened; the package is incomplete, rewrite it with "
                      "'stofc compile'",
                      ORT_NO_SUCHFILE);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (bytes.empty()) throw OpError("kernel file '" + path + "' is empty", ORT_INVALID_GRAPH);
    return bytes;
}

CudaModule::CudaModule(std::vector<char> image, std::string label, std::vector<std::string> entries)
    : path_(std::move(label)), entries_(std::move(entries)), image_(std::move(image)) {
    image_.push_back('\0');  // PTX must be NUL-terminated; harmless after a cubin
}

CudaModule::~CudaModule() {
    if (loaded_.empty()) return;
    const Driver& drv = driver();
    for (auto& l : loaded_) {
        for (CUfunction fn : l.fns) pdl_forget(fn);  // a later module may get the same handle
        drv.ModuleUnload(l.module);
    }
}

CUcontext CudaModule::context_of(CUstream stream) {
    const Driver& drv = driver();
    CUcontext ctx = nullptr;
    drv.check(drv.StreamGetCtx(stream, &ctx), "cuStreamGetCtx");
    return ctx;
}

CUfunction CudaModule::function(CUcontext ctx, CUstream stream, int smem, size_t index) {
    const Driver& drv = driver();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& l : loaded_)
        if (l.ctx == ctx) return l.fns.at(index);
    require_not_capturing(stream, ("loading " + entries_[0]).c_str());
    ScopedContext scope(drv, ctx);
    Loaded l{ctx, nullptr, {}};
    drv.check(drv.ModuleLoadData(&l.module, image_.data()), ("cuModuleLoadData(" + path_ + ")").c_str());
    CUresult r = CUDA_SUCCESS;
    std::string failed;
    for (const auto& entry : entries_) {
        CUfunction fn = nullptr;
        r = drv.ModuleGetFunction(&fn, l.module, entry.c_str());
        if (r != CUDA_SUCCESS) {
            failed = entry;
            break;
        }
        l.fns.push_back(fn);
    }
    if (r == CUDA_SUCCESS && smem > 48 * 1024) {
        failed = entries_[0];
        r = drv.FuncSetAttribute(l.fns[0], CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem);
    }
    if (r == CUDA_SUCCESS && carveout_ >= 0) {
        failed = entries_[0];
        r = drv.FuncSetAttribute(l.fns[0], CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, carveout_);
    }
    if (r != CUDA_SUCCESS) {
        drv.ModuleUnload(l.module);
        drv.check(r, ("loading " + failed + " from " + path_).c_str());
    }
    loaded_.push_back(l);
    return l.fns.at(index);
}

std::unique_ptr<CudaModule> load_package_module(const std::string& package_dir, const KernelRef& ref,
                                                const std::vector<std::string>& extra_suffixes) {
    const std::string path = resolve_package_path(package_dir, ref.file);
    std::vector<std::string> entries{ref.entry};
    for (const auto& suffix : extra_suffixes) entries.push_back(ref.entry + suffix);
    return std::make_unique<CudaModule>(read_kernel_file(path), path, std::move(entries));
}

void require_not_capturing(CUstream stream, const char* what) {
    const Driver& drv = driver();
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    drv.check(drv.StreamIsCapturing(stream, &status), "cuStreamIsCapturing");
    if (status != CU_STREAM_CAPTURE_STATUS_NONE)
        throw OpError(std::string(what) +
                          " must happen before CUDA graph capture (it loads modules and uploads constant "
                          "data); run the session once without capture first",
                      ORT_FAIL);
}

int multiprocessor_count(CUcontext ctx) {
    const Driver& drv = driver();
    ScopedContext scope(drv, ctx);
    CUdevice dev = 0;
    int sms = 0;
    drv.check(drv.CtxGetDevice(&dev), "cuCtxGetDevice");
    drv.check(drv.DeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
              "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)");
    return sms;
}

OrtAllocator* ScratchAllocator::get(const Ort::KernelContext& ctx, int device_id) {
    std::lock_guard<std::mutex> lock(mu_);
    if (alloc_ && device_ == device_id) return alloc_;
#ifdef STOFC_CUDA_TWINS_ON_CPU  // unit-test build: "device" memory is host memory
    Ort::MemoryInfo info = Ort::MemoryInfo::CreateCpu(OrtDeviceAllocator, OrtMemTypeDefault);
#else
    Ort::MemoryInfo info("Cuda", OrtDeviceAllocator, device_id, OrtMemTypeDefault);
#endif
    OrtAllocator* fresh = ctx.GetAllocator(*info);
    if (!fresh) throw OpError("ONNX Runtime gave no CUDA allocator for scratch memory", ORT_FAIL);
    if (alloc_) Ort::GetApi().ReleaseAllocator(alloc_);  // another device: not expected in one session
    alloc_ = fresh;
    device_ = device_id;
    return alloc_;
}

ScratchAllocator::~ScratchAllocator() {
    if (alloc_) Ort::GetApi().ReleaseAllocator(alloc_);
}

Scratch::Scratch(OrtAllocator* alloc, size_t bytes) : alloc_(alloc) {
    ptr_ = alloc_->Alloc(alloc_, bytes);
    if (!ptr_) throw OpError("out of GPU memory for " + std::to_string(bytes) + " bytes of scratch", ORT_FAIL);
}

Scratch::~Scratch() {
    if (ptr_) alloc_->Free(alloc_, ptr_);
}

CUcontext StreamContext::of(CUstream stream) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ctx_ && stream_ == stream) return ctx_;
    ctx_ = CudaModule::context_of(stream);
    stream_ = stream;
    return ctx_;
}

}  // namespace stofc_ort
