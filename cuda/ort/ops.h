// stofc ONNX Runtime custom-op library: the op declarations (domain ai.stofc, v1).
//
// Every op exists twice: a CPU twin (a straightforward C++ reference, float,
// float16 and bfloat16) and a CUDA twin (float16 and bfloat16, device pointers,
// ORT's compute stream).
// The contract (inputs, attributes, semantics) is cuda/ort/OPS.md. Op objects
// are created per RegisterCustomOps call and carry the package directory that
// relative file attributes (mask_file, kernel) are resolved against.
#ifndef STOFC_ORT_OPS_H
#define STOFC_ORT_OPS_H

#include <memory>
#include <string>

#include "common.h"
#include "mask_file.h"

namespace stofc_ort {

// ---------------------------------------------------------------- kernels

/// Attributes of SparseAttention shared by both twins, validated at creation.
struct AttentionAttrs {
    int64_t num_heads = 0;
    int64_t kv_num_heads = 0;  // K/V heads (grouped-query attention); = num_heads by default
    int64_t head_dim = 0;
    float scale = 0.0f;
    float softcap = 0.0f;      // > 0: scores become softcap * tanh(scale * q.k / softcap)
    std::string mask_path;   // resolved absolute path of mask.bin
    std::string kernel_ref;  // "kernels/x.cubin:entry" (CUDA twin only)
    std::shared_ptr<const MaskData> mask;
    AttentionAttrs(const OrtKernelInfo* info, const std::string& package_dir);
};

/// The checked geometry of one SparseAttention call (shared by both twins).
struct AttentionCall {
    int64_t B = 0, S = 0, H = 0, D = 0;
    int64_t Hkv = 0;  // K/V heads: query head h reads K/V head h / (H / Hkv)
    bool has_kpm = false, has_bias = false;
    int64_t bias_sb = 0, bias_sh = 0;  // element strides of bias (0 = broadcast)
    /// Packed QKV (k and v omitted): q is [B, S, (H + 2*Hkv)*D] = [Q | K | V]. The
    /// element pointers of q, k, v are q + 0, q + k_offset, q + v_offset, each with
    /// sequence stride in_row ((H + 2*Hkv)*D packed; else q's is H*D and k's and v's
    /// kv_row = Hkv*D: they are their own tensors then).
    bool packed = false;
    int64_t in_row = 0, kv_row = 0, k_offset = 0, v_offset = 0;
    /// The K/V head query head h reads.
    int64_t kv_head(int64_t h) const { return h / (H / Hkv); }
    /// key_state (input 5, from KeyPrep) given: its size is checked against (B, S).
    bool has_key_state = false;
    /// out is always [B, S, H*D].
    std::vector<int64_t> out_shape() const { return {B, S, H * D}; }
};

/// Validates q, k, v, key_padding_mask, bias and key_state against the node and its
/// mask; throws OpError naming the input, its shape and the expected one. k and v are
/// both given ([B, S, Hkv*D]; q is [B, S, H*D]) or both omitted (q packed
/// [B, S, (H + 2*Hkv)*D]); one of them alone is an error. key_state needs key_padding_mask and must be uint8
/// [key_state_layout(B, S).bytes].
AttentionCall check_attention(const AttentionAttrs& attrs, const Input& q, const Input& k, const Input& v,
                              const Input& kpm, const Input& bias, const Input& key_state = Input());

/// KeyPrep's output (OPS.md): int32 kv_len [B] at byte 0, then (256-aligned) the
/// uint64 key bits [B, words] at byte `words_at`; `bytes` in all. The same layout as
/// the CUDA twin of SparseAttention's own scratch.
struct KeyStateLayout {
    int64_t B = 0, S = 0, words = 0, words_at = 0, bytes = 0;
};
inline KeyStateLayout key_state_layout(int64_t B, int64_t S) {
    KeyStateLayout l;
    l.B = B;
    l.S = S;
    l.words = (S + 63) / 64;
    l.words_at = (4 * B + 255) / 256 * 256;
    l.bytes = l.words_at + 8 * B * l.words;
    return l;
}

/// Checks a key_padding_mask [B, S] (int64, int32 or bool) given to `op`'s input
/// `name`; returns the key-prep kernel's kpm_type (1 int64, 2 int32, 3 bool).
int check_key_padding_mask(const Input& kpm, const char* name = "key_padding_mask");

/// KeyPrep(key_padding_mask) -> key_state, the CPU twin: the documented bytes on the host.
struct KeyPrepCpu {
    explicit KeyPrepCpu(const OrtKernelInfo*) {}
    OrtStatusPtr ComputeV2(OrtKernelContext* context);
};

template <typename T>
struct SparseAttentionCpu {
    AttentionAttrs attrs;
    SparseAttentionCpu(const OrtKernelInfo* info, const std::string& package_dir) : attrs(info, package_dir) {}
    OrtStatusPtr ComputeV2(OrtKernelContext* context);
};

/// The epilogue of FusedGemm.
enum class Activation { kNone, kGeluErf, kGeluTanh };

struct GemmAttrs {
    Activation activation = Activation::kNone;
    bool residual_after_activation = true;
    std::string kernel_ref;
    explicit GemmAttrs(const OrtKernelInfo* info);
};

template <typename T>
struct FusedGemmCpu {
    GemmAttrs attrs;
    explicit FusedGemmCpu(const OrtKernelInfo* info) : attrs(info) {}
    OrtStatusPtr ComputeV2(OrtKernelContext* context);
};

/// GatedGemm's activation of the gate half (OPS.md): SwiGLU, GeGLU (erf / tanh), ReGLU.
enum class GatedActivation { kSilu, kGeluErf, kGeluTanh, kRelu };
/// "silu", "gelu_erf", "gelu_tanh" or "relu".
const char* gated_activation_name(GatedActivation a);
/// act(x) in float, as the CPU twin and the gated-activation kernel compute it.
float gated_activation(float x, GatedActivation a);

struct GatedAttrs {
    GatedActivation activation = GatedActivation::kSilu;
    std::string kernel_ref;
    explicit GatedAttrs(const OrtKernelInfo* info);
};

/// GatedGemm's shapes, checked once for both twins: x [..., K], w [K, 2F] (= [Wg | Wu]),
/// bias [2F]; y = [..., F]. Element types: w and bias are x's type.
struct GatedShapes {
    int64_t M, K, F;
    std::vector<int64_t> y;
};
GatedShapes check_gated_gemm(const Input& x, const Input& w, const Input& bias);

template <typename T>
struct GatedGemmCpu {
    GatedAttrs attrs;
    explicit GatedGemmCpu(const OrtKernelInfo* info) : attrs(info) {}
    OrtStatusPtr ComputeV2(OrtKernelContext* context);
};

/// Rotary's attributes (OPS.md, "Rotary"), validated at creation by both twins.
struct RotaryAttrs {
    int64_t num_heads = 0, kv_num_heads = 0, head_dim = 0, rotary_dim = 0;
    bool interleaved = false;
    std::string kernel_ref;  // CUDA twin only
    explicit RotaryAttrs(const OrtKernelInfo* info);
};

/// The checked geometry of one Rotary call (both twins). q [B, S, H*D] with k, v
/// [B, S, Hkv*D], or q packed [B, S, (H + 2*Hkv)*D] (k and v omitted): element offsets of
/// K and V in q (packed) and each input's sequence stride. cos / sin float [S, W],
/// [1 or B, S, W] (t_sb: the batch stride, 0 = shared) or, with position_ids, a [P, W]
/// cache: pos_mode 0 = row s, 1 = position_ids [1 or B, S] (pos_sb = S or 0), 2 = the
/// offset position_ids[0] + s; `rows` table rows. W = rotary_dim or rotary_dim / 2.
struct RotaryCall {
    int64_t B = 0, S = 0, H = 0, Hkv = 0, D = 0, W = 0;
    bool packed = false;
    int64_t q_ss = 0, k_ss = 0, v_ss = 0, k_offset = 0, v_offset = 0;
    int64_t t_sb = 0, rows = 0, pos_sb = 0;
    int pos_mode = 0;
    int64_t out_row() const { return (H + 2 * Hkv) * D; }
    std::vector<int64_t> out_shape() const { return {B, S, out_row()}; }
};
RotaryCall check_rotary(const RotaryAttrs& attrs, const Input& q, const Input& k, const Input& v,
                        const Input& cos, const Input& sin, const Input& position_ids);

template <typename T>
struct RotaryCpu {
    RotaryAttrs attrs;
    explicit RotaryCpu(const OrtKernelInfo* info) : attrs(info) {}
    OrtStatusPtr ComputeV2(OrtKernelContext* context);
};

struct NormAttrs {
    float epsilon = 1e-5f;
    bool rms = false;
    std::string kernel_ref;
    explicit NormAttrs(const OrtKernelInfo* info);
};

template <typename T>
struct AddLayerNormCpu {
    NormAttrs attrs;
    explicit AddLayerNormCpu(const OrtKernelInfo* info) : attrs(info) {}
    OrtStatusPtr ComputeV2(OrtKernelContext* context);
};

/// EmbedLayerNorm's attributes (OPS.md, "EmbedLayerNorm"), validated at creation by both twins.
struct EmbedNormAttrs {
    float epsilon = 1e-5f;
    explicit EmbedNormAttrs(const OrtKernelInfo* info);
};

/// The most tables one EmbedLayerNorm sums (its input pairs ids_i, table_i).
constexpr int kEmbedMaxSummands = 3;

/// The checked geometry of one EmbedLayerNorm call (both twins). The summands are the
/// present (ids_i, table_i) pairs, in input order: summand k is pair slot[k]. Ids are
/// [B or 1, S or 1] (broadcast to [B, S]; sb / ss: the element strides of batch and
/// sequence, 0 = broadcast), int64 or int32 (ids32); table k has V[k] rows of C. A table
/// given without its ids (pairs 1 and 2 only) is gathered by sequence position: positions[k],
/// sb 0, ss 1 (the position is the row).
struct EmbedCall {
    int64_t B = 0, S = 0, C = 0;
    int summands = 0;
    int slot[kEmbedMaxSummands] = {0, 0, 0};
    int64_t sb[kEmbedMaxSummands] = {0, 0, 0}, ss[kEmbedMaxSummands] = {0, 0, 0};
    int64_t V[kEmbedMaxSummands] = {0, 0, 0};
    bool ids32[kEmbedMaxSummands] = {false, false, false};
    bool positions[kEmbedMaxSummands] = {false, false, false};
    std::vector<int64_t> out_shape() const { return {B, S, C}; }
};

/// Validates EmbedLayerNorm's inputs for tables of element type `t` (OPS.md): ids_0 and
/// table_0 given, no ids without its table (a table without its ids: positions), ids int64 /
/// int32 of rank 2 broadcasting to [B, S], tables [V_i, C] in t, gamma [C] in t or float,
/// beta [C] in gamma's type. Throws OpError naming the input.
EmbedCall check_embed_layer_norm(ONNXTensorElementDataType t, const Input (&ids)[kEmbedMaxSummands],
                                 const Input (&tables)[kEmbedMaxSummands], const Input& gamma, const Input& beta);

/// The table row of one id: negative ids count from the end (ONNX Gather); -1 outside [-V, V).
inline int64_t embed_table_row(int64_t id, int64_t V) {
    if (id < 0) id += V;
    return id >= 0 && id < V ? id : -1;
}

template <typename T>
struct EmbedLayerNormCpu {
    EmbedNormAttrs attrs;
    explicit EmbedLayerNormCpu(const OrtKernelInfo* info) : attrs(info) {}
    OrtStatusPtr ComputeV2(OrtKernelContext* context);
};

/// The CUDA twins (cuda_ops.cc). Created only when a node is assigned to the CUDA EP.
struct EmbedLayerNormCuda;
EmbedLayerNormCuda* make_embed_layer_norm_cuda(const OrtKernelInfo* info, const std::string& package_dir);
OrtStatusPtr compute(EmbedLayerNormCuda* k, OrtKernelContext* context);
void destroy(EmbedLayerNormCuda* k);
struct SparseAttentionCuda;
struct FusedGemmCuda;
struct AddLayerNormCuda;
struct GatedGemmCuda;
struct KeyPrepCuda;
struct RotaryCuda;
RotaryCuda* make_rotary_cuda(const OrtKernelInfo* info, const std::string& package_dir);
OrtStatusPtr compute(RotaryCuda* k, OrtKernelContext* context);
void destroy(RotaryCuda* k);
SparseAttentionCuda* make_sparse_attention_cuda(const OrtKernelInfo* info, const std::string& package_dir);
KeyPrepCuda* make_key_prep_cuda(const OrtKernelInfo* info, const std::string& package_dir);
OrtStatusPtr compute(KeyPrepCuda* k, OrtKernelContext* context);
void destroy(KeyPrepCuda* k);
FusedGemmCuda* make_fused_gemm_cuda(const OrtKernelInfo* info, const std::string& package_dir);
AddLayerNormCuda* make_add_layer_norm_cuda(const OrtKernelInfo* info, const std::string& package_dir);
GatedGemmCuda* make_gated_gemm_cuda(const OrtKernelInfo* info, const std::string& package_dir);
OrtStatusPtr compute(GatedGemmCuda* k, OrtKernelContext* context);
void destroy(GatedGemmCuda* k);
OrtStatusPtr compute(SparseAttentionCuda* k, OrtKernelContext* context);
OrtStatusPtr compute(FusedGemmCuda* k, OrtKernelContext* context);
OrtStatusPtr compute(AddLayerNormCuda* k, OrtKernelContext* context);
void destroy(SparseAttentionCuda* k);
void destroy(FusedGemmCuda* k);
void destroy(AddLayerNormCuda* k);

/// Owns an opaque CUDA kernel object behind the ComputeV2 interface CustomOpBase wants.
template <typename K>
struct CudaKernelHandle {
    K* impl;
    explicit CudaKernelHandle(K* k) : impl(k) {}
    ~CudaKernelHandle() { destroy(impl); }
    CudaKernelHandle(const CudaKernelHandle&) = delete;
    CudaKernelHandle& operator=(const CudaKernelHandle&) = delete;
    OrtStatusPtr ComputeV2(OrtKernelContext* context) { return compute(impl, context); }
};

// ---------------------------------------------------------------- op descriptions

/// The shape of one op: name, input types (UNDEFINED = checked at run time),
/// optional inputs and outputs.
struct OpSignature {
    const char* name;
    int inputs;
    int first_optional_input;           // inputs at or past this index are optional ...
    unsigned optional_input_mask;       // ... plus these (bit i = input i optional)
    unsigned any_type_input_mask;       // bit i = input i accepts any type (checked in Compute)
    int outputs;
    unsigned optional_output_mask;
};

// k and v (inputs 1, 2) are optional: both omitted = packed QKV in q (OPS.md).
// Input 5 is key_state (uint8, from KeyPrep), typed "any" and checked in Compute like
// key_padding_mask (input 3), so the element type T stays the op's one constraint.
constexpr OpSignature kSparseAttentionSig{"SparseAttention", 6, 3, (1u << 1) | (1u << 2), (1u << 3) | (1u << 5),
                                          1, 0u};
// KeyPrep(key_padding_mask) -> key_state: registered once per provider with elem = uint8
// (its output type); the mask's type (int64, int32, bool) is checked in Compute.
constexpr OpSignature kKeyPrepSig{"KeyPrep", 1, 1, 0u, 1u << 0, 1, 0u};
constexpr OpSignature kFusedGemmSig{"FusedGemm", 4, 2, 0u, 0u, 1, 0u};
constexpr OpSignature kAddLayerNormSig{"AddLayerNorm", 4, 4, (1u << 1) | (1u << 3), 0u, 2, 1u << 1};
// GatedGemm(x, w, bias?) -> y: act(x @ w[:, :F] + b[:F]) * (x @ w[:, F:] + b[F:]) (OPS.md).
constexpr OpSignature kGatedGemmSig{"GatedGemm", 3, 2, 0u, 0u, 1, 0u};
// Rotary(q, k?, v?, cos, sin, position_ids?) -> qkv (OPS.md): k and v optional (both omitted =
// q packed); cos and sin are float (kRotaryF32In); position_ids (int64) is checked in Compute.
constexpr OpSignature kRotarySig{"Rotary", 6, 5, (1u << 1) | (1u << 2), 1u << 5, 1, 0u};
// EmbedLayerNorm(ids_0, table_0, ids_1?, table_1?, ids_2?, table_2?, gamma, beta?) -> y (OPS.md): the
// tables are T; the ids (int64 or int32) and gamma / beta (T or float) are typed "any" and checked
// in Compute, so the tables' type alone picks the registration (and y's type).
constexpr OpSignature kEmbedLayerNormSig{"EmbedLayerNorm", 8, 7, (1u << 2) | (1u << 3) | (1u << 4) | (1u << 5),
                                         (1u << 0) | (1u << 2) | (1u << 4) | (1u << 6) | (1u << 7), 1, 0u};

/// Every (op, element type, execution provider) RegisterCustomOps registers, in order.
/// stofc_ort.cc registers exactly these; the unit test binary prints them.
/// `float_inputs` / `float_outputs` (bit i = input / output i) are typed float
/// instead of `elem`; `any_inputs` accept any type (checked in Compute). The
/// mixed forms are the bfloat16 packages' float pre-LN path (OPS.md): FusedGemm with
/// a float bias writes a float y; AddLayerNorm takes x in T or float and float
/// gamma / beta. Each differs from the plain T registration in at least one input
/// type, so ORT's type inference (first registration whose input types match)
/// and kernel lookup pick one registration per node.
struct Registration {
    const OpSignature* sig;
    ONNXTensorElementDataType elem;
    bool cuda;  // CUDAExecutionProvider twin (else the CPU twin)
    unsigned float_inputs = 0u, float_outputs = 0u, any_inputs = 0u;
};
constexpr ONNXTensorElementDataType kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr ONNXTensorElementDataType kF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr ONNXTensorElementDataType kBF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
constexpr ONNXTensorElementDataType kU8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
// FusedGemm (x, w, bias float, residual) -> y float; AddLayerNorm (x any, residual, gamma float, beta float).
constexpr unsigned kGemmF32In = 1u << 2, kGemmF32Out = 1u << 0;
constexpr unsigned kNormAnyIn = 1u << 0, kNormF32In = (1u << 2) | (1u << 3);
constexpr unsigned kRotaryF32In = (1u << 3) | (1u << 4);  // Rotary's cos and sin
constexpr Registration kRegistrations[] = {
    {&kSparseAttentionSig, kF32, false}, {&kFusedGemmSig, kF32, false}, {&kAddLayerNormSig, kF32, false},
    {&kSparseAttentionSig, kF16, false}, {&kFusedGemmSig, kF16, false}, {&kAddLayerNormSig, kF16, false},
    {&kSparseAttentionSig, kBF16, false}, {&kFusedGemmSig, kBF16, false}, {&kAddLayerNormSig, kBF16, false},
    {&kFusedGemmSig, kBF16, false, kGemmF32In, kGemmF32Out, 0u},
    {&kAddLayerNormSig, kBF16, false, kNormF32In, 0u, kNormAnyIn},
    {&kSparseAttentionSig, kF16, true},  {&kFusedGemmSig, kF16, true},  {&kAddLayerNormSig, kF16, true},
    {&kSparseAttentionSig, kBF16, true}, {&kFusedGemmSig, kBF16, true}, {&kAddLayerNormSig, kBF16, true},
    {&kFusedGemmSig, kBF16, true, kGemmF32In, kGemmF32Out, 0u},
    {&kAddLayerNormSig, kBF16, true, kNormF32In, 0u, kNormAnyIn},
    {&kKeyPrepSig, kU8, false},          {&kKeyPrepSig, kU8, true},
    {&kGatedGemmSig, kF32, false},       {&kGatedGemmSig, kF16, false},
    {&kGatedGemmSig, kBF16, false},      {&kGatedGemmSig, kF16, true},
    {&kGatedGemmSig, kBF16, true},
    {&kRotarySig, kF32, false, kRotaryF32In},  {&kRotarySig, kF16, false, kRotaryF32In},
    {&kRotarySig, kBF16, false, kRotaryF32In}, {&kRotarySig, kF16, true, kRotaryF32In},
    {&kRotarySig, kBF16, true, kRotaryF32In},
    {&kEmbedLayerNormSig, kF32, false},  {&kEmbedLayerNormSig, kF16, false},
    {&kEmbedLayerNormSig, kBF16, false}, {&kEmbedLayerNormSig, kF16, true},
    {&kEmbedLayerNormSig, kBF16, true},
};

/// One registered op: a signature, an element type, an execution provider and a
/// factory for its kernel. TKernel is created by `Make(info, package_dir)`.
template <typename TKernel, typename Make>
struct StofcOp : Ort::CustomOpBase<StofcOp<TKernel, Make>, TKernel, true> {
    OpSignature sig;
    ONNXTensorElementDataType elem;
    const char* ep;  // nullptr = CPU
    std::string package_dir;
    Make make;
    unsigned float_inputs = 0u, float_outputs = 0u, any_inputs = 0u;  // as in Registration

