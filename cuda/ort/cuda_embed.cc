// stofc ONNX Runtime custom-op library: the CUDA twin of EmbedLayerNorm.
//
// EmbedLayerNorm(ids_0, table_0, ids_1?, table_1?, ids_2?, table_2?, gamma, beta?) -> y (OPS.md,
// "EmbedLayerNorm"): one launch of the stofc kernel the node's `kernel` attribute names
// (templates/norm/embed_norm.cu.j2, compiled for the dtype, the number of summands, beta, float
// gamma / beta and the width C; stofc.kernels.embed_norm) on ORT's compute stream: grid
// ceil(B*S / rows), tpr*rows threads, no dynamic shared memory, no scratch, no synchronisation.
// The inputs are checked exactly as the CPU twin checks them (check_embed_layer_norm), then
// against what the kernel is compiled for. Ids are device data, so an id outside [-V, V) cannot
// fail the run here: the kernel writes NaN for that token's row instead (the CPU twin fails the
// run). The present summands go into the kernel's slots 0..K-1 in input order; the other
// slots' pointers are any valid pointer (not read). A table without its ids (rows by
// position) gets a null ids pointer and strides 0, 1: the kernel reads row s.
#include <climits>
#include <cstdint>
#include <memory>
#include <string>

#include "cuda_module.h"
#include "ops.h"

namespace stofc_ort {

struct EmbedLayerNormCuda {
    EmbedNormAttrs attrs;
    EmbedNormLaunch launch;
    std::unique_ptr<CudaModule> module;
    StreamContext streams;  // ORT's stream -> its CUDA context

    EmbedLayerNormCuda(const OrtKernelInfo* info, const std::string& dir)
        : attrs(info), launch(checked_attrs([&] { return parse_embed_norm_launch(OrtAttrSource(info)); })) {
        module = load_package_module(dir, launch.kernel);
    }

    void compute(OrtKernelContext* context) {
        Ort::KernelContext ctx(context);
        const Input ids[kEmbedMaxSummands] = {get_input(ctx, 0), get_input(ctx, 2), get_input(ctx, 4)};
        const Input tables[kEmbedMaxSummands] = {get_input(ctx, 1), get_input(ctx, 3), get_input(ctx, 5)};
        const Input gamma = get_input(ctx, 6), beta = get_input(ctx, 7);
        const ONNXTensorElementDataType t = tables[0].type;
        const bool bf16 = t == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
        if (!bf16 && t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
            throw OpError("input table_0 is " + type_name(t) + "; EmbedLayerNorm on CUDA takes float16 or bfloat16");
        const EmbedCall c = check_embed_layer_norm(t, ids, tables, gamma, beta);
        const bool params_fp32 = gamma.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
        const EmbedNormLaunch& l = launch;
        if (l.bf16 != bf16 || l.summands != c.summands || l.has_beta != beta.present() ||
            l.params_fp32 != params_fp32 || l.width != c.C)
            throw OpError("kernel " + l.kernel.entry + " is compiled for " + (l.bf16 ? "bfloat16" : "float16") +
                          " tables of width " + std::to_string(l.width) + ", " + std::to_string(l.summands) +
                          " summand(s), gamma " + (l.params_fp32 ? "float" : "in the tables' type") +
                          (l.has_beta ? " and beta" : " and no beta") + " but the node gives " + type_name(t) +
                          " tables of width " + std::to_string(c.C) + ", " + std::to_string(c.summands) +
                          " summand(s), gamma " + type_name(gamma.type) + (beta.present() ? " and beta" : " and no beta") +
                          "; rewrite the package");
        auto out = ctx.GetOutput(0, c.out_shape());
        const int64_t tokens = c.B * c.S;
        if (tokens == 0) return;
        if (tokens > INT_MAX || c.C > INT_MAX)
            throw OpError("output " + shape_str(c.out_shape()) + " is too large for one EmbedLayerNorm launch");
        void* out_ptr = out.GetTensorMutableRawData();
        const void* ids_ptr[kEmbedMaxSummands];
        const void* table_ptr[kEmbedMaxSummands];
        long long sb[kEmbedMaxSummands] = {0, 0, 0}, ss[kEmbedMaxSummands] = {0, 0, 0},
                  V[kEmbedMaxSummands] = {0, 0, 0};
        int ids32 = 0;
        for (int k = 0; k < kEmbedMaxSummands; ++k) {
            const int at = k < c.summands ? k : 0;  // slots past the summands: not read
            ids_ptr[k] = c.positions[at] ? nullptr : ids[c.slot[at]].value.GetTensorRawData();  // null: positions
            table_ptr[k] = tables[c.slot[at]].value.GetTensorRawData();
            if (k >= c.summands) continue;
            sb[k] = c.sb[k], ss[k] = c.ss[k], V[k] = c.V[k];
            ids32 |= c.ids32[k] ? 1 << k : 0;
        }
        const void* gamma_ptr = gamma.value.GetTensorRawData();
        const void* beta_ptr = beta.present() ? beta.value.GetTensorRawData() : gamma_ptr;  // not read
        for (const void* p : {table_ptr[0], table_ptr[1], table_ptr[2], gamma_ptr, beta_ptr,
                              static_cast<const void*>(out_ptr)})
            if (reinterpret_cast<uintptr_t>(p) % 16)
                throw OpError("a table, gamma, beta or the output is not 16-byte aligned (the kernel's vectors); "
                              "ONNX Runtime's allocations always are");
        int B = static_cast<int>(c.B), S = static_cast<int>(c.S), C = static_cast<int>(c.C);
        float eps = attrs.epsilon;
        void* args[] = {&ids_ptr[0], &ids_ptr[1], &ids_ptr[2], &table_ptr[0], &table_ptr[1], &table_ptr[2],
                        &gamma_ptr,  &beta_ptr,   &out_ptr,    &sb[0],        &ss[0],        &sb[1],
                        &ss[1],      &sb[2],      &ss[2],      &V[0],         &V[1],         &V[2],
                        &ids32,      &B,          &S,          &C,            &eps};
        auto stream = static_cast<CUstream>(ctx.GetGPUComputeStream());
        CUfunction fn = module->function(streams.of(stream), stream);
        const Driver& drv = driver();
        const int64_t grid = (tokens + l.rows - 1) / l.rows;
        drv.check(drv.LaunchKernel(fn, static_cast<unsigned>(grid), 1, 1, static_cast<unsigned>(l.threads()), 1, 1, 0,
                                   stream, args, nullptr),
                  "cuLaunchKernel(embed_norm)");
    }
};

EmbedLayerNormCuda* make_embed_layer_norm_cuda(const OrtKernelInfo* info, const std::string& dir) {
    return new EmbedLayerNormCuda(info, dir);
}
OrtStatusPtr compute(EmbedLayerNormCuda* k, OrtKernelContext* c) {
    return guarded("EmbedLayerNorm", [&] { k->compute(c); });
}
void destroy(EmbedLayerNormCuda* k) { delete k; }

}  // namespace stofc_ort
