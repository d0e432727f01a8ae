// Unit-test driver for the CUDA twins' attribute checks and the registration table.
//
// Built with g++ by tests/unit/test_ortlib_cuda.py from this file and
// ../cuda_attrs.cc and ../launch_plan.cc (no ONNX Runtime library, no CUDA, no GPU). Protocol:
//   argv[1] == "registrations": one line per kRegistrations row: "<op> <ep> <onnx elem type>"
//   and, when set, " float_inputs=N", " float_outputs=N", " any_inputs=N" (bit masks).
//   otherwise: each stdin line is "<parser>|name=i:VALUE|name=s:TEXT|name=l:1,2|..." and the
//   answer is one line "OK <summary>" or "ERR <message>". Parsers: attention,
//   epilogue:<op>, glu:<activation> (GatedGemm's gated-activation kernel), rotary (Rotary's
//   kernel: head_dim, rotary_dim, interleaved and the node's kernel attributes), embed_norm (EmbedLayerNorm's
//   kernel attributes), hopper_gemm (FusedGemm's hopper_gemm, hopper_gemm_min_m), gemm_split
//   (attributes bias, act, residual, after),
//   norm_epilogue (residual, rms, beta, sum), tag, entry, plan (path: a *.plan.bin),
//   pack (path, B, S, H, D, kpm, bias, bias_sb, bias_sh, per_row, scale_milli, packed, Hkv, sm: the
//   attention launch's scalars; for a ws plan its work items, grids (sm: the GPU's SMs,
//   default 132) and tensor maps), variants (the base's attributes + variant_*, optional
//   B, S, tile: the selected variant), lt_algo (lt_algo_m, lt_algo_rank, M).
#include <cstdint>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_attrs.h"
#include "launch_plan.h"
#include "ops.h"

using namespace stofc_ort;

