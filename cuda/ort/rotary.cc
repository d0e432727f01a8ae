// stofc ONNX Runtime custom-op library: Rotary's attributes, input checks and CPU twin.
//
// Rotary(q, k?, v?, cos, sin, position_ids?) -> qkv (OPS.md, "Rotary"): the rotary position
// embedding of every Q and K head, written with V as the packed [Q' | K' | V] that
// SparseAttention reads in place. The CPU twin computes each rotated element as the
// float expression x * c + r * s (two products, one sum) and rounds it once to T; the
// CUDA twin (cuda_rotary.cc) launches the rope/rotary.cu.j2 kernel, which rounds the same
// way.
#include <cmath>
#include <limits>
#include <string>

#include "ops.h"

namespace stofc_ort {

RotaryAttrs::RotaryAttrs(const OrtKernelInfo* info) {
    num_heads = require_attr<int64_t>(info, "num_heads");
    head_dim = require_attr<int64_t>(info, "head_dim");
    kv_num_heads = num_heads;
    try_attr(info, "kv_num_heads", kv_num_heads);
    rotary_dim = head_dim;
    try_attr(info, "rotary_dim", rotary_dim);
    int64_t il = 0;
    try_attr(info, "interleaved", il);
    if (num_heads <= 0 || head_dim <= 0)
        throw OpError("attributes num_heads=" + std::to_string(num_heads) + " and head_dim=" +
                      std::to_string(head_dim) + " must be positive");
    if (kv_num_heads <= 0)
        throw OpError("attribute kv_num_heads=" + std::to_string(kv_num_heads) + " must be positive");
    if (rotary_dim <= 0 || rotary_dim % 2 || rotary_dim > head_dim)
        throw OpError("attribute rotary_dim=" + std::to_string(rotary_dim) + " must be even and in 2.." +
                      std::to_string(head_dim) + " (head_dim)");
    if (il != 0 && il != 1) throw OpError("attribute interleaved=" + std::to_string(il) + " must be 0 or 1");
    interleaved = il == 1;
    try_attr(info, "kernel", kernel_ref);
}

namespace {

void expect_type(const Input& in, ONNXTensorElementDataType t, const char* name, const char* what) {
    if (in.type != t)
        throw OpError(std::string("input ") + name + " is " + type_name(in.type) + "; it must be " + what);
}

}  // namespace

RotaryCall check_rotary(const RotaryAttrs& a, const Input& q, const Input& k, const Input& v, const Input& cos,
                        const Input& sin, const Input& pos) {
    RotaryCall c;
    c.H = a.num_heads, c.Hkv = a.kv_num_heads, c.D = a.head_dim;
    if (k.present() != v.present())
        throw OpError(std::string("input ") + (k.present() ? "v" : "k") + " is omitted but " +
                      (k.present() ? "k" : "v") + " is given; give both, or omit both (q packed [B, S, (H + 2*Hkv)*D])");
    c.packed = !k.present();
    const int64_t q_width = (c.packed ? c.H + 2 * c.Hkv : c.H) * c.D;
    if (q.shape.size() != 3 || q.shape[2] != q_width)
        throw OpError("input q has shape " + shape_str(q.shape) + ", expected [B, S, " + std::to_string(q_width) +
                      "] (" + (c.packed ? "packed Q | K | V, (num_heads + 2*kv_num_heads) * head_dim" :
                                          "num_heads * head_dim") + ")");
    c.B = q.shape[0], c.S = q.shape[1];
    if (!c.packed) {
        const std::vector<int64_t> kv{c.B, c.S, c.Hkv * c.D};
        expect_shape(k, kv, "k");
        expect_shape(v, kv, "v");
        if (k.type != q.type || v.type != q.type) throw OpError("inputs k and v must have q's element type");
        c.q_ss = c.H * c.D, c.k_ss = c.v_ss = c.Hkv * c.D;
        c.k_offset = c.v_offset = 0;
    } else {
        c.q_ss = c.k_ss = c.v_ss = q_width;
        c.k_offset = c.H * c.D, c.v_offset = (c.H + c.Hkv) * c.D;
    }
    expect_type(cos, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, "cos", "float (Cast the table to float)");
    expect_type(sin, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, "sin", "float (Cast the table to float)");
    if (cos.shape != sin.shape)
        throw OpError("inputs cos " + shape_str(cos.shape) + " and sin " + shape_str(sin.shape) +
                      " must have one shape");
    c.W = cos.shape.empty() ? 0 : cos.shape.back();
    if (c.W != a.rotary_dim && 2 * c.W != a.rotary_dim)
        throw OpError("input cos has shape " + shape_str(cos.shape) + ": its last dimension must be rotary_dim=" +
                      std::to_string(a.rotary_dim) + " (full tables) or " + std::to_string(a.rotary_dim / 2) +
                      " (half tables)");
    if (!pos.present()) {
        const auto& t = cos.shape;
        const bool rank2 = t.size() == 2 && t[0] == c.S;
        const bool rank3 = t.size() == 3 && (t[0] == 1 || t[0] == c.B) && t[1] == c.S;
        if (!rank2 && !rank3)
            throw OpError("input cos has shape " + shape_str(t) + ", expected [S, W] or [1 or B, S, W] with S=" +
                          std::to_string(c.S) + ", B=" + std::to_string(c.B) + " (or a [P, W] cache with position_ids)");
        c.t_sb = rank3 && t[0] == c.B && c.B > 1 ? c.S * c.W : 0;
        c.rows = c.S;
        c.pos_mode = 0;
    } else {
        expect_type(pos, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, "position_ids", "int64");
        if (cos.shape.size() != 2)
            throw OpError("input cos has shape " + shape_str(cos.shape) +
                          "; with position_ids it is a [P, W] cache (P positions)");
        c.rows = cos.shape[0];
        const auto& p = pos.shape;
        if (p.size() == 1 && p[0] == 1) {
            c.pos_mode = 2;
        } else if (p.size() == 2 && (p[0] == 1 || p[0] == c.B) && p[1] == c.S) {
            c.pos_mode = 1;
            c.pos_sb = p[0] == c.B && c.B > 1 ? c.S : 0;
        } else {
            throw OpError("input position_ids has shape " + shape_str(p) + ", expected [1] (an offset), [1, S] or "
                          "[B, S] with S=" + std::to_string(c.S) + ", B=" + std::to_string(c.B));
        }
    }
    return c;
}

template <typename T>
OrtStatusPtr RotaryCpu<T>::ComputeV2(OrtKernelContext* context) {
    return guarded("Rotary", [&] {
        Ort::KernelContext ctx(context);
        const Input q = get_input(ctx, 0), k = get_input(ctx, 1), v = get_input(ctx, 2), cos = get_input(ctx, 3),
                    sin = get_input(ctx, 4), pos = get_input(ctx, 5);
        const RotaryCall c = check_rotary(attrs, q, k, v, cos, sin, pos);
        auto out = ctx.GetOutput(0, c.out_shape());
        T* y = out.GetTensorMutableData<T>();
        if (c.B == 0 || c.S == 0) return;
        const int64_t* ids = pos.present() ? pos.data<int64_t>() : nullptr;
        // every token's table row, checked before anything is written
        std::vector<int64_t> row(static_cast<size_t>(c.B * c.S));
        for (int64_t b = 0; b < c.B; ++b)
            for (int64_t s = 0; s < c.S; ++s) {
                int64_t r = s;
                if (c.pos_mode == 1) r = ids[b * c.pos_sb + s];
                else if (c.pos_mode == 2) r = ids[0] + s;
                if (r < 0 || r >= c.rows)
                    throw OpError("position " + std::to_string(r) + " of token (" + std::to_string(b) + ", " +
                                  std::to_string(s) + ") is outside the " + std::to_string(c.rows) +
                                  "-row cos/sin cache");
                row[static_cast<size_t>(b * c.S + s)] = r;
            }
        const T* qp = q.data<T>();
        const T* kp = c.packed ? qp + c.k_offset : k.data<T>();
        const T* vp = c.packed ? qp + c.v_offset : v.data<T>();
        const float* ct = cos.data<float>();
        const float* st = sin.data<float>();
        const int64_t D = c.D, RD = attrs.rotary_dim, half = RD / 2, W = c.W, out_row = c.out_row();
        const bool half_table = 2 * W == RD, il = attrs.interleaved;

        auto rotate = [&](const T* x, T* dst, const float* cr, const float* sr) {
            for (int64_t i = 0; i < RD; ++i) {
                float r;
                if (il) r = (i % 2 == 0) ? -to_float(x[i + 1]) : to_float(x[i - 1]);
                else r = i < half ? -to_float(x[i + half]) : to_float(x[i - half]);
                const int64_t col = half_table ? (il ? i / 2 : i % half) : i;
                const float a = to_float(x[i]) * cr[col];
                const float b = r * sr[col];
                dst[i] = from_float<T>(a + b);
            }
            for (int64_t i = RD; i < D; ++i) dst[i] = x[i];
        };
        auto one_token = [&](size_t token) {
            const int64_t b = static_cast<int64_t>(token) / c.S, s = static_cast<int64_t>(token) % c.S;
            const int64_t base = (c.pos_mode == 0 ? b * c.t_sb : 0) + row[token] * W;
            T* dst = y + static_cast<int64_t>(token) * out_row;
            const T* qrow = qp + (b * c.S + s) * c.q_ss;
            const T* krow = kp + (b * c.S + s) * c.k_ss;
            const T* vrow = vp + (b * c.S + s) * c.v_ss;
            for (int64_t h = 0; h < c.H; ++h) rotate(qrow + h * D, dst + h * D, ct + base, st + base);
            for (int64_t h = 0; h < c.Hkv; ++h)
                rotate(krow + h * D, dst + (c.H + h) * D, ct + base, st + base);
            for (int64_t i = 0; i < c.Hkv * D; ++i) dst[(c.H + c.Hkv) * D + i] = vrow[i];
        };
        ctx.ParallelFor([](void* data, size_t i) { (*static_cast<decltype(one_token)*>(data))(i); },
                        static_cast<size_t>(c.B * c.S), 0, &one_token);
    });
}

template struct RotaryCpu<float>;
template struct RotaryCpu<Ort::Float16_t>;
template struct RotaryCpu<Ort::BFloat16_t>;

}  // namespace stofc_ort
