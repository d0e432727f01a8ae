// stofc ONNX Runtime custom-op library: RegisterCustomOps, the one exported symbol.
//
// Loaded with SessionOptions.register_custom_ops_library(".../libstofc_ort.so").
// Each call creates the ai.stofc domain with every op twice (CPU twin for float,
// float16 and bfloat16, CUDA twin for float16 and bfloat16 (GatedGemm, Rotary and EmbedLayerNorm too), plus the bfloat16
// packages' float pre-LN forms of FusedGemm and AddLayerNorm on both; KeyPrep once
// per provider, its output being uint8) bound to the package directory:
//   1. the session config entry "stofc.package_dir" when it is set (set it
//      BEFORE register_custom_ops_library), else
//   2. the directory holding this library file (a package ships its own copy,
//      so loading DIR/libstofc_ort.so binds DIR).
// Op objects and domains live until the process exits (ORT keeps raw pointers).
#include <dlfcn.h>

#include <memory>
#include <string>
#include <vector>

#include "ops.h"

namespace stofc_ort {
namespace {

std::string library_dir() {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&library_dir), &info) == 0 || !info.dli_fname) return "";
    std::string path = info.dli_fname;
    const auto slash = path.rfind('/');
    return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

std::string config_entry(const OrtApi& api, const OrtSessionOptions* options, const char* key) {
    int has = 0;
    OrtStatus* st = api.HasSessionConfigEntry(options, key, &has);
    if (st) {
        api.ReleaseStatus(st);
        return "";
    }
    if (!has) return "";
    size_t size = 0;
    st = api.GetSessionConfigEntry(options, key, nullptr, &size);
    if (st) api.ReleaseStatus(st);
    std::string value(size, '\0');
    st = api.GetSessionConfigEntry(options, key, &value[0], &size);
    if (st) {
        api.ReleaseStatus(st);
        return "";
    }
    value.resize(size > 0 ? size - 1 : 0);
    return value;
}

template <typename K>
using Factory = K* (*)(const OrtKernelInfo*, const std::string&);

template <typename K>
void add(std::vector<std::unique_ptr<OrtCustomOp>>& ops, Ort::CustomOpDomain& domain, const Registration& r,
         const char* ep, const std::string& dir, Factory<K> make) {
    auto op = std::make_unique<StofcOp<K, Factory<K>>>(*r.sig, r.elem, ep, dir, make, r.float_inputs,
                                                       r.float_outputs, r.any_inputs);
    domain.Add(op.get());
    ops.push_back(std::move(op));
}

template <typename K>
K* make_cpu(const OrtKernelInfo* info, const std::string& dir) {
    if constexpr (std::is_constructible<K, const OrtKernelInfo*, const std::string&>::value)
        return new K(info, dir);
    else
        return new K(info);
}

using AttnCuda = CudaKernelHandle<SparseAttentionCuda>;
using GemmCuda = CudaKernelHandle<FusedGemmCuda>;
using NormCuda = CudaKernelHandle<AddLayerNormCuda>;
using KeyPrepCudaK = CudaKernelHandle<KeyPrepCuda>;
using GatedCuda = CudaKernelHandle<GatedGemmCuda>;
using RotaryCudaK = CudaKernelHandle<RotaryCuda>;
using EmbedCuda = CudaKernelHandle<EmbedLayerNormCuda>;
EmbedCuda* make_embed_cuda(const OrtKernelInfo* i, const std::string& d) {
    return new EmbedCuda(make_embed_layer_norm_cuda(i, d));
}
RotaryCudaK* make_rotary_cuda_k(const OrtKernelInfo* i, const std::string& d) {
    return new RotaryCudaK(make_rotary_cuda(i, d));
}
GatedCuda* make_gated_cuda(const OrtKernelInfo* i, const std::string& d) {
    return new GatedCuda(make_gated_gemm_cuda(i, d));
}
AttnCuda* make_attn_cuda(const OrtKernelInfo* i, const std::string& d) {
    return new AttnCuda(make_sparse_attention_cuda(i, d));
}
GemmCuda* make_gemm_cuda(const OrtKernelInfo* i, const std::string& d) { return new GemmCuda(make_fused_gemm_cuda(i, d)); }
NormCuda* make_norm_cuda(const OrtKernelInfo* i, const std::string& d) {
    return new NormCuda(make_add_layer_norm_cuda(i, d));
}
KeyPrepCudaK* make_key_prep_cuda_k(const OrtKernelInfo* i, const std::string& d) {
    return new KeyPrepCudaK(make_key_prep_cuda(i, d));
}

