// stofc ONNX Runtime custom-op library: the CPU twins (reference implementations).
//
// Straightforward and exact to the contract in OPS.md, accumulating in float
// (statistics of the norms in double). Work is spread over ORT's intra-op
// thread pool with KernelContext::ParallelFor, one query row / GEMM row / norm
// row per item.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"

namespace stofc_ort {
namespace {

template <typename Fn>
void parallel_for(const Ort::KernelContext& ctx, size_t total, Fn& fn) {
    if (total == 0) return;
    ctx.ParallelFor([](void* data, size_t i) { (*static_cast<Fn*>(data))(i); }, total, 0, &fn);
}

/// key_padding_mask [B, S] as one byte per key (1 = real token).
std::vector<uint8_t> key_valid(const Input& kpm, int64_t B, int64_t S) {
    std::vector<uint8_t> valid(static_cast<size_t>(B * S), 1);
    if (!kpm.present()) return valid;  // shape and type checked by check_attention
    const size_t n = valid.size();
    switch (kpm.type) {
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
            for (size_t i = 0; i < n; ++i) valid[i] = kpm.data<int64_t>()[i] != 0;
            break;
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
            for (size_t i = 0; i < n; ++i) valid[i] = kpm.data<int32_t>()[i] != 0;
            break;
        case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL:
            for (size_t i = 0; i < n; ++i) valid[i] = kpm.data<bool>()[i];
            break;
        default:
            throw OpError("input key_padding_mask must be int64, int32 or bool");
    }
    return valid;
}

float gelu(float x, Activation a) {
    switch (a) {
        case Activation::kGeluErf:
            return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f));
        case Activation::kGeluTanh:
            return 0.5f * x * (1.0f + std::tanh(0.79788456080286536f * (x + 0.044715f * x * x * x)));
        case Activation::kNone:
            break;
    }
    return x;
}

}  // namespace

template <typename T>
OrtStatusPtr SparseAttentionCpu<T>::ComputeV2(OrtKernelContext* context) {
    return guarded("SparseAttention", [&] {
        Ort::KernelContext ctx(context);
        const Input q = get_input(ctx, 0), k = get_input(ctx, 1), v = get_input(ctx, 2);
        const Input kpm = get_input(ctx, 3), bias = get_input(ctx, 4);
        // key_state (input 5) is checked but not read: the mask itself is at hand here.
        const AttentionCall c = check_attention(attrs, q, k, v, kpm, bias, get_input(ctx, 5));
        const int64_t B = c.B, S = c.S, H = c.H, D = c.D, bias_sb = c.bias_sb, bias_sh = c.bias_sh;
        const MaskData& m = *attrs.mask;
        const std::vector<uint8_t> valid = key_valid(kpm, B, S);
        auto out = ctx.GetOutput(0, c.out_shape());
        T* o = out.GetTensorMutableData<T>();
        const T* qp = q.data<T>();
        const T* kp = c.packed ? qp + c.k_offset : k.data<T>();  // packed QKV: K and V follow Q in q's rows
        const T* vp = c.packed ? qp + c.v_offset : v.data<T>();
        const T* bp = bias.present() ? bias.data<T>() : nullptr;
        const int64_t row = H * D;     // elements between consecutive positions of out
        const int64_t in_row = c.in_row;  // ... of q ((H + 2*Hkv)*D when packed)
        const int64_t kv_row = c.kv_row;  // ... of k and v
        const float scale = attrs.scale;
        const float cap = attrs.softcap;  // > 0: soft-capped scores (before bias and mask)

        auto one_row = [&](size_t item) {
            const int64_t qi = static_cast<int64_t>(item) % S;
            const int64_t h = (static_cast<int64_t>(item) / S) % H;
            const int64_t b = static_cast<int64_t>(item) / (S * H);
            const int mh = m.num_heads == 1 ? 0 : static_cast<int>(h);
            const T* qrow = qp + b * S * in_row + qi * in_row + h * D;
            const int64_t kh = c.kv_head(h);
            std::vector<float> qf(D), acc(D, 0.0f);
            for (int64_t d = 0; d < D; ++d) qf[d] = to_float(qrow[d]);
            std::vector<int> keys;
            std::vector<float> scores;
            const uint8_t* kv_valid = valid.data() + b * S;
            const T* brow = bp ? bp + b * bias_sb + h * bias_sh + qi * S : nullptr;
            m.for_each_tile(mh, static_cast<int>(qi), static_cast<int>(S), [&](int k0, int k1, int part) {
                for (int key = k0; key < k1; ++key) {
                    if (!kv_valid[key]) continue;
                    if (part >= 0 && !m.part_bit(part, static_cast<int>(qi), key)) continue;
                    const T* krow = kp + b * S * kv_row + key * kv_row + kh * D;
                    float s = 0.0f;
                    for (int64_t d = 0; d < D; ++d) s += qf[d] * to_float(krow[d]);
                    s *= scale;
                    if (cap > 0.0f) s = cap * std::tanh(s / cap);
                    if (brow) s += to_float(brow[key]);
                    keys.push_back(key);
                    scores.push_back(s);
                }
            });
            float mx = -std::numeric_limits<float>::infinity();
            for (float s : scores) mx = s > mx ? s : mx;
            T* orow = o + b * S * row + qi * row + h * D;
            if (keys.empty() || mx == -std::numeric_limits<float>::infinity()) {
                for (int64_t d = 0; d < D; ++d) orow[d] = from_float<T>(0.0f);  // no allowed key
                return;
            }
            float denom = 0.0f;
            for (size_t j = 0; j < keys.size(); ++j) {
                const float p = std::exp(scores[j] - mx);
                denom += p;
                const T* vrow = vp + b * S * kv_row + keys[j] * kv_row + kh * D;
                for (int64_t d = 0; d < D; ++d) acc[d] += p * to_float(vrow[d]);
            }
            for (int64_t d = 0; d < D; ++d) orow[d] = from_float<T>(acc[d] / denom);
        };
        parallel_for(ctx, static_cast<size_t>(B * H * S), one_row);
    });
}

