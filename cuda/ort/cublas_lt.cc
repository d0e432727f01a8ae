// stofc ONNX Runtime custom-op library: dlopen of cuBLASLt (see cublas_lt.h).
#include "cublas_lt.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "common.h"

namespace stofc_ort {
namespace {

template <typename F>
void resolve(void* lib, const char* name, F& out) {
    void* sym = dlsym(lib, name);
    if (!sym) throw OpError(std::string("cuBLASLt lacks ") + name + "; install cuBLAS 12 or 13", ORT_FAIL);
    out = reinterpret_cast<F>(sym);
}

CublasLt load() {
    std::string tried;
    void* lib = nullptr;
    const char* env = std::getenv("STOFC_CUBLASLT");
    for (const char* name : {env, "libcublasLt.so.13", "libcublasLt.so.12"}) {
        if (!name || !*name) continue;
        lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
        if (lib) break;
        const char* err = dlerror();
        tried += std::string(tried.empty() ? "" : "; ") + (err ? err : name);
    }
    if (!lib)
        throw OpError("cannot load cuBLASLt (" + tried +
                          "); FusedGemm on the CUDA EP needs it: install nvidia-cublas, add its lib directory to "
                          "LD_LIBRARY_PATH, or set STOFC_CUBLASLT to the library's path",
                      ORT_FAIL);
    CublasLt lt{};
    resolve(lib, "cublasLtCreate", lt.Create);
    resolve(lib, "cublasLtMatmulDescCreate", lt.MatmulDescCreate);
    resolve(lib, "cublasLtMatmulDescSetAttribute", lt.MatmulDescSetAttribute);
    resolve(lib, "cublasLtMatrixLayoutCreate", lt.MatrixLayoutCreate);
    resolve(lib, "cublasLtMatmulPreferenceCreate", lt.MatmulPreferenceCreate);
    resolve(lib, "cublasLtMatmulPreferenceSetAttribute", lt.MatmulPreferenceSetAttribute);
    resolve(lib, "cublasLtMatmulAlgoGetHeuristic", lt.MatmulAlgoGetHeuristic);
    resolve(lib, "cublasLtMatmul", lt.Matmul);
    return lt;  // the handle stays open for the life of the process
}

}  // namespace

void CublasLt::check(int status, const char* what) const {
    if (status != 0)
        throw OpError(std::string(what) + " failed with cuBLAS status " + std::to_string(status), ORT_FAIL);
}

const CublasLt& cublas_lt() {
    static std::once_flag once;
    static CublasLt lt{};
    static std::string error;
    std::call_once(once, [] {
        try {
            lt = load();
        } catch (const OpError& e) {
            error = e.what();
        }
    });
    if (!error.empty()) throw OpError(error, ORT_FAIL);
    return lt;
}

}  // namespace stofc_ort
