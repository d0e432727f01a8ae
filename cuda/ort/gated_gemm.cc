// stofc ONNX Runtime custom-op library: GatedGemm's attributes, shapes and CPU twin.
//
// GatedGemm(x, w, bias?) -> y is a gated FFN's projection (OPS.md): with
// t = x @ w + bias ([..., 2F], w = [Wg | Wu]), y = act(t[..., :F]) * t[..., F:].
// The CPU twin accumulates in float and rounds y once; the CUDA twin
// (cuda_gated_gemm.cc) has cuBLASLt write t in the element type first.
#include <cmath>
#include <vector>

#include "ops.h"

namespace stofc_ort {

const char* gated_activation_name(GatedActivation a) {
    switch (a) {
        case GatedActivation::kSilu:
            return "silu";
        case GatedActivation::kGeluErf:
            return "gelu_erf";
        case GatedActivation::kGeluTanh:
            return "gelu_tanh";
        case GatedActivation::kRelu:
            return "relu";
    }
    return "?";
}

float gated_activation(float x, GatedActivation a) {
    switch (a) {
        case GatedActivation::kSilu:
            return x / (1.0f + std::exp(-x));
        case GatedActivation::kGeluErf:
            return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f));
        case GatedActivation::kGeluTanh:
            return 0.5f * x * (1.0f + std::tanh(0.79788456080286536f * (x + 0.044715f * x * x * x)));
        case GatedActivation::kRelu:
            return x > 0.0f ? x : 0.0f;
    }
    return x;
}

GatedAttrs::GatedAttrs(const OrtKernelInfo* info) {
    const std::string act = require_attr<std::string>(info, "activation");
    if (act == "silu") activation = GatedActivation::kSilu;
    else if (act == "gelu_erf") activation = GatedActivation::kGeluErf;
    else if (act == "gelu_tanh") activation = GatedActivation::kGeluTanh;
    else if (act == "relu") activation = GatedActivation::kRelu;
    else throw OpError("attribute activation='" + act + "' is not one of silu, gelu_erf, gelu_tanh, relu");
    try_attr(info, "kernel", kernel_ref);
}

GatedShapes check_gated_gemm(const Input& x, const Input& w, const Input& bias) {
    if (x.shape.empty()) throw OpError("input x must have rank >= 1");
    if (w.shape.size() != 2 || w.shape[0] != x.shape.back() || w.shape[1] % 2)
        throw OpError("input w has shape " + shape_str(w.shape) + ", expected [K, 2F] with K=" +
                      std::to_string(x.shape.back()) + " (the last dimension of x " + shape_str(x.shape) +
                      ") and an even width (the gate and up halves)");
    if (w.type != x.type)
        throw OpError("input w is " + type_name(w.type) + " but x is " + type_name(x.type) + "; give w in x's type");
    GatedShapes g{0, w.shape[0], w.shape[1] / 2, x.shape};
    g.M = g.K ? numel(x.shape) / g.K : 0;
    g.y.back() = g.F;
    if (bias.present()) {
        expect_shape(bias, {2 * g.F}, "bias");
        if (bias.type != x.type)
            throw OpError("input bias is " + type_name(bias.type) + " but x is " + type_name(x.type) +
                          "; give bias in x's type");
    }
    return g;
}

template <typename T>
OrtStatusPtr GatedGemmCpu<T>::ComputeV2(OrtKernelContext* context) {
    return guarded("GatedGemm", [&] {
        Ort::KernelContext ctx(context);
        const Input x = get_input(ctx, 0), w = get_input(ctx, 1), bias = get_input(ctx, 2);
        const GatedShapes g = check_gated_gemm(x, w, bias);
        const int64_t K = g.K, F = g.F, N = 2 * g.F, M = g.M;
        auto out = ctx.GetOutput(0, g.y);
        T* y = out.GetTensorMutableData<T>();
        if (M == 0 || F == 0) return;
        std::vector<float> wf(static_cast<size_t>(K * N));
        for (size_t i = 0; i < wf.size(); ++i) wf[i] = to_float(w.data<T>()[i]);
        std::vector<float> bf(static_cast<size_t>(N), 0.0f);
        if (bias.present())
            for (int64_t n = 0; n < N; ++n) bf[n] = to_float(bias.data<T>()[n]);
        const T* xp = x.data<T>();
        const GatedActivation act = attrs.activation;

        auto one_row = [&](size_t mi) {
            std::vector<float> acc(bf);
            const T* xr = xp + static_cast<int64_t>(mi) * K;
            for (int64_t kk = 0; kk < K; ++kk) {
                const float xv = to_float(xr[kk]);
                const float* wr = wf.data() + kk * N;
                for (int64_t n = 0; n < N; ++n) acc[n] += xv * wr[n];
            }
            T* yr = y + static_cast<int64_t>(mi) * F;
            for (int64_t f = 0; f < F; ++f) yr[f] = from_float<T>(gated_activation(acc[f], act) * acc[F + f]);
        };
        ctx.ParallelFor([](void* data, size_t i) { (*static_cast<decltype(one_row)*>(data))(i); },
                        static_cast<size_t>(M), 0, &one_row);
    });
}

template struct GatedGemmCpu<float>;
template struct GatedGemmCpu<Ort::Float16_t>;
template struct GatedGemmCpu<Ort::BFloat16_t>;

}  // namespace stofc_ort
