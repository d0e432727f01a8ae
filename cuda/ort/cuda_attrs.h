// stofc ONNX Runtime custom-op library: the CUDA twins' launch attributes, parsed and checked.
//
// Plain C++ (no ONNX Runtime, no CUDA): the twins read their node attributes
// through an AttrSource (ORT's kernel info in cuda_ops.cc; a map in the unit test
// binary tests/unit/ortlib_attrs_test.cc), so every check here runs without a GPU.
// Every defect throws AttrError with one line naming the attribute and the fix;
// the twins turn it into a session-creation error. Contract: cuda/ort/OPS.md.
#ifndef STOFC_ORT_CUDA_ATTRS_H
#define STOFC_ORT_CUDA_ATTRS_H

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace stofc_ort {

/// The value of the `kernel_abi` attribute every CUDA twin requires (OPS.md).
constexpr int64_t kCudaLaunchAbi = 4;

struct AttrError : std::runtime_error {
    explicit AttrError(const std::string& msg) : std::runtime_error(msg) {}
};

/// Where attributes come from; false = absent.
struct AttrSource {
    virtual ~AttrSource() = default;
    virtual bool get_int(const char* name, int64_t& out) const = 0;
    virtual bool get_string(const char* name, std::string& out) const = 0;
    virtual bool get_ints(const char* name, std::vector<int64_t>& out) const = 0;
};

struct KernelRef {
    std::string file, entry;
};

/// "FILE:ENTRY" (the last ':' splits); throws AttrError naming `attr`.
KernelRef parse_kernel_ref(const std::string& ref, const char* attr);

/// The attention kernel kinds (KernelSpec.name's second token; the `*.plan.bin` kind
/// number): block-wise, row-wise and the warp-specialised Hopper kernel.
enum class KernelKind : int { kBlock = 0, kRow = 1, kWs = 2 };
/// "block", "row" or "ws".
const char* kind_name(KernelKind kind);

/// What an attention kernel's entry name says about its variant:
/// stofc_attn_{block|row|ws}_{f16|bf16}_...[_c]_b{0|1}_k{0|1} (KernelSpec.name; `_c`:
/// compiled with logit soft-capping).
struct AttentionVariant {
    KernelKind kind = KernelKind::kBlock;
    int64_t head_dim = 0;  // from the `d<N>` token after the dtype (0 when the name has none)
    bool bf16 = false;
    bool has_bias = false;
    bool has_key_bits = false;
    bool softcap = false;
};
AttentionVariant parse_attention_entry(const std::string& entry);

/// SparseAttention's CUDA attributes (kernel, kernel_abi, launch_plan, block_threads,
/// blocks_per_tile_row, smem_bytes), checked for range and consistency with the kernel's
/// kind (block-wise: 1 or 2 blocks per tile row and smem > 0; ws: 256, 384, 512 or 640
/// threads, 1 block per tile row, smem > 0); or one run-time variant (the i-th entry of the variant_*
/// attributes, OPS.md).
struct AttentionLaunch {
    KernelRef kernel;
    AttentionVariant variant;
    std::string plan_file;
    int64_t block_threads = 0, blocks_per_tile_row = 0, smem_bytes = 0;
    /// Variants only: eligible when S <= max_seq_len and B * ceil(S / T) <= max_batch_rows
    /// (0 = no limit on that); the base launch has both 0.
    int64_t max_seq_len = 0, max_batch_rows = 0;
    /// "'kernel'" for the base, "'variant_kernels[i]'" for variant i: names it in messages.
    std::string label;
    bool eligible(int64_t B, int64_t S, int64_t tile) const {
        return (max_seq_len == 0 || S <= max_seq_len) &&
               (max_batch_rows == 0 || B * ((S + tile - 1) / tile) <= max_batch_rows);
    }
};
AttentionLaunch parse_attention_launch(const AttrSource& attrs);

/// The run-time variants (variant_kernels, variant_launch_plans, variant_block_threads,
/// variant_blocks_per_tile_row, variant_smem_bytes, variant_max_seq_len,
/// variant_max_batch_rows), in attribute order; empty when the node has none. Every
/// variant is checked like the base and must be compiled for the base's dtype and
/// inputs (bias, key bits); the lists must have one entry each. Errors name the
/// attribute and the variant index ("attribute 'variant_block_threads[1]' ...").
std::vector<AttentionLaunch> parse_attention_variants(const AttrSource& attrs, const AttentionLaunch& base);

/// The index of the first variant eligible for a run of batch B and length S (mask tile
/// T), or -1: none is, the base launch runs.
int select_attention_variant(const std::vector<AttentionLaunch>& variants, int64_t B, int64_t S, int64_t tile);

/// An Epilogue tag (stofc.kernels.epilogue.Epilogue.tag): "plain" or parts joined by
/// '-' from: b, an activation (gelu_erf, gelu_tanh, relu), r, ln | rms, ns, s.
struct EpilogueTag {
    bool bias = false;
    std::string act = "none";
    bool residual = false;
    std::string norm = "none";
    bool norm_shift = true;
    bool store_pre_norm = false;
    std::string str() const;
    bool operator==(const EpilogueTag& o) const { return str() == o.str(); }
};
EpilogueTag parse_epilogue_tag(const std::string& tag);

/// The stofc Add+Norm kernel a FusedGemm / AddLayerNorm CUDA twin launches
/// (attributes epilogue_kernel, epilogue, epilogue_threads, epilogue_rows);
/// `present` is false when the node needs none (epilogue_kernel = "").
struct EpilogueLaunch {
    bool present = false;
    bool bf16 = false;  // from the entry name: stofc_add_norm_{float16|bfloat16}_...
    /// From the entry name, after the dtype: "f32in_" = x is float (a bf16 package's
    /// float pre-LN sum), then "f32p_" = gamma / beta are float (norm.py kernel_name).
    bool x_fp32 = false, params_fp32 = false;
    KernelRef kernel;
    EpilogueTag tag;
    int64_t threads = 0, rows = 0;
};
EpilogueLaunch parse_epilogue_launch(const AttrSource& attrs, const char* op);

/// What FusedGemm's CUDA twin does, mirroring SegmentRunner._compile_vendor with
/// cuBLASLt: the Lt epilogue (1 = DEFAULT, 4 = BIAS, 32 = GELU, 36 = GELU_BIAS: tanh
/// GELU only, without a residual), whether the residual joins
/// as C (beta = 1), and the rest, applied by the stofc epilogue kernel.
struct GemmSplit {
    int lt_epilogue = 1;
    bool lt_residual = false;
    EpilogueTag rest;  // no bias, no norm; identity = no kernel
    bool rest_is_identity() const { return rest.act == "none" && !rest.residual; }
};
GemmSplit split_fused_gemm(bool has_bias, const std::string& act, bool has_residual,
                           bool residual_after_activation);

/// The Epilogue an AddLayerNorm node's kernel must have been compiled for.
EpilogueTag add_layer_norm_epilogue(bool has_residual, bool rms, bool has_beta, bool has_sum);

/// Checks that `launch` fits the epilogue `want` (creation-time and run-time check).
void check_epilogue_matches(const EpilogueLaunch& launch, const EpilogueTag& want, const char* op);

/// The gated-activation kernel a GatedGemm CUDA twin launches after cuBLASLt (attributes
/// epilogue_kernel, epilogue_threads, epilogue_rows; OPS.md). The entry name
/// stofc_glu_{float16|bfloat16}_{act}_f{F}_t{tpr}x{rows} (stofc.kernels.glu) must name the
/// node's activation and no bias ("_b": cuBLASLt adds it here); F is checked per run.
struct GluLaunch {
    KernelRef kernel;
    bool bf16 = false;
    int64_t features = 0;
    int64_t threads = 0, rows = 0;
};
GluLaunch parse_glu_launch(const AttrSource& attrs, const std::string& activation);

/// The rotary kernel a Rotary CUDA twin launches (attribute `kernel`, OPS.md "Rotary"): the
/// entry stofc_rotary_{float16|bfloat16}_d{D}_r{rotary_dim}_{rh|il}_v{vec}_t{threads}
/// (stofc.kernels.rotary) must name the node's head_dim, rotary_dim and form.
struct RotaryLaunch {
    KernelRef kernel;
    bool bf16 = false;
    int64_t vec = 0, threads = 0;
};
RotaryLaunch parse_rotary_launch(const AttrSource& attrs, int64_t head_dim, int64_t rotary_dim,
                                 bool interleaved);

/// The kernel an EmbedLayerNorm CUDA twin launches (attribute `kernel`, OPS.md "EmbedLayerNorm"):
/// the entry stofc_embed_norm_{float16|bfloat16}[_f32p]_e{summands}_{ln|ln_ns}_n{C}_t{tpr}x{rows}
/// (stofc.kernels.embed_norm) says what it is compiled for; every run checks it against the
/// node's inputs (the summands present, beta, gamma's type, the tables' type and width).
struct EmbedNormLaunch {
    KernelRef kernel;
    bool bf16 = false, params_fp32 = false, has_beta = true;
    int64_t summands = 0, width = 0, tpr = 0, rows = 0;
    int64_t threads() const { return tpr * rows; }
};
EmbedNormLaunch parse_embed_norm_launch(const AttrSource& attrs);

/// FusedGemm's cuBLASLt algorithm choice (attributes lt_algo_m, lt_algo_rank; OPS.md):
/// a run with M rows uses the heuristic's result number rank_for(M), 0 (its best) for
/// an M that is not listed.
struct LtAlgoChoice {
    std::vector<int64_t> m, rank;
    int64_t rank_for(int64_t M) const {
        for (size_t i = 0; i < m.size(); ++i)
            if (m[i] == M) return rank[i];
        return 0;
    }
};
/// The largest lt_algo_rank accepted (cuBLASLt's heuristics return far fewer).
constexpr int64_t kLtMaxAlgoRank = 255;
LtAlgoChoice parse_lt_algo_choice(const AttrSource& attrs);

/// FusedGemm's Hopper GEMM (attributes hopper_gemm, hopper_gemm_min_m; OPS.md): a run with
/// M >= min_m rows launches the kernel `kernel` names (stofc.kernels.gemm_ws,
/// gemm/gemm_ws.cu.j2: act(x @ w + bias) in one pass) instead of cuBLASLt and the epilogue
/// kernel. The entry name says what it is compiled for:
/// stofc_gemm_ws_<float16|bfloat16>_<act>_b<0|1>_n<BN>_s<STAGES>_<coop|pp>_p<PASS>.
struct HopperGemmLaunch {
    bool present = false;
    KernelRef kernel;
    bool bf16 = false, bias = false, coop = true;
    std::string act;
    int64_t bn = 0, stages = 0, pass = 0, min_m = 0;
    int64_t bm() const { return coop ? 128 : 64; }
    /// Rows x columns of the output tiles the persistent grid walks.
    int64_t tiles(int64_t M, int64_t N) const { return ((M + bm() - 1) / bm()) * ((N + bn - 1) / bn); }
    /// The launch's dynamic shared memory (GemmWsConfig.smem_bytes): the ring, the staged
    /// epilogue rows of eight warps, the ring's barriers, 1024 bytes of alignment slack.
    int64_t smem() const { return stages * 8192 * (bm() / 64 + bn / 64) + 8 * 16 * (2 * pass + 16) + 16 * stages + 1024; }
    static constexpr int kThreads = 384;
    static constexpr int64_t kSmemLimit = 232448;
};
/// Absent hopper_gemm (or empty): present = false. AttrError for a malformed one.
HopperGemmLaunch parse_hopper_gemm(const AttrSource& attrs);

/// Requires kernel_abi == kCudaLaunchAbi.
void require_cuda_abi(const AttrSource& attrs, const char* op);

}  // namespace stofc_ort

#endif  // STOFC_ORT_CUDA_ATTRS_H
