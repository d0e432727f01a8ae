// A host-memory stand-in for the CUDA driver and cuBLASLt, for unit tests without a GPU.
//
// Built by tests/unit/test_ortlib_fake_gpu.py as one shared library that is loaded
// under the names libcuda.so.1 and libcublasLt.so.13, together with a test build of
// libstofc_ort.so (-DSTOFC_CUDA_TWINS_ON_CPU: the CUDA twins registered for the CPU
// EP). "Device" memory is host memory; every call the twins make is appended as one
// JSON line to $STOFC_FAKE_CUDA_LOG, with the decoded kernel arguments:
//   stofc_key_prep   is executed on the host (key_prep.cu, one thread per block);
//   stofc_attn_*     arguments by the ABI table (attention_abi.h), plus the kv_len and
//                    key-bit words it points at; the warp-specialised kernel's by its own
//                    table, each tensor map decoded (see below), and its `_combine` kernel's;
//   stofc_add_norm_* (x, bias, residual, gamma, beta, out, pre_norm, M, N, eps);
// host-to-device copies with their bytes (hex), cuBLASLt descriptors, layouts,
// heuristic requests and matmuls (with the algorithm id of the heuristic result used).
// cuTensorMapEncodeTiled logs its arguments and writes them into the 128-byte map
// (FakeTensorMap below) instead of a real descriptor, so a launch's map parameters decode
// back to what was encoded, and Python's stofc.runtime.tensor_map, pointed at this
// library, produces the same bytes for the same arguments.
// Nothing here computes attention or a GEMM: the tests compare launches.
#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "../attention_abi.h"

#define __global__
#define __restrict__
#define __shared__ static
namespace keyprep {
struct Dim {
    int x = 0;
};
static Dim blockIdx, threadIdx, blockDim;
static void __syncthreads() {}
static int __clzll(long long x) { return __builtin_clzll(static_cast<unsigned long long>(x)); }
static int atomicMax(int* p, int v) {
    const int old = *p;
    *p = std::max(old, v);
    return old;
}
#include "../key_prep.cu"
}  // namespace keyprep
#undef __global__
#undef __restrict__
#undef __shared__

namespace {

enum AbiIndex : int {
#define STOFC_FAKE_INDEX(n, type) kIdx_##n,
    STOFC_ATTENTION_ABI(STOFC_FAKE_INDEX)
#undef STOFC_FAKE_INDEX
};
enum WsAbiIndex : int {
#define STOFC_FAKE_INDEX(n, type) kWsIdx_##n,
    STOFC_ATTENTION_WS_ABI(STOFC_FAKE_INDEX)
#undef STOFC_FAKE_INDEX
};

/// What the fake cuTensorMapEncodeTiled writes into a CUtensorMap: its arguments.
struct FakeTensorMap {
    uint32_t tag;  // kFakeMapTag
    uint32_t dtype, rank, interleave, swizzle, l2, oob, pad;
    uint64_t address;
    uint64_t dims[4];
    uint64_t strides[3];
    uint32_t box[4];
    uint32_t element_strides[4];
};
static_assert(sizeof(FakeTensorMap) == 128, "one CUtensorMap");
constexpr uint32_t kFakeMapTag = 0x50414d54;  // "TMAP"

template <typename T>
std::string json_list(const T* v, int n) {
    std::ostringstream s;
    s << "[";
    for (int i = 0; i < n; ++i) s << (i ? ", " : "") << v[i];
    return s.str() + "]";
}

std::string map_json(const FakeTensorMap& m) {
    std::ostringstream s;
    s << "{\"tag\": " << (m.tag == kFakeMapTag ? 1 : 0) << ", \"dtype\": " << m.dtype << ", \"rank\": " << m.rank
      << ", \"address\": " << m.address << ", \"dims\": " << json_list(m.dims, 4)
      << ", \"strides\": " << json_list(m.strides, 3) << ", \"box\": " << json_list(m.box, 4)
      << ", \"element_strides\": " << json_list(m.element_strides, 4) << ", \"interleave\": " << m.interleave
      << ", \"swizzle\": " << m.swizzle << ", \"l2\": " << m.l2 << ", \"oob\": " << m.oob << "}";
    return s.str();
}

std::string map_value(const void* arg) {
    FakeTensorMap m;
    std::memcpy(&m, arg, sizeof m);
    return map_json(m);
}

std::mutex mu;
std::map<CUfunction, std::string> functions;
int next_handle = 1;

void emit(const std::string& line) {
    const char* path = std::getenv("STOFC_FAKE_CUDA_LOG");
    if (!path) return;
    FILE* f = std::fopen(path, "a");
    if (!f) return;
    std::fputs((line + "\n").c_str(), f);
    std::fclose(f);
}

std::string hex(const void* p, size_t n) {
    static const char* d = "0123456789abcdef";
    std::string out;
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) {
        out += d[b[i] >> 4];
        out += d[b[i] & 15];
    }
    return out;
}

