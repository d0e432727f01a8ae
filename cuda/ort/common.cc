// stofc ONNX Runtime custom-op library: helpers and the attribute parsing both twins share.
#include "common.h"

#include <sys/stat.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>

#include "ops.h"

namespace stofc_ort {

bool try_attr(const OrtKernelInfo* info, const char* name, int64_t& out) {
    OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &out);
    if (st) Ort::GetApi().ReleaseStatus(st);
    return st == nullptr;
}

bool try_attr(const OrtKernelInfo* info, const char* name, float& out) {
    OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &out);
    if (st) Ort::GetApi().ReleaseStatus(st);
    return st == nullptr;
}

bool try_attr(const OrtKernelInfo* info, const char* name, std::string& out) {
    size_t size = 0;
    OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, nullptr, &size);
    if (st) {
        Ort::GetApi().ReleaseStatus(st);
        return false;
    }
    std::string buf(size, '\0');
    st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, &buf[0], &size);
    if (st) {
        Ort::GetApi().ReleaseStatus(st);
        return false;
    }
    buf.resize(size > 0 ? size - 1 : 0);  // size counts the terminating NUL
    out = buf;
    return true;
}

bool try_attr(const OrtKernelInfo* info, const char* name, std::vector<int64_t>& out) {
    size_t size = 0;
    OrtStatus* st = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
    if (st) {
        Ort::GetApi().ReleaseStatus(st);
        return false;
    }
    std::vector<int64_t> buf(size);
    if (size > 0) {
        st = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, buf.data(), &size);
        if (st) {
            Ort::GetApi().ReleaseStatus(st);
            return false;
        }
    }
    out = std::move(buf);
    return true;
}

Input get_input(const Ort::KernelContext& ctx, size_t i) {
    Input in;
    if (i >= ctx.GetInputCount()) return in;
    in.value = ctx.GetInput(i);
    if (!in.present()) return in;
    auto info = in.value.GetTensorTypeAndShapeInfo();
    in.shape = info.GetShape();
    in.type = info.GetElementType();
    return in;
}

void expect_shape(const Input& in, const std::vector<int64_t>& want, const char* name) {
    if (in.shape != want)
        throw OpError(std::string("input ") + name + " has shape " + shape_str(in.shape) + ", expected " +
                      shape_str(want));
}

NormShapes check_add_layer_norm(const Input& x, const Input& res, const Input& gamma, const Input& beta) {
    if (!gamma.present()) throw OpError("input gamma is required");
    if (x.shape.empty()) throw OpError("input x must have rank >= 1");
    const int64_t C = x.shape.back();
    if (res.present()) expect_shape(res, x.shape, "residual");
    expect_shape(gamma, {C}, "gamma");
    if (beta.present()) expect_shape(beta, {C}, "beta");
    return {C ? numel(x.shape) / C : 0, C};
}

GemmShapes check_fused_gemm(const Input& x, const Input& w, const Input& bias, const Input& res) {
    if (x.shape.empty()) throw OpError("input x must have rank >= 1");
    if (w.shape.size() != 2 || w.shape[0] != x.shape.back())
        throw OpError("input w has shape " + shape_str(w.shape) + ", expected [K, N] with K=" +
                      std::to_string(x.shape.back()) + " (the last dimension of x " + shape_str(x.shape) + ")");
    GemmShapes g{0, w.shape[0], w.shape[1], x.shape};
    g.M = g.K ? numel(x.shape) / g.K : 0;
    g.y.back() = g.N;
    if (bias.present()) expect_shape(bias, {g.N}, "bias");
    if (res.present()) expect_shape(res, g.y, "residual");
    return g;
}

std::string type_name(ONNXTensorElementDataType t) {
    switch (t) {
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
            return "float";
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
            return "float16";
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
            return "bfloat16";
        default:
            return "element type " + std::to_string(static_cast<int>(t));
    }
}

