// stofc ONNX Runtime custom-op library: launch-attribute parsing (see cuda_attrs.h).
#include "cuda_attrs.h"

#include <vector>

#include "attention_abi.h"

namespace stofc_ort {
namespace {

int64_t get_positive(const AttrSource& a, const char* name, const char* op, int64_t max) {
    int64_t v = 0;
    if (!a.get_int(name, v))
        throw AttrError(std::string("attribute '") + name + "' is required to run " + op +
                        " on the CUDA execution provider; rewrite the package with 'stofc compile'");
    if (v < 1 || v > max)
        throw AttrError(std::string("attribute '") + name + "' = " + std::to_string(v) + " is outside 1.." +
                        std::to_string(max) + "; the package is damaged, rewrite it with 'stofc compile'");
    return v;
}

std::vector<std::string> split(const std::string& s, char sep) {
    std::vector<std::string> out;
    size_t at = 0;
    while (true) {
        const size_t next = s.find(sep, at);
        out.push_back(s.substr(at, next == std::string::npos ? std::string::npos : next - at));
        if (next == std::string::npos) return out;
        at = next + 1;
    }
}

}  // namespace

KernelRef parse_kernel_ref(const std::string& ref, const char* attr) {
    const auto colon = ref.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == ref.size())
        throw AttrError(std::string("attribute '") + attr + "' must be 'FILE.cubin:ENTRY', got '" + ref + "'");
    return {ref.substr(0, colon), ref.substr(colon + 1)};
}

const char* kind_name(KernelKind kind) {
    switch (kind) {
        case KernelKind::kBlock:
            return "block";
        case KernelKind::kRow:
            return "row";
        case KernelKind::kWs:
            return "ws";
    }
    return "?";
}

AttentionVariant parse_attention_entry(const std::string& entry) {
    // stofc_attn_{kind}_{dt}_d.._t.._w.._m.._s.._q.._o..[_wg][_pp][_k2][_p2|_p4][_f][_c]_b{0|1}_k{0|1}
    const auto parts = split(entry, '_');
    const auto bad = [&] {
        return AttrError("attention kernel entry '" + entry +
                         "' is not a stofc attention kernel (stofc_attn_<block|row|ws>_<f16|bf16>_..._b<0|1>_k<0|1>)");
    };
    if (parts.size() < 6 || parts[0] != "stofc" || parts[1] != "attn") throw bad();
    AttentionVariant v;
    if (parts[2] == "block") v.kind = KernelKind::kBlock;
    else if (parts[2] == "row") v.kind = KernelKind::kRow;
    else if (parts[2] == "ws") v.kind = KernelKind::kWs;
    else throw bad();
    if (parts[3] == "f16") v.bf16 = false;
    else if (parts[3] == "bf16") v.bf16 = true;
    else throw bad();
    const std::string& d = parts[4];
    if (d.size() > 1 && d.size() < 6 && d[0] == 'd' && d.find_first_not_of("0123456789", 1) == std::string::npos)
        v.head_dim = std::stoll(d.substr(1));
    const std::string& b = parts[parts.size() - 2];
    const std::string& k = parts[parts.size() - 1];
    if ((b != "b0" && b != "b1") || (k != "k0" && k != "k1")) throw bad();
    v.has_bias = b == "b1";
    v.has_key_bits = k == "k1";
    v.softcap = parts[parts.size() - 3] == "c";
    return v;
}

void require_cuda_abi(const AttrSource& a, const char* op) {
    int64_t abi = 0;
    if (!a.get_int("kernel_abi", abi))
        throw AttrError(std::string("this ") + op + " node carries no CUDA launch attributes (kernel_abi " +
                        std::to_string(kCudaLaunchAbi) +
                        "); rewrite the package with a stofc that writes them, or run it on the "
                        "CPUExecutionProvider");
    if (abi != kCudaLaunchAbi)
        throw AttrError(std::string("attribute kernel_abi=") + std::to_string(abi) + " but this library launches " +
                        "kernel_abi " + std::to_string(kCudaLaunchAbi) +
                        "; rebuild the package and its library with one stofc version");
}