template <typename T>
std::string value(const void* arg) {
    T v;
    std::memcpy(&v, arg, sizeof v);
    std::ostringstream s;
    s.precision(9);
    s << v;
    return s.str();
}

std::string ptr_value(const void* arg) {
    uintptr_t v;
    std::memcpy(&v, arg, sizeof v);
    return std::to_string(v);
}

template <typename T>
T get(void** args, int i) {
    T v;
    std::memcpy(&v, args[i], sizeof v);
    return v;
}

void* handle() { return reinterpret_cast<void*>(static_cast<uintptr_t>(0x1000 + next_handle++)); }

}  // namespace

extern "C" {

CUresult cuGetErrorString(CUresult, const char** s) {
    *s = "fake CUDA error";
    return CUDA_SUCCESS;
}
CUresult cuStreamGetCtx(CUstream, CUcontext* ctx) {
    *ctx = reinterpret_cast<CUcontext>(0xC0);
    emit("{\"call\": \"stream_ctx\"}");
    return CUDA_SUCCESS;
}
CUresult cuStreamIsCapturing(CUstream, CUstreamCaptureStatus* s) {
    *s = std::getenv("STOFC_FAKE_CUDA_CAPTURING") ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}
CUresult cuCtxPushCurrent_v2(CUcontext) { return CUDA_SUCCESS; }
CUresult cuCtxPopCurrent_v2(CUcontext* c) {
    *c = nullptr;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(CUdevice* d) {
    *d = 0;
    return CUDA_SUCCESS;
}
// The multiprocessor count is $STOFC_FAKE_SM_COUNT (default 132, an H100 SXM's).
CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice) {
    const char* env = std::getenv("STOFC_FAKE_SM_COUNT");
    *v = a == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT ? (env ? std::atoi(env) : 132) : 0;
    emit("{\"call\": \"device_attr\", \"attr\": " + std::to_string(static_cast<int>(a)) + ", \"value\": " +
         std::to_string(*v) + "}");
    return CUDA_SUCCESS;
}
CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    std::lock_guard<std::mutex> lock(mu);
    *m = static_cast<CUmodule>(handle());
    emit("{\"call\": \"module_load\", \"bytes\": " + std::to_string(std::strlen(static_cast<const char*>(image))) + "}");
    return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule) { return CUDA_SUCCESS; }
CUresult cuModuleGetFunction(CUfunction* f, CUmodule, const char* name) {
    std::lock_guard<std::mutex> lock(mu);
    *f = static_cast<CUfunction>(handle());
    functions[*f] = name;
    return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
    emit("{\"call\": \"func_attr\", \"fn\": \"" + functions[f] + "\", \"attr\": " + std::to_string(a) +
         ", \"value\": " + std::to_string(v) + "}");
    return CUDA_SUCCESS;
}
// CU_FUNC_ATTRIBUTE_PTX_VERSION is $STOFC_FAKE_PTX_VERSION (default 90: the twins may launch
// the kernels that wait on their grid dependency with PDL); other attributes are 0.
CUresult cuFuncGetAttribute(int* v, CUfunction_attribute a, CUfunction) {
    const char* env = std::getenv("STOFC_FAKE_PTX_VERSION");
    *v = a == CU_FUNC_ATTRIBUTE_PTX_VERSION ? (env ? std::atoi(env) : 90) : 0;
    return CUDA_SUCCESS;
}
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    *p = reinterpret_cast<CUdeviceptr>(std::calloc(1, bytes + 256));
    emit("{\"call\": \"mem_alloc\", \"ptr\": " + std::to_string(*p) + ", \"bytes\": " + std::to_string(bytes) + "}");
    return CUDA_SUCCESS;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    std::free(reinterpret_cast<void*>(p));
    return CUDA_SUCCESS;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, CUstream) {
    std::memcpy(reinterpret_cast<void*>(dst), src, bytes);
    emit("{\"call\": \"htod\", \"dst\": " + std::to_string(dst) + ", \"bytes\": " + std::to_string(bytes) +
         ", \"data\": \"" + hex(src, bytes) + "\"}");
    return CUDA_SUCCESS;
}

