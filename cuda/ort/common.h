// stofc ONNX Runtime custom-op library: shared helpers.
//
// Built against the C/C++ API headers of ORT 1.21 (ORT_API_VERSION 21) with
// ORT_API_MANUAL_INIT: nothing from ONNX Runtime is linked; RegisterCustomOps
// initialises the API from the OrtApiBase it is handed. Kernels never let a C++
// exception cross into ONNX Runtime: every entry point returns an OrtStatus
// (CustomOpBase<..., WithStatus = true>), built by `to_status` from the
// `OpError` that the op code throws.
#ifndef STOFC_ORT_COMMON_H
#define STOFC_ORT_COMMON_H

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace stofc_ort {

constexpr const char* kDomain = "ai.stofc";
constexpr const char* kCudaEp = "CUDAExecutionProvider";
/// The session config entry naming the package directory (see OPS.md).
constexpr const char* kPackageDirKey = "stofc.package_dir";

/// A problem with the node, its inputs or the package; becomes an ORT error status.
struct OpError : std::runtime_error {
    OrtErrorCode code;
    explicit OpError(const std::string& msg, OrtErrorCode c = ORT_INVALID_ARGUMENT)
        : std::runtime_error(msg), code(c) {}
};

/// Runs `fn`, turning any exception into an OrtStatus whose message starts with
/// "stofc <op>: ".
template <typename Fn>
OrtStatusPtr guarded(const char* op, Fn&& fn) noexcept {
    try {
        fn();
        return nullptr;
    } catch (const OpError& e) {
        return Ort::GetApi().CreateStatus(e.code, (std::string("stofc ") + op + ": " + e.what()).c_str());
    } catch (const Ort::Exception& e) {
        return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(),
                                          (std::string("stofc ") + op + ": " + e.what()).c_str());
    } catch (const std::exception& e) {
        return Ort::GetApi().CreateStatus(ORT_FAIL, (std::string("stofc ") + op + ": " + e.what()).c_str());
    } catch (...) {
        return Ort::GetApi().CreateStatus(ORT_FAIL, (std::string("stofc ") + op + ": unknown error").c_str());
    }
}

/// "[2, 3, 4]"
inline std::string shape_str(const std::vector<int64_t>& s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
}

inline int64_t numel(const std::vector<int64_t>& s) {
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    return n;
}

/// An attribute that may be absent: returns false instead of throwing.
bool try_attr(const OrtKernelInfo* info, const char* name, int64_t& out);
bool try_attr(const OrtKernelInfo* info, const char* name, float& out);
bool try_attr(const OrtKernelInfo* info, const char* name, std::string& out);
bool try_attr(const OrtKernelInfo* info, const char* name, std::vector<int64_t>& out);  // ints

/// A required attribute; a clear error names it when absent.
template <typename A>
A require_attr(const OrtKernelInfo* info, const char* name) {
    A v{};
    if (!try_attr(info, name, v)) throw OpError(std::string("missing required attribute '") + name + "'");
    return v;
}

/// Element access for the float types the CPU kernels accept (bfloat16: round to nearest even).
inline float to_float(float x) { return x; }
inline float to_float(Ort::Float16_t x) { return x.ToFloat(); }
inline float to_float(Ort::BFloat16_t x) { return x.ToFloat(); }
template <typename T> T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline Ort::Float16_t from_float<Ort::Float16_t>(float x) { return Ort::Float16_t(x); }
template <> inline Ort::BFloat16_t from_float<Ort::BFloat16_t>(float x) { return Ort::BFloat16_t(x); }

template <typename T> constexpr ONNXTensorElementDataType onnx_type();
template <> constexpr ONNXTensorElementDataType onnx_type<float>() { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
template <> constexpr ONNXTensorElementDataType onnx_type<Ort::Float16_t>() {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}
template <> constexpr ONNXTensorElementDataType onnx_type<Ort::BFloat16_t>() {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
}

/// "float", "float16", "bfloat16" or "element type N" (for messages).
std::string type_name(ONNXTensorElementDataType t);

/// Element i of a float, float16 or bfloat16 buffer of type `t`, as float (the CPU
/// twins' inputs whose type is chosen at run time, e.g. AddLayerNorm's float x).
inline float load_float(const void* p, ONNXTensorElementDataType t, int64_t i) {
    switch (t) {
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
            return to_float(static_cast<const Ort::Float16_t*>(p)[i]);
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
            return to_float(static_cast<const Ort::BFloat16_t*>(p)[i]);
        default:
            return static_cast<const float*>(p)[i];
    }
}
/// Stores v as element i of a float, float16 or bfloat16 buffer of type `t`.
inline void store_float(void* p, ONNXTensorElementDataType t, int64_t i, float v) {
    switch (t) {
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
            static_cast<Ort::Float16_t*>(p)[i] = Ort::Float16_t(v);
            break;
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
            static_cast<Ort::BFloat16_t*>(p)[i] = Ort::BFloat16_t(v);
            break;
        default:
            static_cast<float*>(p)[i] = v;
    }
}

/// An input or absent optional input: present() is false when the node omits it.
struct Input {
    Ort::ConstValue value{nullptr};
    std::vector<int64_t> shape;
    ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    bool present() const { return static_cast<const OrtValue*>(value) != nullptr; }
    template <typename T> const T* data() const { return value.GetTensorData<T>(); }
};

/// Input `i` of the kernel context (absent when the index is past the inputs given
/// or the optional input is omitted).
Input get_input(const Ort::KernelContext& ctx, size_t i);

/// Throws an OpError naming input `name` unless its shape is `want`.
void expect_shape(const Input& in, const std::vector<int64_t>& want, const char* name);

/// FusedGemm's shapes, checked once for both twins: x [..., K], w [K, N],
/// bias [N], residual like y = [..., N].
struct GemmShapes {
    int64_t M, K, N;
    std::vector<int64_t> y;
};
GemmShapes check_fused_gemm(const Input& x, const Input& w, const Input& bias, const Input& res);

/// FusedGemm's element types (OPS.md), checked once for both twins; returns y's type.
/// w, bias and residual have x's type T, y too; or, with T = bfloat16, a float bias
/// makes y float (x@w + bias in float32: then no residual and no activation).
ONNXTensorElementDataType check_fused_gemm_types(const Input& x, const Input& w, const Input& bias,
                                                 const Input& res, bool has_activation);

/// AddLayerNorm's shape checks, shared by the CPU and CUDA twins: rows M of width C.
struct NormShapes {
    int64_t M, C;
};
NormShapes check_add_layer_norm(const Input& x, const Input& res, const Input& gamma, const Input& beta);

/// AddLayerNorm's element types (OPS.md) for an output type T: residual is T; x is T
/// or float; gamma and beta are both T or both float (float x or gamma only with
/// T = bfloat16 or T = float).
void check_add_layer_norm_types(ONNXTensorElementDataType t, const Input& x, const Input& res, const Input& gamma,
                                const Input& beta);

/// Splits the library's attribute `file:entry` (the CUDA kernel reference).
std::pair<std::string, std::string> split_kernel_ref(const std::string& ref);

/// Resolves a package-relative path against the package directory, confined to it: an absolute
/// path, a '..' component, a symbolic link leading outside the directory or anything but a regular
/// file (e.g. /dev/zero) is an OpError. A missing file resolves (its reader reports it).
std::string resolve_package_path(const std::string& package_dir, const std::string& rel);

}  // namespace stofc_ort

#endif  // STOFC_ORT_COMMON_H