namespace {

/// The attribute a launch number comes from: `base` for the node's base launch
/// (index < 0), `variant[index]` for a run-time variant.
std::string attr_name(int index, const char* base, const char* variant) {
    return index < 0 ? std::string(base) : std::string(variant) + "[" + std::to_string(index) + "]";
}

/// Range and consistency checks shared by the base launch and every variant.
void check_launch_numbers(const AttentionLaunch& l, int index) {
    const auto outside = [&](const char* base, const char* variant, int64_t v, int64_t lo, int64_t hi) {
        if (v < lo || v > hi)
            throw AttrError("attribute '" + attr_name(index, base, variant) + "' = " + std::to_string(v) +
                            " is outside " + std::to_string(lo) + ".." + std::to_string(hi) +
                            "; the package is damaged, rewrite it with 'stofc compile'");
    };
    outside("block_threads", "variant_block_threads", l.block_threads, 1, 1024);
    if (l.block_threads % 32)
        throw AttrError("attribute '" + attr_name(index, "block_threads", "variant_block_threads") + "' = " +
                        std::to_string(l.block_threads) +
                        " is not a whole number of warps; the package is damaged, rewrite it");
    outside("blocks_per_tile_row", "variant_blocks_per_tile_row", l.blocks_per_tile_row, 1, 128);
    const KernelKind kind = l.variant.kind;
    if (kind == KernelKind::kBlock && l.blocks_per_tile_row > 2)
        throw AttrError("attribute '" + attr_name(index, "blocks_per_tile_row", "variant_blocks_per_tile_row") +
                        "' = " + std::to_string(l.blocks_per_tile_row) +
                        " but a block-wise kernel splits a tile row in 1 or 2 (q_split); rewrite the package");
    if (kind == KernelKind::kWs && l.blocks_per_tile_row != 1)
        throw AttrError("attribute '" + attr_name(index, "blocks_per_tile_row", "variant_blocks_per_tile_row") +
                        "' = " + std::to_string(l.blocks_per_tile_row) +
                        " but a warp-specialised kernel takes 1 (its grid comes from the launch plan's work "
                        "items); rewrite the package");
    if (kind == KernelKind::kWs && l.block_threads != ws_threads(1) && l.block_threads != ws_threads(2) &&
        l.block_threads != ws_threads(3) && l.block_threads != ws_threads(4))
        throw AttrError("attribute '" + attr_name(index, "block_threads", "variant_block_threads") + "' = " +
                        std::to_string(l.block_threads) + " but a warp-specialised kernel runs " +
                        std::to_string(ws_threads(1)) + ", " + std::to_string(ws_threads(2)) + ", " +
                        std::to_string(ws_threads(3)) + " or " + std::to_string(ws_threads(4)) +
                        " threads (a producer and 1 to 4 consumer warpgroups); rewrite the package");
    outside("smem_bytes", "variant_smem_bytes", l.smem_bytes, 0, 256 * 1024);
    if (kind != KernelKind::kRow && l.smem_bytes == 0)
        throw AttrError("attribute '" + attr_name(index, "smem_bytes", "variant_smem_bytes") + "' is required (> 0) for a " +
                        (kind == KernelKind::kWs ? "warp-specialised" : "block-wise") +
                        " attention kernel; rewrite the package with 'stofc compile'");
}

}  // namespace