template <typename T>
OrtStatusPtr FusedGemmCpu<T>::ComputeV2(OrtKernelContext* context) {
    return guarded("FusedGemm", [&] {
        Ort::KernelContext ctx(context);
        const Input x = get_input(ctx, 0), w = get_input(ctx, 1), bias = get_input(ctx, 2),
                    res = get_input(ctx, 3);
        const GemmShapes g = check_fused_gemm(x, w, bias, res);
        // y is T, or float with a float bias (bfloat16 packages' pre-LN GEMM, OPS.md)
        const ONNXTensorElementDataType yt =
            check_fused_gemm_types(x, w, bias, res, attrs.activation != Activation::kNone);
        const int64_t K = g.K, N = g.N, M = g.M;
        const std::vector<int64_t>& yshape = g.y;
        auto out = ctx.GetOutput(0, yshape);
        void* y = out.GetTensorMutableRawData();
        std::vector<float> wf(static_cast<size_t>(K * N));
        for (size_t i = 0; i < wf.size(); ++i) wf[i] = to_float(w.data<T>()[i]);
        const T* xp = x.data<T>();
        const void* bp = bias.present() ? bias.value.GetTensorRawData() : nullptr;
        const T* rp = res.present() ? res.data<T>() : nullptr;
        const Activation act = attrs.activation;
        const bool after = attrs.residual_after_activation;

        auto one_row = [&](size_t mi) {
            std::vector<float> acc(static_cast<size_t>(N), 0.0f);
            const T* xr = xp + static_cast<int64_t>(mi) * K;
            for (int64_t kk = 0; kk < K; ++kk) {
                const float xv = to_float(xr[kk]);
                const float* wr = wf.data() + kk * N;
                for (int64_t n = 0; n < N; ++n) acc[n] += xv * wr[n];
            }
            const int64_t row = static_cast<int64_t>(mi) * N;
            const T* rr = rp ? rp + row : nullptr;
            for (int64_t n = 0; n < N; ++n) {
                float t = acc[n] + (bp ? load_float(bp, bias.type, n) : 0.0f);
                if (rr && !after) t += to_float(rr[n]);
                t = gelu(t, act);
                if (rr && after) t += to_float(rr[n]);
                store_float(y, yt, row + n, t);
            }
        };
        parallel_for(ctx, static_cast<size_t>(M), one_row);
    });
}

