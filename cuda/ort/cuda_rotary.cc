// stofc ONNX Runtime custom-op library: the CUDA twin of Rotary.
//
// Rotary(q, k?, v?, cos, sin, position_ids?) -> [Q' | K' | V] (OPS.md, "Rotary"): one launch
// of the stofc rotary kernel the node's `kernel` attribute names (templates/rope/rotary.cu.j2,
// compiled for the node's head_dim, rotary_dim and form; stofc.kernels.rotary) on ORT's
// compute stream: grid B*S (one block per token), the kernel's threads per block, no
// dynamic shared memory, no scratch, no synchronisation. The inputs are checked exactly as
// the CPU twin checks them (check_rotary); position ids are device data, so a position
// outside the cos/sin cache cannot fail the run here: the kernel writes NaN for that
// token's rotated elements instead (the CPU twin fails the run).
#include <cstdint>
#include <memory>
#include <string>

#include "cuda_module.h"
#include "ops.h"

namespace stofc_ort {

struct RotaryCuda {
    RotaryAttrs attrs;
    RotaryLaunch launch;
    std::unique_ptr<CudaModule> module;
    StreamContext streams;  // ORT's stream -> its CUDA context

    RotaryCuda(const OrtKernelInfo* info, const std::string& dir)
        : attrs(info), launch(checked_attrs([&] {
              return parse_rotary_launch(OrtAttrSource(info), attrs.head_dim, attrs.rotary_dim, attrs.interleaved);
          })) {
        module = load_package_module(dir, launch.kernel);
    }

    void compute(OrtKernelContext* context) {
        Ort::KernelContext ctx(context);
        const Input q = get_input(ctx, 0), k = get_input(ctx, 1), v = get_input(ctx, 2), cos = get_input(ctx, 3),
                    sin = get_input(ctx, 4), pos = get_input(ctx, 5);
        const RotaryCall c = check_rotary(attrs, q, k, v, cos, sin, pos);
        const bool bf16 = q.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
        if (!bf16 && q.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
            throw OpError("input q is " + type_name(q.type) + "; Rotary on CUDA takes float16 or bfloat16");
        if (launch.bf16 != bf16)
            throw OpError("kernel " + launch.kernel.entry + " is compiled for " + (bf16 ? "float16" : "bfloat16") +
                          " but the node's data is " + type_name(q.type) + "; rewrite the package for this dtype");
        auto out = ctx.GetOutput(0, c.out_shape());
        if (c.B == 0 || c.S == 0) return;
        if (c.B * c.S > 0x7fffffffLL || c.rows > 0x7fffffffLL || c.W > 0x7fffffffLL)
            throw OpError("input q " + shape_str(q.shape) + " is too large for one rotary launch");
        const char* qp = static_cast<const char*>(q.value.GetTensorRawData());
        const void* q_ptr = qp;
        const void* k_ptr = c.packed ? qp + 2 * c.k_offset : k.value.GetTensorRawData();
        const void* v_ptr = c.packed ? qp + 2 * c.v_offset : v.value.GetTensorRawData();
        void* out_ptr = out.GetTensorMutableRawData();
        const uintptr_t align = static_cast<uintptr_t>(2 * launch.vec);
        for (const void* p : {q_ptr, k_ptr, v_ptr, static_cast<const void*>(out_ptr)})
            if (reinterpret_cast<uintptr_t>(p) % align)
                throw OpError("an input or output address is not " + std::to_string(align) +
                              "-byte aligned (the kernel's vectors); ONNX Runtime's allocations always are");
        long long q_sb = c.S * c.q_ss, q_ss = c.q_ss, k_sb = c.S * c.k_ss, k_ss = c.k_ss, v_sb = c.S * c.v_ss,
                  v_ss = c.v_ss, t_sb = c.t_sb, pos_sb = c.pos_sb;
        const void* cos_ptr = cos.value.GetTensorRawData();
        const void* sin_ptr = sin.value.GetTensorRawData();
        const void* pos_ptr = pos.present() ? pos.value.GetTensorRawData() : cos_ptr;  // not read: pos_mode 0
        int W = static_cast<int>(c.W), pos_mode = c.pos_mode, rows = static_cast<int>(c.rows);
        int B = static_cast<int>(c.B), S = static_cast<int>(c.S), H = static_cast<int>(c.H),
            Hkv = static_cast<int>(c.Hkv);
        void* args[] = {&q_ptr,   &k_ptr,   &v_ptr, &out_ptr, &q_sb, &q_ss,   &k_sb, &k_ss, &v_sb, &v_ss, &cos_ptr,
                        &sin_ptr, &t_sb,    &W,     &pos_ptr, &pos_sb, &pos_mode, &rows, &B,  &S,   &H,   &Hkv};
        auto stream = static_cast<CUstream>(ctx.GetGPUComputeStream());
        CUfunction fn = module->function(streams.of(stream), stream);
        const Driver& drv = driver();
        drv.check(drv.LaunchKernel(fn, static_cast<unsigned>(c.B * c.S), 1, 1, static_cast<unsigned>(launch.threads),
                                   1, 1, 0, stream, args, nullptr),
                  "cuLaunchKernel(rotary)");
    }
};

RotaryCuda* make_rotary_cuda(const OrtKernelInfo* info, const std::string& dir) { return new RotaryCuda(info, dir); }
OrtStatusPtr compute(RotaryCuda* k, OrtKernelContext* c) {
    return guarded("Rotary", [&] { k->compute(c); });
}
void destroy(RotaryCuda* k) { delete k; }

}  // namespace stofc_ort