AttentionLaunch parse_attention_launch(const AttrSource& a) {
    const char* op = "SparseAttention";
    require_cuda_abi(a, op);
    AttentionLaunch l;
    l.label = "'kernel'";
    std::string ref;
    if (!a.get_string("kernel", ref) || ref.empty())
        throw AttrError("attribute 'kernel' (FILE.cubin:ENTRY) is required to run SparseAttention on the CUDA "
                        "execution provider");
    l.kernel = parse_kernel_ref(ref, "kernel");
    l.variant = parse_attention_entry(l.kernel.entry);
    if (!a.get_string("launch_plan", l.plan_file) || l.plan_file.empty())
        throw AttrError("attribute 'launch_plan' (the kernel's *.plan.bin) is required to run SparseAttention on "
                        "the CUDA execution provider; rewrite the package with 'stofc compile'");
    l.block_threads = get_positive(a, "block_threads", op, 1024);
    l.blocks_per_tile_row = get_positive(a, "blocks_per_tile_row", op, 128);
    l.smem_bytes = 0;
    a.get_int("smem_bytes", l.smem_bytes);
    check_launch_numbers(l, -1);
    return l;
}

std::vector<AttentionLaunch> parse_attention_variants(const AttrSource& a, const AttentionLaunch& base) {
    std::string kernels, plans;
    a.get_string("variant_kernels", kernels);
    a.get_string("variant_launch_plans", plans);
    const std::vector<std::string> refs = kernels.empty() ? std::vector<std::string>{} : split(kernels, ';');
    const size_t n = refs.size();
    const auto count_error = [&](const char* name, size_t got) {
        return AttrError("attribute '" + std::string(name) + "' has " + std::to_string(got) +
                         " entries but 'variant_kernels' names " + std::to_string(n) +
                         " variants; every variant_* attribute needs one entry per variant, rewrite the package");
    };
    const std::vector<std::string> plan_files = plans.empty() ? std::vector<std::string>{} : split(plans, ';');
    if (plan_files.size() != n) throw count_error("variant_launch_plans", plan_files.size());
    const char* int_names[] = {"variant_block_threads", "variant_blocks_per_tile_row", "variant_smem_bytes",
                               "variant_max_seq_len", "variant_max_batch_rows"};
    std::vector<int64_t> lists[5];
    for (int j = 0; j < 5; ++j) {
        a.get_ints(int_names[j], lists[j]);
        if (lists[j].size() != n) throw count_error(int_names[j], lists[j].size());
    }
    std::vector<AttentionLaunch> out;
    for (size_t i = 0; i < n; ++i) {
        const int idx = static_cast<int>(i);
        const std::string kname = attr_name(idx, "kernel", "variant_kernels");
        AttentionLaunch l;
        l.label = "'" + kname + "'";
        if (refs[i].empty())
            throw AttrError("attribute '" + kname + "' is empty; it must be 'FILE.cubin:ENTRY', rewrite the package");
        l.kernel = parse_kernel_ref(refs[i], kname.c_str());
        try {
            l.variant = parse_attention_entry(l.kernel.entry);
        } catch (const AttrError& e) {
            throw AttrError("attribute '" + kname + "': " + e.what());
        }
        const AttentionVariant& v = l.variant;
        if (v.bf16 != base.variant.bf16 || v.has_bias != base.variant.has_bias ||
            v.has_key_bits != base.variant.has_key_bits || v.softcap != base.variant.softcap)
            throw AttrError("attribute '" + kname + "' names " + l.kernel.entry +
                            ", compiled for other inputs or another dtype than 'kernel' (" + base.kernel.entry +
                            "); every variant must be compiled for the node's dtype, bias and key_padding_mask");
        l.plan_file = plan_files[i];
        if (l.plan_file.empty())
            throw AttrError("attribute '" + attr_name(idx, "launch_plan", "variant_launch_plans") +
                            "' is empty; it must name the variant's *.plan.bin, rewrite the package");
        l.block_threads = lists[0][i];
        l.blocks_per_tile_row = lists[1][i];
        l.smem_bytes = lists[2][i];
        l.max_seq_len = lists[3][i];
        l.max_batch_rows = lists[4][i];
        check_launch_numbers(l, idx);
        if (l.max_seq_len < 0 || l.max_batch_rows < 0)
            throw AttrError("attribute '" +
                            attr_name(idx, "", l.max_seq_len < 0 ? "variant_max_seq_len" : "variant_max_batch_rows") +
                            "' = " + std::to_string(l.max_seq_len < 0 ? l.max_seq_len : l.max_batch_rows) +
                            " is negative (0 = no limit); rewrite the package");
        out.push_back(l);
    }
    return out;
}