template <typename T>
OrtStatusPtr AddLayerNormCpu<T>::ComputeV2(OrtKernelContext* context) {
    return guarded("AddLayerNorm", [&] {
        Ort::KernelContext ctx(context);
        const Input x = get_input(ctx, 0), res = get_input(ctx, 1), gamma = get_input(ctx, 2),
                    beta = get_input(ctx, 3);
        const NormShapes shapes = check_add_layer_norm(x, res, gamma, beta);
        // x may be float and gamma / beta float where y is bfloat16 (OPS.md)
        check_add_layer_norm_types(onnx_type<T>(), x, res, gamma, beta);
        const int64_t M = shapes.M, C = shapes.C;
        auto out = ctx.GetOutput(0, x.shape);
        T* y = out.GetTensorMutableData<T>();
        T* sum_out = nullptr;
        if (ctx.GetOutputCount() > 1) {
            auto s = ctx.GetOutput(1, x.shape);
            if (static_cast<OrtValue*>(s) != nullptr) sum_out = s.GetTensorMutableData<T>();
        }
        const void* xp = x.value.GetTensorRawData();
        const T* rp = res.present() ? res.data<T>() : nullptr;
        const void* gp = gamma.value.GetTensorRawData();
        const void* bp = beta.present() ? beta.value.GetTensorRawData() : nullptr;
        const bool rms = attrs.rms;
        const double eps = attrs.epsilon;

        auto one_row = [&](size_t mi) {
            const int64_t base = static_cast<int64_t>(mi) * C;
            std::vector<float> h(static_cast<size_t>(C));
            double sum = 0.0;
            for (int64_t c = 0; c < C; ++c) {
                h[c] = load_float(xp, x.type, base + c) + (rp ? to_float(rp[base + c]) : 0.0f);
                if (sum_out) sum_out[base + c] = from_float<T>(h[c]);
                sum += h[c];
            }
            const double mean = rms ? 0.0 : sum / C;  // RMSNorm: no centring
            double sq = 0.0;                          // two passes: no cancellation
            for (int64_t c = 0; c < C; ++c) sq += (h[c] - mean) * (h[c] - mean);
            const double inv = 1.0 / std::sqrt(sq / C + eps);
            for (int64_t c = 0; c < C; ++c) {
                const double n = (h[c] - mean) * inv * load_float(gp, gamma.type, c) +
                                 (bp ? load_float(bp, beta.type, c) : 0.0f);
                y[base + c] = from_float<T>(static_cast<float>(n));
            }
        };
        parallel_for(ctx, static_cast<size_t>(M), one_row);
    });
}

OrtStatusPtr KeyPrepCpu::ComputeV2(OrtKernelContext* context) {
    return guarded("KeyPrep", [&] {
        Ort::KernelContext ctx(context);
        const Input kpm = get_input(ctx, 0);
        if (!kpm.present()) throw OpError("input key_padding_mask is required");
        check_key_padding_mask(kpm);
        const KeyStateLayout l = key_state_layout(kpm.shape[0], kpm.shape[1]);
        auto out = ctx.GetOutput(0, {l.bytes});
        uint8_t* bytes = out.GetTensorMutableData<uint8_t>();
        std::memset(bytes, 0, static_cast<size_t>(l.bytes));  // the padding before the words too
        const std::vector<uint8_t> valid = key_valid(kpm, l.B, l.S);
        for (int64_t b = 0; b < l.B; ++b) {
            int32_t last = 0;  // 1 + the last real key, 0 when none (key_prep.cu)
            std::vector<uint64_t> words(static_cast<size_t>(l.words), 0);
            for (int64_t key = 0; key < l.S; ++key) {
                if (!valid[static_cast<size_t>(b * l.S + key)]) continue;
                words[static_cast<size_t>(key / 64)] |= uint64_t{1} << (key % 64);
                last = static_cast<int32_t>(key + 1);
            }
            std::memcpy(bytes + 4 * b, &last, 4);  // little-endian hosts only, like the CUDA twin
            if (l.words)
                std::memcpy(bytes + l.words_at + 8 * b * l.words, words.data(), static_cast<size_t>(8 * l.words));
        }
    });
}

template struct SparseAttentionCpu<float>;
template struct SparseAttentionCpu<Ort::Float16_t>;
template struct FusedGemmCpu<float>;
template struct FusedGemmCpu<Ort::Float16_t>;
template struct AddLayerNormCpu<float>;
template struct AddLayerNormCpu<Ort::Float16_t>;
template struct SparseAttentionCpu<Ort::BFloat16_t>;
template struct FusedGemmCpu<Ort::BFloat16_t>;
template struct AddLayerNormCpu<Ort::BFloat16_t>;

}  // namespace stofc_ort