namespace {

struct MapSource : AttrSource {
    std::map<std::string, int64_t> ints;
    std::map<std::string, std::string> strings;
    std::map<std::string, std::vector<int64_t>> lists;
    bool get_ints(const char* n, std::vector<int64_t>& out) const override {
        auto it = lists.find(n);
        if (it == lists.end()) return false;
        out = it->second;
        return true;
    }
    bool get_int(const char* n, int64_t& out) const override {
        auto it = ints.find(n);
        if (it == ints.end()) return false;
        out = it->second;
        return true;
    }
    bool get_string(const char* n, std::string& out) const override {
        auto it = strings.find(n);
        if (it == strings.end()) return false;
        out = it->second;
        return true;
    }
    int64_t i(const char* n) const {
        int64_t v = 0;
        get_int(n, v);
        return v;
    }
    std::string s(const char* n) const {
        std::string v;
        get_string(n, v);
        return v;
    }
};

std::string run(const std::string& parser, const MapSource& a) {
    std::ostringstream out;
    if (parser == "attention") {
        const AttentionLaunch l = parse_attention_launch(a);
        out << "file=" << l.kernel.file << " entry=" << l.kernel.entry << " plan=" << l.plan_file
            << " kind=" << kind_name(l.variant.kind) << " bf16=" << l.variant.bf16 << " bias=" << l.variant.has_bias
            << " keybits=" << l.variant.has_key_bits << " threads=" << l.block_threads
            << " per_row=" << l.blocks_per_tile_row << " smem=" << l.smem_bytes;
    } else if (parser == "variants") {  // the base's attributes plus variant_*; then B, S, tile: the pick
        const AttentionLaunch base = parse_attention_launch(a);
        const auto vs = parse_attention_variants(a, base);
        out << "n=" << vs.size();
        for (const auto& l : vs)
            out << " [" << l.label << " file=" << l.kernel.file << " entry=" << l.kernel.entry << " plan=" << l.plan_file
                << " kind=" << kind_name(l.variant.kind) << " threads=" << l.block_threads << " per_row=" << l.blocks_per_tile_row
                << " smem=" << l.smem_bytes << " max_seq=" << l.max_seq_len << " max_rows=" << l.max_batch_rows << "]";
        if (a.ints.count("S")) out << " pick=" << select_attention_variant(vs, a.i("B"), a.i("S"), a.i("tile"));
    } else if (parser == "lt_algo") {  // lt_algo_m, lt_algo_rank; then M: its rank
        const LtAlgoChoice c = parse_lt_algo_choice(a);
        out << "n=" << c.m.size() << " rank=" << c.rank_for(a.i("M"));
    } else if (parser.rfind("epilogue:", 0) == 0) {
        const EpilogueLaunch l = parse_epilogue_launch(a, parser.substr(9).c_str());
        out << "present=" << l.present;
        if (l.present)
            out << " bf16=" << l.bf16 << " file=" << l.kernel.file << " entry=" << l.kernel.entry << " tag=" << l.tag.str()
                << " threads=" << l.threads << " rows=" << l.rows;
        if (l.x_fp32) out << " x_fp32=1";
        if (l.params_fp32) out << " params_fp32=1";
    } else if (parser.rfind("glu:", 0) == 0) {  // glu:<activation>
        const GluLaunch l = parse_glu_launch(a, parser.substr(4));
        out << "bf16=" << l.bf16 << " file=" << l.kernel.file << " entry=" << l.kernel.entry
            << " features=" << l.features << " threads=" << l.threads << " rows=" << l.rows;
    } else if (parser == "rotary") {  // the node's head_dim, rotary_dim, interleaved + kernel attributes
        const RotaryLaunch l = parse_rotary_launch(a, a.i("head_dim"), a.i("rotary_dim"), a.i("interleaved"));
        out << "bf16=" << l.bf16 << " file=" << l.kernel.file << " entry=" << l.kernel.entry << " vec=" << l.vec
            << " threads=" << l.threads;
    } else if (parser == "embed_norm") {  // EmbedLayerNorm's kernel attributes
        const EmbedNormLaunch l = parse_embed_norm_launch(a);
        out << "bf16=" << l.bf16 << " file=" << l.kernel.file << " entry=" << l.kernel.entry
            << " f32p=" << l.params_fp32 << " summands=" << l.summands << " beta=" << l.has_beta
            << " width=" << l.width << " tpr=" << l.tpr << " rows=" << l.rows;
    } else if (parser == "hopper_gemm") {  // FusedGemm's hopper_gemm, hopper_gemm_min_m
        const HopperGemmLaunch l = parse_hopper_gemm(a);
        out << "present=" << l.present;
        if (l.present)
            out << " file=" << l.kernel.file << " entry=" << l.kernel.entry << " bf16=" << l.bf16 << " act=" << l.act
                << " bias=" << l.bias << " bn=" << l.bn << " bm=" << l.bm() << " stages=" << l.stages
                << " pass=" << l.pass << " smem=" << l.smem() << " min_m=" << l.min_m;
    } else if (parser == "gemm_split") {
        const GemmSplit s = split_fused_gemm(a.i("bias"), a.s("act"), a.i("residual"), a.i("after"));
        out << "lt_epilogue=" << s.lt_epilogue << " lt_residual=" << s.lt_residual << " rest=" << s.rest.str();
    } else if (parser == "norm_epilogue") {
        out << "tag=" << add_layer_norm_epilogue(a.i("residual"), a.i("rms"), a.i("beta"), a.i("sum")).str();
    } else if (parser == "tag") {
        out << "tag=" << parse_epilogue_tag(a.s("tag")).str();
    } else if (parser == "entry") {
        const AttentionVariant v = parse_attention_entry(a.s("entry"));
        out << "kind=" << kind_name(v.kind) << " d=" << v.head_dim << " bf16=" << v.bf16 << " bias=" << v.has_bias
            << " keybits=" << v.has_key_bits << " softcap=" << v.softcap;
    } else if (parser == "plan") {
        try {
            const auto p = load_attention_plan(a.s("path"));
            out << "kind=" << kind_name(p->kind) << " tile=" << p->tile << " rows=" << p->tile_rows
                << " heads=" << p->num_heads;
            if (p->kind == KernelKind::kWs)
                out << " pairs=" << p->ws.pairs << " slots=" << p->ws.slots << " items=" << p->ws.n_items
                    << " split=" << p->ws.split << " splits=" << p->ws.splits << " entries=" << p->ws.entry_key.size() - 1;
            else
                out << " permuted=" << p->permuted << " walked=" << p->col_idx.size() - 1
                    << " orders=" << p->row_orders.size();
        } catch (const OpError& e) {
            throw AttrError(e.what());
        }
    } else if (parser == "pack") {
        std::shared_ptr<const AttentionPlan> p;
        try {
            p = load_attention_plan(a.s("path"));
        } catch (const OpError& e) {
            throw AttrError(e.what());
        }
        AttentionLaunchShape s;
        s.B = a.i("B");
        s.S = a.i("S");
        s.H = a.i("H");
        s.D = a.i("D");
        s.has_key_bits = a.i("kpm") != 0;
        s.has_bias = a.i("bias") != 0;
        s.bias_sb = a.i("bias_sb");
        s.bias_sh = a.i("bias_sh");
        s.blocks_per_tile_row = a.i("per_row");
        s.scale = static_cast<float>(a.i("scale_milli")) / 1000.0f;
        s.packed = a.i("packed") != 0;
        s.Hkv = a.i("Hkv");
        const AttentionLaunchScalars c = attention_scalars(*p, s);
        if (p->kind == KernelKind::kWs) {  // the ws launches' scalars and tensor maps
            const WsLaunchScalars w = ws_scalars(*p, s, c, a.ints.count("sm") ? a.i("sm") : 132);
            out << "pairs=" << w.pairs << " threads=" << w.threads << " order_offset=" << w.order_offset
                << " items=" << w.items
                << " n_work=" << w.n_work << " grid=" << w.grid << " combine_grid=" << w.combine_grid << " items_head_stride=" << w.items_head_stride
                << " order_head_stride=" << w.order_head_stride << " combine_head_stride=" << w.combine_head_stride
                << " slots=" << w.slots << " part_o_bytes=" << w.part_o_bytes << " part_ml_bytes=" << w.part_ml_bytes;
            const char* names[] = {"q", "k", "v"};
            const TensorMapShape* maps[] = {&w.q, &w.k, &w.v};
            for (int m = 0; m < 3; ++m) {
                const TensorMapShape& t = *maps[m];
                out << " " << names[m] << "_dims=" << t.dims[0] << "," << t.dims[1] << "," << t.dims[2] << "," << t.dims[3]
                    << " " << names[m] << "_strides=" << t.strides[0] << "," << t.strides[1] << "," << t.strides[2] << " "
                    << names[m] << "_box=" << t.box[0] << "," << t.box[1] << "," << t.box[2] << "," << t.box[3] << " "
                    << names[m] << "_steps=" << t.elem[0] << "," << t.elem[1] << "," << t.elem[2] << "," << t.elem[3] << " "
                    << names[m] << "_offset=" << t.offset;
            }
            out << " o_sb=" << c.o_sb << " o_ss=" << c.o_ss << " o_sh=" << c.o_sh << " key_words=" << c.key_words
                << " kv_group=" << c.kv_group;
            return out.str();
        }
        out << "rows=" << c.rows << " grid=" << c.grid << " order_offset=" << c.order_offset << " q_sb=" << c.q_sb
            << " q_ss=" << c.q_ss << " q_sh=" << c.q_sh << " permuted=" << c.permuted
            << " fmt_head_stride=" << c.fmt_head_stride << " key_words=" << c.key_words << " bias_sb=" << c.bias_sb
            << " bias_sh=" << c.bias_sh << " bias_sq=" << c.bias_sq << " B=" << c.B << " H=" << c.H << " L=" << c.L
            << " scale=" << c.scale << " o_sb=" << c.o_sb << " o_ss=" << c.o_ss << " o_sh=" << c.o_sh
            << " k_offset=" << c.k_offset << " v_offset=" << c.v_offset;
    } else {
        throw AttrError("unknown parser " + parser);
    }
    return out.str();
}

}  // namespace