template <typename T>
void add_cpu(std::vector<std::unique_ptr<OrtCustomOp>>& ops, Ort::CustomOpDomain& domain, const Registration& r,
             const std::string& dir) {
    if (r.sig == &kSparseAttentionSig)
        add<SparseAttentionCpu<T>>(ops, domain, r, nullptr, dir, &make_cpu<SparseAttentionCpu<T>>);
    else if (r.sig == &kFusedGemmSig)
        add<FusedGemmCpu<T>>(ops, domain, r, nullptr, dir, &make_cpu<FusedGemmCpu<T>>);
    else if (r.sig == &kGatedGemmSig)
        add<GatedGemmCpu<T>>(ops, domain, r, nullptr, dir, &make_cpu<GatedGemmCpu<T>>);
    else if (r.sig == &kRotarySig)
        add<RotaryCpu<T>>(ops, domain, r, nullptr, dir, &make_cpu<RotaryCpu<T>>);
    else if (r.sig == &kEmbedLayerNormSig)
        add<EmbedLayerNormCpu<T>>(ops, domain, r, nullptr, dir, &make_cpu<EmbedLayerNormCpu<T>>);
    else
        add<AddLayerNormCpu<T>>(ops, domain, r, nullptr, dir, &make_cpu<AddLayerNormCpu<T>>);
}

void add_registration(std::vector<std::unique_ptr<OrtCustomOp>>& ops, Ort::CustomOpDomain& domain,
                      const Registration& r, const std::string& dir) {
#ifdef STOFC_CUDA_TWINS_ON_CPU
    // Unit-test build only (tests/unit/test_ortlib_fake_gpu.py): the CUDA twins take
    // the CPU twins' place on the CPU EP and drive a fake driver (cuda/ort/tests/fake_cuda.cc).
    if (!r.cuda) return;
    const char* kCudaEp = nullptr;
#endif
    if (r.sig == &kKeyPrepSig) {  // one registration per provider; output uint8, any mask type
        if (r.cuda) add<KeyPrepCudaK>(ops, domain, r, kCudaEp, dir, &make_key_prep_cuda_k);
        else add<KeyPrepCpu>(ops, domain, r, nullptr, dir, &make_cpu<KeyPrepCpu>);
    } else if (r.cuda) {
        if (r.sig == &kSparseAttentionSig) add<AttnCuda>(ops, domain, r, kCudaEp, dir, &make_attn_cuda);
        else if (r.sig == &kFusedGemmSig) add<GemmCuda>(ops, domain, r, kCudaEp, dir, &make_gemm_cuda);
        else if (r.sig == &kGatedGemmSig) add<GatedCuda>(ops, domain, r, kCudaEp, dir, &make_gated_cuda);
        else if (r.sig == &kRotarySig) add<RotaryCudaK>(ops, domain, r, kCudaEp, dir, &make_rotary_cuda_k);
        else if (r.sig == &kEmbedLayerNormSig) add<EmbedCuda>(ops, domain, r, kCudaEp, dir, &make_embed_cuda);
        else add<NormCuda>(ops, domain, r, kCudaEp, dir, &make_norm_cuda);
    } else if (r.elem == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
        add_cpu<float>(ops, domain, r, dir);
    } else if (r.elem == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
        add_cpu<Ort::Float16_t>(ops, domain, r, dir);
    } else if (r.elem == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16) {
        add_cpu<Ort::BFloat16_t>(ops, domain, r, dir);
    } else {
        throw std::logic_error("a CPU twin for an element type without a CPU kernel");
    }
}

OrtStatus* register_ops(OrtSessionOptions* options, const OrtApi& api) {
    std::string dir = config_entry(api, options, kPackageDirKey);
    if (dir.empty()) dir = library_dir();
    // Kept for the life of the process: sessions hold raw pointers to these.
    static auto* keep_ops = new std::vector<std::unique_ptr<OrtCustomOp>>();
    static auto* keep_domains = new std::vector<Ort::CustomOpDomain>();
    Ort::CustomOpDomain domain(kDomain);
    for (const Registration& r : kRegistrations) add_registration(*keep_ops, domain, r, dir);
    Ort::UnownedSessionOptions(options).Add(domain);
    keep_domains->push_back(std::move(domain));
    return nullptr;
}

}  // namespace
}  // namespace stofc_ort

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
    const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
    if (!api) {
        const OrtApi* v1 = api_base->GetApi(1);
        const std::string msg = std::string("stofc: libstofc_ort.so needs ONNX Runtime API ") +
                                std::to_string(ORT_API_VERSION) + " (ORT >= 1.21); this runtime is " +
                                api_base->GetVersionString();
        return v1 ? v1->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
    }
    Ort::InitApi(api);
    try {
        return stofc_ort::register_ops(options, *api);
    } catch (const std::exception& e) {
        return api->CreateStatus(ORT_FAIL, (std::string("stofc: registering the ai.stofc ops failed: ") + e.what()).c_str());
    }
}