ONNXTensorElementDataType check_fused_gemm_types(const Input& x, const Input& w, const Input& bias,
                                                 const Input& res, bool has_activation) {
    const ONNXTensorElementDataType t = x.type, f32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    if (w.type != t)
        throw OpError("input w is " + type_name(w.type) + " but x is " + type_name(t) + "; give w in x's type");
    const bool f32_out = bias.present() && bias.type == f32 && t == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
    if (bias.present() && bias.type != t && !f32_out)
        throw OpError("input bias is " + type_name(bias.type) + " but x is " + type_name(t) +
                      "; give bias in x's type (or float with bfloat16 x for a float y)");
    if (f32_out && res.present())
        throw OpError("a float bias makes y float (x@w + bias in float32), which takes no residual; add the "
                      "residual in the AddLayerNorm that reads y (OPS.md)");
    if (f32_out && has_activation)
        throw OpError("a float bias makes y float (x@w + bias in float32), which takes no activation; use "
                      "activation='none' or a bfloat16 bias");
    if (res.present() && res.type != t)
        throw OpError("input residual is " + type_name(res.type) + " but x is " + type_name(t) +
                      "; give residual in x's type");
    return f32_out ? f32 : t;
}

void check_add_layer_norm_types(ONNXTensorElementDataType t, const Input& x, const Input& res, const Input& gamma,
                                const Input& beta) {
    const ONNXTensorElementDataType f32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    const bool mixed_ok = t == f32 || t == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
    if (x.type != t && !(x.type == f32 && mixed_ok))
        throw OpError("input x is " + type_name(x.type) + "; this AddLayerNorm (y " + type_name(t) + ") takes x in " +
                      type_name(t) + (t == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 ? " or float" : ""));
    if (res.present() && res.type != t)
        throw OpError("input residual is " + type_name(res.type) + " but y is " + type_name(t) +
                      "; give residual in y's type");
    if (gamma.type != t && !(gamma.type == f32 && mixed_ok))
        throw OpError("input gamma is " + type_name(gamma.type) + "; this AddLayerNorm (y " + type_name(t) +
                      ") takes gamma in " + type_name(t) +
                      (t == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 ? " or float" : ""));
    if (beta.present() && beta.type != gamma.type)
        throw OpError("input beta is " + type_name(beta.type) + " but gamma is " + type_name(gamma.type) +
                      "; give gamma and beta one type");
}

std::pair<std::string, std::string> split_kernel_ref(const std::string& ref) {
    const auto colon = ref.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == ref.size())
        throw OpError("attribute 'kernel' must be 'FILE.cubin:ENTRY', got '" + ref + "'");
    return {ref.substr(0, colon), ref.substr(colon + 1)};
}

