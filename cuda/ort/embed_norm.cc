// stofc ONNX Runtime custom-op library: EmbedLayerNorm's attributes, input checks and CPU twin.
//
// EmbedLayerNorm(ids_0, table_0, ids_1?, table_1?, ids_2?, table_2?, gamma, beta?) -> y (OPS.md,
// "EmbedLayerNorm"): y[b, s] = LayerNorm(sum_i table_i[ids_i[b, s]]) over the last axis, the
// ids broadcast to [B, S]; table 1 or 2 without its ids is gathered by position s. The CPU
// twin forms the sum in float in input order and the statistics in double (as AddLayerNorm's),
// rounding y once; an id outside [-V, V) fails the run before anything is written. The CUDA
// twin (cuda_embed.cc) launches norm/embed_norm.cu.j2, which writes NaN for that token's row
// instead (ids are device data there).
#include <cmath>
#include <string>
#include <vector>

#include "ops.h"

namespace stofc_ort {

EmbedNormAttrs::EmbedNormAttrs(const OrtKernelInfo* info) {
    try_attr(info, "epsilon", epsilon);
    if (!(epsilon >= 0.0f) || !std::isfinite(epsilon))
        throw OpError("attribute epsilon must be a finite number >= 0, got " + std::to_string(epsilon));
}

namespace {

std::string indexed(const char* name, int i) { return std::string(name) + "_" + std::to_string(i); }

/// Broadcasts `n` (ids_`i`'s size on `axis`) into `dim` (the ids' common size so far, -1 =
/// none yet); false when they do not broadcast.
bool broadcast(int64_t& dim, int64_t n) {
    if (dim < 0 || dim == 1) dim = n;
    return n == 1 || n == dim;
}

}  // namespace

EmbedCall check_embed_layer_norm(ONNXTensorElementDataType t, const Input (&ids)[kEmbedMaxSummands],
                                 const Input (&tables)[kEmbedMaxSummands], const Input& gamma, const Input& beta) {
    EmbedCall c;
    if (!ids[0].present() || !tables[0].present()) throw OpError("inputs ids_0 and table_0 are required");
    int64_t B = -1, S = -1;
    std::string first_ids;  // for messages: the shapes seen so far
    for (int i = 0; i < kEmbedMaxSummands; ++i) {
        const Input &id = ids[i], &table = tables[i];
        if (id.present() && !table.present())
            throw OpError("input " + indexed("table", i) + " is omitted but " + indexed("ids", i) +
                          " is given; give both, neither, or the table alone (rows by position)");
        if (!table.present()) continue;
        if (table.type != t)
            throw OpError("input " + indexed("table", i) + " is " + type_name(table.type) + " but table_0 is " +
                          type_name(t) + "; give every table in one type");
        if (table.shape.size() != 2 || (c.summands > 0 && table.shape[1] != c.C))
            throw OpError("input " + indexed("table", i) + " has shape " + shape_str(table.shape) +
                          (c.summands > 0 ? ", expected [V, " + std::to_string(c.C) + "] (table_0's width)"
                                          : ", expected [V, C]"));
        if (!id.present()) {  // pairs 1 and 2 only (ids_0 is required): rows by sequence position
            const int k = c.summands++;
            c.C = table.shape[1];
            c.slot[k] = i;
            c.V[k] = table.shape[0];
            c.positions[k] = true;
            continue;
        }
        if (id.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 && id.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32)
            throw OpError("input " + indexed("ids", i) + " is " + type_name(id.type) + "; it must be int64 or int32");
        if (id.shape.size() != 2 || !broadcast(B, id.shape[0]) || !broadcast(S, id.shape[1]))
            throw OpError("input " + indexed("ids", i) + " has shape " + shape_str(id.shape) +
                          ", expected [B or 1, S or 1]" +
                          (first_ids.empty() ? std::string() : " broadcasting with " + first_ids));
        first_ids += (first_ids.empty() ? "" : ", ") + shape_str(id.shape);
        const int k = c.summands++;
        c.C = table.shape[1];
        c.slot[k] = i;
        c.V[k] = table.shape[0];
        c.ids32[k] = id.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    }
    c.B = B, c.S = S;
    for (int k = 0; k < c.summands; ++k) {
        if (c.positions[k]) {
            c.sb[k] = 0, c.ss[k] = 1;
            continue;
        }
        const std::vector<int64_t>& s = ids[c.slot[k]].shape;
        c.sb[k] = s[0] > 1 ? s[1] : 0;
        c.ss[k] = s[1] > 1 ? 1 : 0;
    }
    if (!gamma.present()) throw OpError("input gamma is required");
    expect_shape(gamma, {c.C}, "gamma");
    const ONNXTensorElementDataType f32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    if (gamma.type != t && gamma.type != f32)
        throw OpError("input gamma is " + type_name(gamma.type) + "; EmbedLayerNorm with " + type_name(t) +
                      " tables takes gamma in " + type_name(t) + " or float");
    if (beta.present()) {
        expect_shape(beta, {c.C}, "beta");
        if (beta.type != gamma.type)
            throw OpError("input beta is " + type_name(beta.type) + " but gamma is " + type_name(gamma.type) +
                          "; give gamma and beta one type");
    }
    return c;
}

template <typename T>
OrtStatusPtr EmbedLayerNormCpu<T>::ComputeV2(OrtKernelContext* context) {
    return guarded("EmbedLayerNorm", [&] {
        Ort::KernelContext ctx(context);
        const Input ids[kEmbedMaxSummands] = {get_input(ctx, 0), get_input(ctx, 2), get_input(ctx, 4)};
        const Input tables[kEmbedMaxSummands] = {get_input(ctx, 1), get_input(ctx, 3), get_input(ctx, 5)};
        const Input gamma = get_input(ctx, 6), beta = get_input(ctx, 7);
        const EmbedCall c = check_embed_layer_norm(onnx_type<T>(), ids, tables, gamma, beta);
        auto out = ctx.GetOutput(0, c.out_shape());
        T* y = out.GetTensorMutableData<T>();
        const int64_t tokens = c.B * c.S, C = c.C, K = c.summands;
        if (tokens == 0 || C == 0) return;
        // every token's table rows, checked before anything is written
        std::vector<int64_t> rows(static_cast<size_t>(tokens * K));
        for (int64_t k = 0; k < K; ++k) {
            const Input& id = ids[c.slot[k]];
            for (int64_t b = 0; b < c.B; ++b)
                for (int64_t s = 0; s < c.S; ++s) {
                    const int64_t at = b * c.sb[k] + s * c.ss[k];
                    const int64_t raw = c.positions[k] ? at
                                        : c.ids32[k] ? id.data<int32_t>()[at] : id.data<int64_t>()[at];
                    const int64_t r = embed_table_row(raw, c.V[k]);
                    if (r < 0 && c.positions[k])
                        throw OpError("the sequence has " + std::to_string(c.S) + " tokens but " +
                                      indexed("table", c.slot[k]) + " (rows by position, no " +
                                      indexed("ids", c.slot[k]) + ") has " + std::to_string(c.V[k]) +
                                      " rows; run sequences of at most " + std::to_string(c.V[k]) + " tokens");
                    if (r < 0)
                        throw OpError("input " + indexed("ids", c.slot[k]) + " holds " + std::to_string(raw) +
                                      " for token (" + std::to_string(b) + ", " + std::to_string(s) +
                                      "), outside [-" + std::to_string(c.V[k]) + ", " + std::to_string(c.V[k]) +
                                      ") for the " + std::to_string(c.V[k]) + " rows of " +
                                      indexed("table", c.slot[k]));
                    rows[static_cast<size_t>((b * c.S + s) * K + k)] = r;
                }
        }
        const T* tp[kEmbedMaxSummands] = {nullptr, nullptr, nullptr};
        for (int64_t k = 0; k < K; ++k) tp[k] = tables[c.slot[k]].data<T>();
        const void* gp = gamma.value.GetTensorRawData();
        const void* bp = beta.present() ? beta.value.GetTensorRawData() : nullptr;
        const double eps = attrs.epsilon;

        auto one_token = [&](size_t token) {
            std::vector<float> h(static_cast<size_t>(C));
            const int64_t* r = rows.data() + token * static_cast<size_t>(K);
            double sum = 0.0;
            for (int64_t ch = 0; ch < C; ++ch) {
                float v = to_float(tp[0][r[0] * C + ch]);  // float, in input order
                for (int64_t k = 1; k < K; ++k) v += to_float(tp[k][r[k] * C + ch]);
                h[ch] = v;
                sum += v;
            }
            const double mean = sum / C;
            double sq = 0.0;  // two passes: no cancellation
            for (int64_t ch = 0; ch < C; ++ch) sq += (h[ch] - mean) * (h[ch] - mean);
            const double inv = 1.0 / std::sqrt(sq / C + eps);
            T* yr = y + static_cast<int64_t>(token) * C;
            for (int64_t ch = 0; ch < C; ++ch) {
                const double n = (h[ch] - mean) * inv * load_float(gp, gamma.type, ch) +
                                 (bp ? load_float(bp, beta.type, ch) : 0.0f);
                yr[ch] = from_float<T>(static_cast<float>(n));
            }
        };
        ctx.ParallelFor([](void* data, size_t i) { (*static_cast<decltype(one_token)*>(data))(i); },
                        static_cast<size_t>(tokens), 0, &one_token);
    });
}

template struct EmbedLayerNormCpu<float>;
template struct EmbedLayerNormCpu<Ort::Float16_t>;
template struct EmbedLayerNormCpu<Ort::BFloat16_t>;

}  // namespace stofc_ort
