// stofc ONNX Runtime custom-op library: what every CUDA twin shares.
//
// CudaModule: a module image (cubin, or PTX) read from the package when the session
// is created and loaded lazily into each CUDA context that runs it (the context of
// ORT's compute stream), with its dynamic shared-memory limit raised above 48 KiB and,
// when asked, its preferred shared-memory carveout set.
// Scratch: per-run device memory from ORT's allocator (KernelContext::GetAllocator),
// returned when Compute ends. OrtAttrSource: node attributes for cuda_attrs.h.
// require_not_capturing: first-use work (module loads, uploads, library handles)
// is refused while ORT's stream is being captured into a CUDA graph; ORT runs a
// model once before capturing it, so that work is always done by then.
#ifndef STOFC_ORT_CUDA_MODULE_H
#define STOFC_ORT_CUDA_MODULE_H

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "cuda_attrs.h"
#include "cuda_driver.h"

namespace stofc_ort {

/// The bytes of a package kernel file (cubin or PTX); OpError when missing or empty.
std::vector<char> read_kernel_file(const std::string& path);

class CudaModule {
  public:
    /// `entries`: the entry points it resolves, the first being the main one (the ws
    /// attention kernel's module also has `<entry>_combine`).
    CudaModule(std::vector<char> image, std::string label, std::vector<std::string> entries);
    CudaModule(std::vector<char> image, std::string label, std::string entry)
        : CudaModule(std::move(image), std::move(label), std::vector<std::string>{std::move(entry)}) {}
    ~CudaModule();
    CudaModule(const CudaModule&) = delete;
    CudaModule& operator=(const CudaModule&) = delete;

    /// The context of `stream` (ORT's compute stream).
    static CUcontext context_of(CUstream stream);

    /// Entry point `index` in `ctx`. The first call in a context loads the module there
    /// (not while `stream` is capturing), resolves every entry, raises the main entry's
    /// dynamic smem limit to `smem` and sets its carveout (set_carveout); later calls only
    /// look the function up (no driver call: safe under CUDA graph capture).
    CUfunction function(CUcontext ctx, CUstream stream, int smem = 0, size_t index = 0);

    /// The main entry's CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (percent of the
    /// SM's unified L1 / shared memory; CU_SHAREDMEM_CARVEOUT_MAX_SHARED = 100), set once per
    /// context when the module is loaded there; -1 (the default) leaves the driver's choice.
    /// Call before the first function(): a kernel of which several blocks must share an
    /// SM's shared memory asks for the largest carveout (the default may give less).
    void set_carveout(int percent) { carveout_ = percent; }

  private:
    struct Loaded {
        CUcontext ctx;
        CUmodule module;
        std::vector<CUfunction> fns;
    };
    std::string path_;
    std::vector<std::string> entries_;
    std::vector<char> image_;
    int carveout_ = -1;
    std::mutex mu_;
    std::vector<Loaded> loaded_;
};

/// The package module named by a FILE:ENTRY reference, resolving ENTRY and then ENTRY +
/// each of `extra_suffixes` (e.g. "_combine").
std::unique_ptr<CudaModule> load_package_module(const std::string& package_dir, const KernelRef& ref,
                                                const std::vector<std::string>& extra_suffixes = {});

/// Throws OpError when `stream` is capturing a CUDA graph: `what` (first-use work)
/// must happen in an ordinary run first.
void require_not_capturing(CUstream stream, const char* what);

/// The SM count of `ctx`'s device (a driver query: callers keep it per context).
int multiprocessor_count(CUcontext ctx);

/// A kernel's handle on ORT's device allocator, asked of the kernel context once and kept
/// with the kernel (KernelContext::GetAllocator wraps the session's allocator in a new
/// host object at every call; the session's allocator outlives its kernels), so a run's
/// scratch costs one arena Alloc and Free and no host allocation. Thread-safe.
class ScratchAllocator {
  public:
    ScratchAllocator() = default;
    ~ScratchAllocator();
    ScratchAllocator(const ScratchAllocator&) = delete;
    ScratchAllocator& operator=(const ScratchAllocator&) = delete;
    /// ORT's allocator for `device_id` (the device of the kernel's tensors).
    OrtAllocator* get(const Ort::KernelContext& ctx, int device_id);

  private:
    std::mutex mu_;
    OrtAllocator* alloc_ = nullptr;
    int device_ = -1;
};

/// One run's scratch from ORT's allocator (stream-ordered like ORT's own kernels'), returned
/// when the run's Compute ends.
class Scratch {
  public:
    Scratch(OrtAllocator* alloc, size_t bytes);
    ~Scratch();
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    CUdeviceptr at(size_t offset) const { return reinterpret_cast<CUdeviceptr>(ptr_) + offset; }

  private:
    OrtAllocator* alloc_ = nullptr;
    void* ptr_ = nullptr;
};

/// The context of ORT's compute stream, asked of the driver once per stream: a kernel
/// keeps the last (stream, context) pair (a session's streams all live in the context of
/// its one device), so a steady-state run makes no cuStreamGetCtx call.
class StreamContext {
  public:
    CUcontext of(CUstream stream);

  private:
    std::mutex mu_;
    CUstream stream_ = nullptr;
    CUcontext ctx_ = nullptr;
};

inline size_t align256(size_t x) { return (x + 255) & ~static_cast<size_t>(255); }

/// Launches the embedded key-prep kernel (key_prep.cu) on `stream`: grid B, 128 threads,
/// kv_len int32 [B] and the key bits uint64 [B, key_words] from key_padding_mask `kpm`
/// (kpm_type 0 none, 1 int64, 2 int32, 3 bool). Loads its module in `ctx` on first use
/// (refused under CUDA graph capture). cuda_key_prep.cc.
void launch_key_prep(CUcontext ctx, CUstream stream, const void* kpm, int kpm_type, int B, int S, int key_words,
                     CUdeviceptr kv_len, CUdeviceptr words);

/// Node attributes through ORT's kernel info.
struct OrtAttrSource : AttrSource {
    const OrtKernelInfo* info;
    explicit OrtAttrSource(const OrtKernelInfo* i) : info(i) {}
    bool get_int(const char* name, int64_t& out) const override { return try_attr(info, name, out); }
    bool get_string(const char* name, std::string& out) const override { return try_attr(info, name, out); }
    bool get_ints(const char* name, std::vector<int64_t>& out) const override { return try_attr(info, name, out); }
};

/// Runs `fn`, turning an AttrError into an OpError (a session-creation error).
template <typename Fn>
auto checked_attrs(Fn&& fn) -> decltype(fn()) {
    try {
        return fn();
    } catch (const AttrError& e) {
        throw OpError(e.what(), ORT_INVALID_GRAPH);
    }
}

}  // namespace stofc_ort

#endif  // STOFC_ORT_CUDA_MODULE_H