// A launch's record: "pdl" says whether it asked for programmatic stream serialization
// (cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION set).
static CUresult record_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, unsigned smem, void** args, bool pdl) {
    const std::string name = functions[f];
    std::ostringstream s;
    s << "{\"call\": \"launch\", \"fn\": \"" << name << "\", \"pdl\": " << (pdl ? "true" : "false")
      << ", \"grid\": [" << gx << ", " << gy << ", " << gz
      << "], \"block\": [" << bx << ", " << by << ", " << bz << "], \"smem\": " << smem << ", \"args\": {";
    if (name == "stofc_key_prep") {
        const int B = get<int>(args, 2);
        for (int b = 0; b < B; ++b) {
            keyprep::blockIdx.x = b;
            keyprep::threadIdx.x = 0;
            keyprep::blockDim.x = 1;
            keyprep::stofc_key_prep(get<const void*>(args, 0), get<int>(args, 1), B, get<int>(args, 3),
                                    get<int>(args, 4), get<int*>(args, 5), get<unsigned long long*>(args, 6));
        }
        s << "\"kpm_type\": " << get<int>(args, 1) << ", \"B\": " << B << ", \"S\": " << get<int>(args, 3)
          << ", \"key_words\": " << get<int>(args, 4) << ", \"kv_len\": " << ptr_value(args[5])
          << ", \"words\": " << ptr_value(args[6]);
    } else if (name.rfind("stofc_attn_", 0) == 0) {
        int i = 0;
        const char* sep = "";
#define STOFC_FAKE_ARG(n, type)                                                                               \
    s << sep << "\"" #n "\": " << (std::string(#type) == "ptr" ? ptr_value(args[i])                           \
                                   : std::string(#type) == "i64" ? value<long long>(args[i])                  \
                                   : std::string(#type) == "i32" ? value<int>(args[i])                        \
                                   : std::string(#type) == "map" ? map_value(args[i])                         \
                                                                  : value<float>(args[i]));                   \
    sep = ", ";                                                                                               \
    ++i;
        const bool ws = name.rfind("stofc_attn_ws_", 0) == 0;
        const bool combine = ws && name.size() > 8 && name.compare(name.size() - 8, 8, "_combine") == 0;
        if (combine) {
            STOFC_ATTENTION_WS_COMBINE_ABI(STOFC_FAKE_ARG)
            s << "}}";
            emit(s.str());
            return CUDA_SUCCESS;
        }
        if (ws) {
            STOFC_ATTENTION_WS_ABI(STOFC_FAKE_ARG)
        } else {
            STOFC_ATTENTION_ABI(STOFC_FAKE_ARG)
        }
#undef STOFC_FAKE_ARG
        // what the kernel would read: kv_len [B] and key_bits [B * key_words]
        const int B = get<int>(args, ws ? int{kWsIdx_B} : int{kIdx_B});
        const int key_words = get<int>(args, ws ? int{kWsIdx_key_words} : int{kIdx_key_words});
        const int* kv = get<const int*>(args, ws ? int{kWsIdx_kv_len} : int{kIdx_kv_len});
        const unsigned long long* words = get<const unsigned long long*>(args, ws ? int{kWsIdx_key_bits} : int{kIdx_key_bits});
        s << ", \"kv_len_values\": [";
        for (int b = 0; b < B; ++b) s << (b ? ", " : "") << kv[b];
        s << "], \"key_bits_values\": [";
        for (int w = 0; w < B * key_words; ++w) s << (w ? ", " : "") << "\"" << words[w] << "\"";
        s << "]";
    } else if (name.rfind("stofc_glu_", 0) == 0) {
        static const char* ptrs[] = {"x", "bias", "out"};
        for (int j = 0; j < 3; ++j) s << (j ? ", " : "") << "\"" << ptrs[j] << "\": " << ptr_value(args[j]);
        s << ", \"M\": " << get<int>(args, 3) << ", \"F\": " << get<int>(args, 4);
    } else if (name.rfind("stofc_rotary_", 0) == 0) {  // OPS.md "Rotary": 22 arguments
        static const char* names[] = {"q", "k", "v", "out", "q_sb", "q_ss", "k_sb", "k_ss", "v_sb", "v_ss", "cos",
                                      "sin", "t_sb", "W", "pos", "pos_sb", "pos_mode", "rows", "B", "S", "H", "Hkv"};
        static const char kinds[] = "ppppLLLLLLppLipLiiiiii";  // p pointer, L int64, i int32
        for (int j = 0; j < 22; ++j)
            s << (j ? ", " : "") << "\"" << names[j] << "\": "
              << (kinds[j] == 'p' ? ptr_value(args[j]) : kinds[j] == 'L' ? value<long long>(args[j]) : value<int>(args[j]));
    } else if (name.rfind("stofc_embed_norm_", 0) == 0) {  // OPS.md "EmbedLayerNorm": 23 arguments
        static const char* names[] = {"ids0", "ids1", "ids2", "table0", "table1", "table2", "gamma", "beta",
                                      "out",  "sb0",  "ss0",  "sb1",    "ss1",    "sb2",    "ss2",   "V0",
                                      "V1",   "V2",   "ids32", "B",     "S",      "C",      "eps"};
        static const char kinds[] = "pppppppppLLLLLLLLLiiiif";  // p pointer, L int64, i int32, f float
        for (int j = 0; j < 23; ++j)
            s << (j ? ", " : "") << "\"" << names[j] << "\": "
              << (kinds[j] == 'p'   ? ptr_value(args[j])
                  : kinds[j] == 'L' ? value<long long>(args[j])
                  : kinds[j] == 'i' ? value<int>(args[j])
                                    : value<float>(args[j]));
    } else if (name.rfind("stofc_gemm_ws_", 0) == 0) {  // OPS.md "FusedGemm": the Hopper GEMM, 7 arguments
        s << "\"x_map\": " << map_value(args[0]) << ", \"w_map\": " << map_value(args[1])
          << ", \"bias\": " << ptr_value(args[2]) << ", \"out\": " << ptr_value(args[3])
          << ", \"M\": " << get<int>(args, 4) << ", \"N\": " << get<int>(args, 5) << ", \"K\": " << get<int>(args, 6);
    } else if (name.rfind("stofc_add_norm_", 0) == 0) {
        static const char* ptrs[] = {"x", "bias", "residual", "gamma", "beta", "out", "pre_norm"};
        for (int j = 0; j < 7; ++j) s << (j ? ", " : "") << "\"" << ptrs[j] << "\": " << ptr_value(args[j]);
        s << ", \"M\": " << get<int>(args, 7) << ", \"N\": " << get<int>(args, 8) << ", \"eps\": "
          << value<float>(args[9]);
    }
    s << "}}";
    emit(s.str());
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, CUstream, void** args, void**) {
    return record_launch(f, gx, gy, gz, bx, by, bz, smem, args, false);
}
// The CUDA 12 launch with attributes (cuda_driver.cc launch_kernel uses it for PDL).
CUresult cuLaunchKernelEx(const CUlaunchConfig* c, CUfunction f, void** args, void**) {
    bool pdl = false;
    for (unsigned i = 0; i < c->numAttrs; ++i)
        if (c->attrs[i].id == CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            pdl = c->attrs[i].value.programmaticStreamSerializationAllowed != 0;
    return record_launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ,
                         c->sharedMemBytes, args, pdl);
}

CUresult cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType dtype, cuuint32_t rank, void* address,
                                const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
    if (rank != 4) return CUDA_ERROR_INVALID_VALUE;  // the fake encodes what the ws kernel uses
    FakeTensorMap m{};
    m.tag = kFakeMapTag;
    m.dtype = static_cast<uint32_t>(dtype);
    m.rank = rank;
    m.interleave = static_cast<uint32_t>(interleave);
    m.swizzle = static_cast<uint32_t>(swizzle);
    m.l2 = static_cast<uint32_t>(l2);
    m.oob = static_cast<uint32_t>(oob);
    m.address = reinterpret_cast<uintptr_t>(address);
    for (int i = 0; i < 4; ++i) {
        m.dims[i] = dims[i];
        m.box[i] = box[i];
        m.element_strides[i] = element_strides[i];
    }
    for (int i = 0; i < 3; ++i) m.strides[i] = strides[i];
    std::memcpy(static_cast<void*>(map), &m, sizeof m);
    emit("{\"call\": \"tensor_map\", \"map\": " + map_json(m) + "}");
    return CUDA_SUCCESS;
}

// ---------------------------------------------------------------- cuBLASLt

int cublasLtCreate(void** h) {
    *h = handle();
    emit("{\"call\": \"lt_create\"}");
    return 0;
}
int cublasLtMatmulDescCreate(void** d, int compute, int scale) {
    *d = handle();
    emit("{\"call\": \"lt_desc\", \"desc\": " + std::to_string(reinterpret_cast<uintptr_t>(*d)) +
         ", \"compute\": " + std::to_string(compute) + ", \"scale\": " + std::to_string(scale) + "}");
    return 0;
}
int cublasLtMatmulDescSetAttribute(void* d, int attr, const void* buf, size_t size) {
    emit("{\"call\": \"lt_desc_attr\", \"desc\": " + std::to_string(reinterpret_cast<uintptr_t>(d)) +
         ", \"attr\": " + std::to_string(attr) + ", \"data\": \"" + hex(buf, size) + "\"}");
    return 0;
}
int cublasLtMatrixLayoutCreate(void** l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
    *l = handle();
    emit("{\"call\": \"lt_layout\", \"layout\": " + std::to_string(reinterpret_cast<uintptr_t>(*l)) +
         ", \"type\": " + std::to_string(type) + ", \"rows\": " + std::to_string(rows) + ", \"cols\": " +
         std::to_string(cols) + ", \"ld\": " + std::to_string(ld) + "}");
    return 0;
}
int cublasLtMatmulPreferenceCreate(void** p) {
    *p = handle();
    return 0;
}
int cublasLtMatmulPreferenceSetAttribute(void*, int attr, const void* buf, size_t size) {
    emit("{\"call\": \"lt_pref_attr\", \"attr\": " + std::to_string(attr) + ", \"data\": \"" + hex(buf, size) +
         "\"}");
    return 0;
}
// Result i of the heuristic: algorithm id i + 1 in the first word of its algo, workspace
// 4096 * (i + 1). It offers $STOFC_FAKE_LT_RESULTS results (default 8) at most.
int cublasLtMatmulAlgoGetHeuristic(void*, void*, void*, void*, void*, void*, void*, int requested, void* results,
                                   int* count) {
    const char* env = std::getenv("STOFC_FAKE_LT_RESULTS");
    const int offered = env ? std::atoi(env) : 8;
    *count = std::min(requested, offered);
    for (int i = 0; i < *count; ++i) {
        char* r = static_cast<char*>(results) + 96 * i;
        std::memset(r, 0, 96);
        const uint64_t id = static_cast<uint64_t>(i) + 1;
        const size_t ws = 4096 * (static_cast<size_t>(i) + 1);
        std::memcpy(r, &id, sizeof id);
        std::memcpy(r + 64, &ws, sizeof ws);
    }
    emit("{\"call\": \"lt_heuristic\", \"requested\": " + std::to_string(requested) +
         ", \"returned\": " + std::to_string(*count) + "}");
    return 0;
}
int cublasLtMatmul(void*, void* desc, const void* alpha, const void* A, void* a, const void* B, void* b,
                   const void* beta, const void* C, void* c, void* D, void* d, const void* algo, void* ws,
                   size_t ws_size, void*) {
    uint64_t algo_id = 0;
    std::memcpy(&algo_id, algo, sizeof algo_id);
    std::ostringstream s;
    s << "{\"call\": \"lt_matmul\", \"desc\": " << reinterpret_cast<uintptr_t>(desc)
      << ", \"alpha\": " << *static_cast<const float*>(alpha) << ", \"beta\": " << *static_cast<const float*>(beta)
      << ", \"A\": " << reinterpret_cast<uintptr_t>(A) << ", \"B\": " << reinterpret_cast<uintptr_t>(B)
      << ", \"C\": " << reinterpret_cast<uintptr_t>(C) << ", \"D\": " << reinterpret_cast<uintptr_t>(D)
      << ", \"a\": " << reinterpret_cast<uintptr_t>(a) << ", \"b\": " << reinterpret_cast<uintptr_t>(b)
      << ", \"c\": " << reinterpret_cast<uintptr_t>(c) << ", \"d\": " << reinterpret_cast<uintptr_t>(d)
      << ", \"ws\": " << reinterpret_cast<uintptr_t>(ws) << ", \"ws_size\": " << ws_size
      << ", \"algo\": " << algo_id << "}";
    emit(s.str());
    return 0;
}

}  // extern "C"