std::string resolve_package_path(const std::string& package_dir, const std::string& rel) {
    if (rel.empty()) throw OpError("an empty file attribute");
    if (rel[0] == '/')
        throw OpError("file attribute '" + rel +
                      "' is an absolute path; package files are named relative to the package directory");
    for (size_t start = 0; start <= rel.size();) {
        const size_t end = std::min(rel.find('/', start), rel.size());
        if (rel.compare(start, end - start, "..") == 0 && end - start == 2)
            throw OpError("file attribute '" + rel + "' leaves the package directory ('..')");
        start = end + 1;
    }
    if (package_dir.empty())
        throw OpError("file attribute '" + rel + "' cannot be resolved: the package directory is unknown (set "
                      "the session config entry '" + std::string(kPackageDirKey) + "')");
    const std::string path = package_dir + "/" + rel;
    // Symbolic links inside the package must stay inside it, and only regular files are read
    // (no /dev/zero, FIFO or directory). A missing file is left to the reader's own message.
    char* real_dir = realpath(package_dir.c_str(), nullptr);
    char* real = realpath(path.c_str(), nullptr);
    const std::string dir_s = real_dir ? real_dir : "", file_s = real ? real : "";
    std::free(real_dir);
    std::free(real);
    if (dir_s.empty() || file_s.empty()) return path;
    if (file_s.compare(0, dir_s.size() + 1, dir_s + "/") != 0 || file_s.size() <= dir_s.size() + 1)
        throw OpError("file attribute '" + rel + "' resolves to '" + file_s + "', outside the package directory '" +
                      dir_s + "'");
    struct stat st {};
    if (stat(file_s.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
        throw OpError("file attribute '" + rel + "' (" + file_s + ") is not a regular file");
    return path;
}

AttentionAttrs::AttentionAttrs(const OrtKernelInfo* info, const std::string& package_dir) {
    num_heads = require_attr<int64_t>(info, "num_heads");
    head_dim = require_attr<int64_t>(info, "head_dim");
    if (num_heads < 1 || head_dim < 1)
        throw OpError("attributes num_heads and head_dim must be >= 1, got " + std::to_string(num_heads) + " and " +
                      std::to_string(head_dim));
    if (!try_attr(info, "scale", scale)) scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    if (!(scale > 0.0f) || !std::isfinite(scale))
        throw OpError("attribute scale must be a finite number > 0, got " + std::to_string(scale));
    kv_num_heads = num_heads;
    try_attr(info, "kv_num_heads", kv_num_heads);
    if (kv_num_heads < 1 || num_heads % kv_num_heads != 0)
        throw OpError("attribute kv_num_heads=" + std::to_string(kv_num_heads) + " must be >= 1 and divide num_heads=" +
                      std::to_string(num_heads) + " (grouped-query attention); rewrite the package");
    try_attr(info, "softcap", softcap);
    if (!(softcap >= 0.0f) || !std::isfinite(softcap))
        throw OpError("attribute softcap must be a finite number >= 0 (0: no soft-capping), got " +
                      std::to_string(softcap));
    const auto rel = require_attr<std::string>(info, "mask_file");
    try_attr(info, "kernel", kernel_ref);
    mask_path = resolve_package_path(package_dir, rel);
    mask = load_mask_file(mask_path);
    if (mask->num_heads != 1 && mask->num_heads != num_heads)
        throw OpError("mask file '" + mask_path + "' has " + std::to_string(mask->num_heads) +
                      " per-head masks but the node has num_heads=" + std::to_string(num_heads) +
                      "; compile the package for this model's head count");
}

namespace {
void expect_same(const Input& in, const std::vector<int64_t>& want, const char* name) {
    if (in.shape != want)
        throw OpError(std::string("input ") + name + " has shape " + shape_str(in.shape) + ", expected " +
                      shape_str(want));
}
}  // namespace

int check_key_padding_mask(const Input& kpm, const char* name) {
    if (kpm.shape.size() != 2)
        throw OpError(std::string("input ") + name + " has shape " + shape_str(kpm.shape) + ", expected [B, S]");
    switch (kpm.type) {
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
            return 1;
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
            return 2;
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL:
            return 3;
        default:
            throw OpError(std::string("input ") + name + " must be int64, int32 or bool");
    }
}

AttentionCall check_attention(const AttentionAttrs& attrs, const Input& q, const Input& k, const Input& v,
                              const Input& kpm, const Input& bias, const Input& key_state) {
    AttentionCall c;
    c.H = attrs.num_heads;
    c.Hkv = attrs.kv_num_heads;
    c.D = attrs.head_dim;
    const int64_t HD = c.H * c.D, KD = c.Hkv * c.D;
    if (k.present() != v.present())
        throw OpError(std::string("input ") + (k.present() ? "v" : "k") + " is omitted but " +
                      (k.present() ? "k" : "v") +
                      " is given; give both k and v, or omit both to pass q packed as [B, S, (num_heads + "
                      "2*kv_num_heads)*head_dim] = [Q | K | V]");
    c.packed = !k.present();
    c.in_row = c.packed ? HD + 2 * KD : HD;
    c.kv_row = c.packed ? c.in_row : KD;
    c.k_offset = c.packed ? HD : 0;
    c.v_offset = c.packed ? HD + KD : 0;
    if (q.shape.size() != 3 || q.shape[2] != c.in_row)
        throw OpError("input q has shape " + shape_str(q.shape) + ", expected [B, S, " + std::to_string(c.in_row) +
                      "] (" +
                      (c.packed ? "(num_heads + 2*kv_num_heads) * head_dim: k and v are omitted, so q is packed QKV"
                                : "num_heads * head_dim") +
                      ")");
    c.B = q.shape[0];
    c.S = q.shape[1];
    if (!c.packed) {
        expect_same(k, {c.B, c.S, KD}, "k");
        expect_same(v, {c.B, c.S, KD}, "v");
        if (k.type != q.type || v.type != q.type) throw OpError("inputs q, k and v must have one element type");
    }
    if (c.S > attrs.mask->seq_len)
        throw OpError("sequence length " + std::to_string(c.S) + " exceeds the compiled maximum " +
                      std::to_string(attrs.mask->seq_len) + "; compile the package with --max-seq-len >= " +
                      std::to_string(c.S));
    c.has_kpm = kpm.present();
    if (c.has_kpm) {
        expect_same(kpm, {c.B, c.S}, "key_padding_mask");
        check_key_padding_mask(kpm);
    }
    c.has_key_state = key_state.present();
    if (c.has_key_state) {
        if (!c.has_kpm)
            throw OpError("input key_state is given without key_padding_mask; key_state is KeyPrep's output for "
                          "the node's key_padding_mask, give both or neither");
        const KeyStateLayout l = key_state_layout(c.B, c.S);
        if (key_state.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || key_state.shape != std::vector<int64_t>{l.bytes})
            throw OpError("input key_state must be uint8 [" + std::to_string(l.bytes) + "] (KeyPrep's output for B=" +
                          std::to_string(c.B) + ", S=" + std::to_string(c.S) + "), got " +
                          (key_state.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 ? "uint8 " : "another type, ") +
                          shape_str(key_state.shape) + "; feed it from KeyPrep of this node's key_padding_mask");
    }
    c.has_bias = bias.present();
    if (c.has_bias) {
        const auto& bs = bias.shape;
        if (bs.size() != 4 || (bs[0] != 1 && bs[0] != c.B) || (bs[1] != 1 && bs[1] != c.H) || bs[2] != c.S ||
            bs[3] != c.S)
            throw OpError("input bias has shape " + shape_str(bs) + ", expected [B|1, H|1, S, S] with B=" +
                          std::to_string(c.B) + ", H=" + std::to_string(c.H) + ", S=" + std::to_string(c.S));
        if (bias.type != q.type) throw OpError("input bias must have q's element type");
        c.bias_sh = bs[1] == 1 ? 0 : c.S * c.S;
        c.bias_sb = bs[0] == 1 ? 0 : bs[1] * c.S * c.S;
    }
    return c;
}

GemmAttrs::GemmAttrs(const OrtKernelInfo* info) {
    std::string act = "none";
    try_attr(info, "activation", act);
    if (act == "none") activation = Activation::kNone;
    else if (act == "gelu_erf") activation = Activation::kGeluErf;
    else if (act == "gelu_tanh") activation = Activation::kGeluTanh;
    else throw OpError("attribute activation='" + act + "' is not one of none, gelu_erf, gelu_tanh");
    int64_t after = 1;
    try_attr(info, "residual_after_activation", after);
    if (after != 0 && after != 1) throw OpError("attribute residual_after_activation must be 0 or 1");
    residual_after_activation = after == 1;
    try_attr(info, "kernel", kernel_ref);
}

NormAttrs::NormAttrs(const OrtKernelInfo* info) {
    try_attr(info, "epsilon", epsilon);
    if (!(epsilon >= 0.0f)) throw OpError("attribute epsilon must be >= 0");
    int64_t r = 0;
    try_attr(info, "rms", r);
    if (r != 0 && r != 1) throw OpError("attribute rms must be 0 or 1");
    rms = r == 1;
    try_attr(info, "kernel", kernel_ref);
}

}  // namespace stofc_ort