    StofcOp(OpSignature s, ONNXTensorElementDataType t, const char* provider, std::string dir, Make m,
            unsigned f32_in = 0u, unsigned f32_out = 0u, unsigned any_in = 0u)
        : sig(s), elem(t), ep(provider), package_dir(std::move(dir)), make(m), float_inputs(f32_in),
          float_outputs(f32_out), any_inputs(any_in) {}

    OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
        std::string label = sig.name;
        try {
            const std::string node = Ort::ConstKernelInfo(info).GetNodeName();
            if (!node.empty()) label += " (node '" + node + "')";
        } catch (const Ort::Exception&) {
        }
        return guarded(label.c_str(), [&] { *kernel = make(info, package_dir); });
    }
    const char* GetName() const { return sig.name; }
    const char* GetExecutionProviderType() const { return ep; }
    size_t GetInputTypeCount() const { return static_cast<size_t>(sig.inputs); }
    ONNXTensorElementDataType GetInputType(size_t i) const {
        if (((sig.any_type_input_mask | any_inputs) >> i) & 1u) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
        return (float_inputs >> i) & 1u ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : elem;
    }
    OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
        const bool opt = static_cast<int>(i) >= sig.first_optional_input || ((sig.optional_input_mask >> i) & 1u);
        return opt ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
    }
    size_t GetOutputTypeCount() const { return static_cast<size_t>(sig.outputs); }
    ONNXTensorElementDataType GetOutputType(size_t i) const {
        return (float_outputs >> i) & 1u ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : elem;
    }
    OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
        return (sig.optional_output_mask >> i) & 1u ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
    }
};

}  // namespace stofc_ort

#endif  // STOFC_ORT_OPS_H