int main(int argc, char** argv) {
    if (argc > 1 && std::string(argv[1]) == "registrations") {
        for (const Registration& r : kRegistrations)
            std::cout << r.sig->name << " " << (r.cuda ? kCudaEp : "CPUExecutionProvider") << " "
                      << static_cast<int>(r.elem)
                      << (r.float_inputs ? " float_inputs=" + std::to_string(r.float_inputs) : "")
                      << (r.float_outputs ? " float_outputs=" + std::to_string(r.float_outputs) : "")
                      << (r.any_inputs ? " any_inputs=" + std::to_string(r.any_inputs) : "") << "\n";
        std::cout << "abi " << kCudaLaunchAbi << "\n";
        return 0;
    }
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream fields(line);
        std::string parser, field;
        std::getline(fields, parser, '|');
        MapSource a;
        while (std::getline(fields, field, '|')) {
            const auto eq = field.find('=');
            const std::string name = field.substr(0, eq), value = field.substr(eq + 3);
            if (field.compare(eq + 1, 2, "i:") == 0) {
                a.ints[name] = std::stoll(value);
            } else if (field.compare(eq + 1, 2, "l:") == 0) {  // a list of ints: l:1,2,3 (l: = empty)
                auto& list = a.lists[name];
                std::istringstream items(value);
                std::string item;
                while (std::getline(items, item, ','))
                    if (!item.empty()) list.push_back(std::stoll(item));
            } else {
                a.strings[name] = value;
            }
        }
        try {
            const std::string answer = run(parser, a);
            std::cout << "OK " << answer << "\n";
        } catch (const AttrError& e) {
            std::cout << "ERR " << e.what() << "\n";
        }
    }
    return 0;
}