int select_attention_variant(const std::vector<AttentionLaunch>& variants, int64_t B, int64_t S, int64_t tile) {
    for (size_t i = 0; i < variants.size(); ++i)
        if (variants[i].eligible(B, S, tile)) return static_cast<int>(i);
    return -1;
}

LtAlgoChoice parse_lt_algo_choice(const AttrSource& a) {
    LtAlgoChoice c;
    a.get_ints("lt_algo_m", c.m);
    a.get_ints("lt_algo_rank", c.rank);
    if (c.m.size() != c.rank.size())
        throw AttrError("attributes 'lt_algo_m' (" + std::to_string(c.m.size()) + " entries) and 'lt_algo_rank' (" +
                        std::to_string(c.rank.size()) + " entries) must have one entry each; rewrite the package");
    for (size_t i = 0; i < c.m.size(); ++i) {
        const std::string at = "[" + std::to_string(i) + "]";
        if (c.m[i] < 1)
            throw AttrError("attribute 'lt_algo_m" + at + "' = " + std::to_string(c.m[i]) +
                            " is not a row count >= 1; rewrite the package");
        for (size_t j = 0; j < i; ++j)
            if (c.m[j] == c.m[i])
                throw AttrError("attribute 'lt_algo_m" + at + "' = " + std::to_string(c.m[i]) + " repeats lt_algo_m[" +
                                std::to_string(j) + "]; give each M one rank, rewrite the package");
        if (c.rank[i] < 0 || c.rank[i] > kLtMaxAlgoRank)
            throw AttrError("attribute 'lt_algo_rank" + at + "' = " + std::to_string(c.rank[i]) + " is outside 0.." +
                            std::to_string(kLtMaxAlgoRank) + "; rewrite the package");
    }
    return c;
}

std::string EpilogueTag::str() const {
    std::vector<std::string> parts;
    if (bias) parts.push_back("b");
    if (act != "none") parts.push_back(act);
    if (residual) parts.push_back("r");
    if (norm == "layernorm") parts.push_back("ln");
    if (norm == "rmsnorm") parts.push_back("rms");
    if (norm != "none" && !norm_shift) parts.push_back("ns");
    if (store_pre_norm) parts.push_back("s");
    if (parts.empty()) return "plain";
    std::string out = parts[0];
    for (size_t i = 1; i < parts.size(); ++i) out += "-" + parts[i];
    return out;
}

EpilogueTag parse_epilogue_tag(const std::string& tag) {
    EpilogueTag t;
    if (tag == "plain") return t;
    for (const auto& p : split(tag, '-')) {
        if (p == "b") t.bias = true;
        else if (p == "gelu_erf" || p == "gelu_tanh" || p == "relu") t.act = p;
        else if (p == "r") t.residual = true;
        else if (p == "ln") t.norm = "layernorm";
        else if (p == "rms") t.norm = "rmsnorm";
        else if (p == "ns") t.norm_shift = false;
        else if (p == "s") t.store_pre_norm = true;
        else throw AttrError("attribute 'epilogue' = '" + tag + "' has an unknown part '" + p + "'");
    }
    if (t.str() != tag)
        throw AttrError("attribute 'epilogue' = '" + tag + "' is not a canonical epilogue tag (expected '" +
                        t.str() + "')");
    return t;
}

EpilogueLaunch parse_epilogue_launch(const AttrSource& a, const char* op) {
    require_cuda_abi(a, op);
    EpilogueLaunch l;
    std::string ref;
    if (!a.get_string("epilogue_kernel", ref))
        throw AttrError(std::string("attribute 'epilogue_kernel' (FILE.cubin:ENTRY, or '' for none) is required "
                                    "to run ") + op + " on the CUDA execution provider; rewrite the package");
    if (ref.empty()) return l;
    l.present = true;
    l.kernel = parse_kernel_ref(ref, "epilogue_kernel");
    const std::string f16 = "stofc_add_norm_float16_", bf16 = "stofc_add_norm_bfloat16_";
    std::string rest;
    if (l.kernel.entry.rfind(f16, 0) == 0) rest = l.kernel.entry.substr(f16.size());
    else if (l.kernel.entry.rfind(bf16, 0) == 0) rest = l.kernel.entry.substr(bf16.size()), l.bf16 = true;
    else
        throw AttrError("attribute 'epilogue_kernel' names '" + l.kernel.entry +
                        "', not a stofc Add+Norm kernel (stofc_add_norm_<float16|bfloat16>_...)");
    if (rest.rfind("f32in_", 0) == 0) rest = rest.substr(6), l.x_fp32 = true;
    if (rest.rfind("f32p_", 0) == 0) l.params_fp32 = true;
    std::string tag;
    if (!a.get_string("epilogue", tag))
        throw AttrError("attribute 'epilogue' (the epilogue kernel's Epilogue tag) is required with "
                        "'epilogue_kernel'");
    l.tag = parse_epilogue_tag(tag);
    l.threads = get_positive(a, "epilogue_threads", op, 1024);
    l.rows = get_positive(a, "epilogue_rows", op, 1024);
    if (l.threads % l.rows || (l.threads / l.rows) % 32)
        throw AttrError("attributes epilogue_threads=" + std::to_string(l.threads) + " / epilogue_rows=" +
                        std::to_string(l.rows) + " do not give whole warps per row; rewrite the package");
    return l;
}

GluLaunch parse_glu_launch(const AttrSource& a, const std::string& activation) {
    require_cuda_abi(a, "GatedGemm");
    GluLaunch l;
    std::string ref;
    if (!a.get_string("epilogue_kernel", ref) || ref.empty())
        throw AttrError("attribute 'epilogue_kernel' (FILE.cubin:ENTRY of the gated-activation kernel) is "
                        "required to run GatedGemm on the CUDA execution provider; rewrite the package");
    l.kernel = parse_kernel_ref(ref, "epilogue_kernel");
    const std::string f16 = "stofc_glu_float16_", bf16 = "stofc_glu_bfloat16_";
    std::string rest;
    if (l.kernel.entry.rfind(f16, 0) == 0) rest = l.kernel.entry.substr(f16.size());
    else if (l.kernel.entry.rfind(bf16, 0) == 0) rest = l.kernel.entry.substr(bf16.size()), l.bf16 = true;
    else
        throw AttrError("attribute 'epilogue_kernel' names '" + l.kernel.entry +
                        "', not a stofc gated-activation kernel (stofc_glu_<float16|bfloat16>_...)");
    if (rest.rfind(activation + "_", 0) != 0)
        throw AttrError("attribute 'epilogue_kernel' names '" + l.kernel.entry + "', compiled for another "
                        "activation than the node's '" + activation + "'; rewrite the package");
    const auto parts = split(rest.substr(activation.size() + 1), '_');
    if (!parts.empty() && parts[0] == "b")
        throw AttrError("attribute 'epilogue_kernel' names '" + l.kernel.entry + "', which adds the bias; "
                        "GatedGemm's CUDA twin has cuBLASLt add it (a kernel without '_b'); rewrite the package");
    const std::string& f = parts.empty() ? std::string() : parts[0];
    if (f.size() < 2 || f[0] != 'f' || f.find_first_not_of("0123456789", 1) != std::string::npos || f.size() > 10)
        throw AttrError("attribute 'epilogue_kernel' names '" + l.kernel.entry +
                        "', whose name does not give its row width (..._f<F>_t<tpr>x<rows>)");
    l.features = std::stoll(f.substr(1));
    l.threads = get_positive(a, "epilogue_threads", "GatedGemm", 1024);
    l.rows = get_positive(a, "epilogue_rows", "GatedGemm", 1024);
    if (l.threads % l.rows || (l.threads / l.rows) % 32)
        throw AttrError("attributes epilogue_threads=" + std::to_string(l.threads) + " / epilogue_rows=" +
                        std::to_string(l.rows) + " do not give whole warps per row; rewrite the package");
    return l;
}

RotaryLaunch parse_rotary_launch(const AttrSource& a, int64_t head_dim, int64_t rotary_dim, bool interleaved) {
    require_cuda_abi(a, "Rotary");
    RotaryLaunch l;
    std::string ref;
    if (!a.get_string("kernel", ref) || ref.empty())
        throw AttrError("attribute 'kernel' (FILE.cubin:ENTRY of the rotary kernel) is required to run Rotary on "
                        "the CUDA execution provider; rewrite the package");
    l.kernel = parse_kernel_ref(ref, "kernel");
    const auto parts = split(l.kernel.entry, '_');  // stofc rotary <dtype> d<D> r<RD> <rh|il> v<vec> t<threads>
    auto number = [&](size_t i, char tag) -> int64_t {
        const std::string& p = parts[i];
        if (p.size() < 2 || p.size() > 8 || p[0] != tag || p.find_first_not_of("0123456789", 1) != std::string::npos)
            throw AttrError("attribute 'kernel' names '" + l.kernel.entry + "', not a stofc rotary kernel "
                            "(stofc_rotary_<float16|bfloat16>_d<D>_r<R>_<rh|il>_v<V>_t<T>)");
        return std::stoll(p.substr(1));
    };
    if (parts.size() != 8 || parts[0] != "stofc" || parts[1] != "rotary" ||
        (parts[2] != "float16" && parts[2] != "bfloat16") || (parts[5] != "rh" && parts[5] != "il"))
        throw AttrError("attribute 'kernel' names '" + l.kernel.entry + "', not a stofc rotary kernel "
                        "(stofc_rotary_<float16|bfloat16>_d<D>_r<R>_<rh|il>_v<V>_t<T>)");
    l.bf16 = parts[2] == "bfloat16";
    const int64_t d = number(3, 'd'), r = number(4, 'r');
    l.vec = number(6, 'v'), l.threads = number(7, 't');
    if (d != head_dim || r != rotary_dim || (parts[5] == "il") != interleaved)
        throw AttrError("attribute 'kernel' names '" + l.kernel.entry + "', compiled for head_dim " +
                        std::to_string(d) + ", rotary_dim " + std::to_string(r) + ", " + parts[5] +
                        " but the node has head_dim " + std::to_string(head_dim) + ", rotary_dim " +
                        std::to_string(rotary_dim) + ", " + (interleaved ? "il" : "rh") + "; rewrite the package");
    if ((l.vec != 1 && l.vec != 2 && l.vec != 4 && l.vec != 8) || head_dim % l.vec)
        throw AttrError("attribute 'kernel' names '" + l.kernel.entry + "' with vectors of " + std::to_string(l.vec) +
                        " elements, which do not divide head_dim " + std::to_string(head_dim));
    if (l.threads < 32 || l.threads > 1024 || l.threads % 32)
        throw AttrError("attribute 'kernel' names '" + l.kernel.entry + "' with " + std::to_string(l.threads) +
                        " threads per block, not a whole number of warps up to 1024");
    return l;
}

EmbedNormLaunch parse_embed_norm_launch(const AttrSource& a) {
    require_cuda_abi(a, "EmbedLayerNorm");
    EmbedNormLaunch l;
    std::string ref;
    if (!a.get_string("kernel", ref) || ref.empty())
        throw AttrError("attribute 'kernel' (FILE.cubin:ENTRY of the EmbedLayerNorm kernel) is required to run "
                        "EmbedLayerNorm on the CUDA execution provider; rewrite the package");
    l.kernel = parse_kernel_ref(ref, "kernel");
    const std::string& entry = l.kernel.entry;
    auto bad = [&]() {
        return AttrError("attribute 'kernel' names '" + entry + "', not a stofc EmbedLayerNorm kernel "
                         "(stofc_embed_norm_<float16|bfloat16>[_f32p]_e<1..3>_<ln|ln_ns>_n<C>_t<tpr>x<rows>)");
    };
    auto number = [&](const std::string& digits) -> int64_t {
        if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos)
            throw bad();
        return std::stoll(digits);
    };
    // stofc embed norm <dtype> [f32p] e<K> ln [ns] n<C> t<tpr>x<rows>
    const auto parts = split(entry, '_');
    size_t i = 4;
    if (parts.size() < 8 || parts[0] != "stofc" || parts[1] != "embed" || parts[2] != "norm" ||
        (parts[3] != "float16" && parts[3] != "bfloat16"))
        throw bad();
    l.bf16 = parts[3] == "bfloat16";
    if (parts[i] == "f32p") l.params_fp32 = true, ++i;
    if (i >= parts.size() || parts[i].size() < 2 || parts[i][0] != 'e') throw bad();
    l.summands = number(parts[i++].substr(1));
    if (i >= parts.size() || parts[i++] != "ln") throw bad();
    if (i < parts.size() && parts[i] == "ns") l.has_beta = false, ++i;
    if (i >= parts.size() || parts[i].size() < 2 || parts[i][0] != 'n') throw bad();
    l.width = number(parts[i++].substr(1));
    if (i + 1 != parts.size() || parts[i].size() < 4 || parts[i][0] != 't') throw bad();
    const auto x = parts[i].find('x');
    if (x == std::string::npos) throw bad();
    l.tpr = number(parts[i].substr(1, x - 1));
    l.rows = number(parts[i].substr(x + 1));
    if (l.summands < 1 || l.summands > 3)
        throw AttrError("attribute 'kernel' names '" + entry + "', which sums " + std::to_string(l.summands) +
                        " tables; EmbedLayerNorm sums 1 to 3");
    if (l.width < 8 || l.width % 8)
        throw AttrError("attribute 'kernel' names '" + entry + "' for rows of " + std::to_string(l.width) +
                        " elements, not a positive multiple of 8 (16-byte vectors)");
    if (l.tpr < 32 || l.tpr % 32 || l.rows < 1 || l.tpr * l.rows > 1024)
        throw AttrError("attribute 'kernel' names '" + entry + "' with " + std::to_string(l.tpr) +
                        " threads per row and " + std::to_string(l.rows) +
                        " rows per block, not whole warps per row and at most 1024 threads");
    return l;
}

HopperGemmLaunch parse_hopper_gemm(const AttrSource& a) {
    HopperGemmLaunch l;
    std::string ref;
    if (!a.get_string("hopper_gemm", ref) || ref.empty()) return l;
    l.present = true;
    l.kernel = parse_kernel_ref(ref, "hopper_gemm");
    const std::string& entry = l.kernel.entry;
    auto bad = [&]() {
        return AttrError("attribute 'hopper_gemm' names '" + entry + "', not a stofc Hopper GEMM kernel "
                         "(stofc_gemm_ws_<float16|bfloat16>_<act>_b<0|1>_n<BN>_s<STAGES>_<coop|pp>_p<PASS>)");
    };
    auto number = [&](const std::string& part, char tag) -> int64_t {
        const std::string digits = part.size() > 1 && part[0] == tag ? part.substr(1) : "";
        if (digits.empty() || digits.size() > 6 || digits.find_first_not_of("0123456789") != std::string::npos)
            throw bad();
        return std::stoll(digits);
    };
    const auto parts = split(entry, '_');
    if (parts.size() < 10 || parts[0] != "stofc" || parts[1] != "gemm" || parts[2] != "ws" ||
        (parts[3] != "float16" && parts[3] != "bfloat16"))
        throw bad();
    l.bf16 = parts[3] == "bfloat16";
    const size_t tail = parts.size() - 5;  // b<0|1> n<BN> s<STAGES> <coop|pp> p<PASS>
    for (size_t i = 4; i < tail; ++i) l.act += (i > 4 ? "_" : "") + parts[i];
    if (l.act != "none" && l.act != "gelu_erf" && l.act != "gelu_tanh" && l.act != "relu" && l.act != "silu")
        throw bad();
    const int64_t bias = number(parts[tail], 'b');
    if (bias > 1) throw bad();
    l.bias = bias == 1;
    l.bn = number(parts[tail + 1], 'n');
    l.stages = number(parts[tail + 2], 's');
    if (parts[tail + 3] != "coop" && parts[tail + 3] != "pp") throw bad();
    l.coop = parts[tail + 3] == "coop";
    l.pass = number(parts[tail + 4], 'p');
    if ((l.bn != 128 && l.bn != 256) || (l.pass != 64 && l.pass != 128) || l.bn % l.pass || l.stages < 2 ||
        l.smem() > HopperGemmLaunch::kSmemLimit)
        throw AttrError("attribute 'hopper_gemm' names '" + entry + "': tile width " + std::to_string(l.bn) +
                        ", " + std::to_string(l.stages) + " stages and " + std::to_string(l.pass) +
                        " staged columns are not a config the kernel takes (128 or 256 wide, passes of 64 or "
                        "128, at most " + std::to_string(HopperGemmLaunch::kSmemLimit) + " bytes of shared memory)");
    if (!a.get_int("hopper_gemm_min_m", l.min_m) || l.min_m < 1)
        throw AttrError("attribute 'hopper_gemm_min_m' (the fewest rows a run needs to take the Hopper GEMM) "
                        "must be given with hopper_gemm and be >= 1; rewrite the package");
    return l;
}

GemmSplit split_fused_gemm(bool has_bias, const std::string& act, bool has_residual,
                           bool residual_after_activation) {
    if (act != "none" && act != "gelu_erf" && act != "gelu_tanh")
        throw AttrError("attribute activation='" + act + "' is not one of none, gelu_erf, gelu_tanh");
    GemmSplit s;
    // stofc.runtime.segment_cublas.lt_split: ReLU never reaches FusedGemm, so Lt folds the
    // bias, and the tanh GELU (cuBLASLt's GELU epilogue is that formula) when no residual is
    // involved; the residual joins as C when nothing is applied after it would be added.
    // gelu_erf is never replaced by the tanh form: the epilogue kernel applies it.
    if (act == "gelu_tanh" && !has_residual) {
        s.lt_epilogue = has_bias ? 36 : 32;  // CUBLASLT_EPILOGUE_GELU_BIAS / _GELU
        s.rest.act = "none";
        return s;
    }
    s.lt_epilogue = has_bias ? 4 : 1;
    s.lt_residual = has_residual && (act == "none" || !residual_after_activation);
    s.rest.act = act;
    s.rest.residual = has_residual && !s.lt_residual;
    return s;
}

EpilogueTag add_layer_norm_epilogue(bool has_residual, bool rms, bool has_beta, bool has_sum) {
    if (rms && has_beta)
        throw AttrError("an RMSNorm with a shift (beta) has no CUDA kernel (the Add+Norm template applies "
                        "beta to LayerNorm only); run it on the CPUExecutionProvider");
    EpilogueTag t;
    t.residual = has_residual;
    t.norm = rms ? "rmsnorm" : "layernorm";
    t.norm_shift = rms || has_beta;  // RMSNorm tags never carry "ns" (the writer's Epilogue)
    t.store_pre_norm = has_sum;
    return t;
}

void check_epilogue_matches(const EpilogueLaunch& l, const EpilogueTag& want, const char* op) {
    const bool identity = want.str() == "plain";
    if (!l.present && identity) return;
    if (!l.present)
        throw AttrError(std::string(op) + " needs an epilogue kernel for '" + want.str() +
                        "' but attribute 'epilogue_kernel' is empty; rewrite the package");
    if (!(l.tag == want))
        throw AttrError(std::string(op) + ": the epilogue kernel was compiled for '" + l.tag.str() +
                        "' but this node needs '" + want.str() + "'; rewrite the package with 'stofc compile'");
}

}  // namespace stofc_ort
