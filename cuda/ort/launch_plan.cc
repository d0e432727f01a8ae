// stofc ONNX Runtime custom-op library: `*.plan.bin` reading and validation.
#include "launch_plan.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include "binary_reader.h"
#include "common.h"

namespace stofc_ort {
namespace {

constexpr char kPlanMagic[8] = {'S', 'T', 'O', 'F', 'A', 'P', 'L', 'N'};
constexpr uint32_t kPlanVersion = 1;
constexpr size_t kPlanHeaderBytes = 128;

}  // namespace

std::shared_ptr<const AttentionPlan> load_attention_plan(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f)
        throw OpError("attention launch plan '" + path + "' cannot be opened; the package is incomplete, "
                      "rewrite it with 'stofc compile'",
                      ORT_NO_SUCHFILE);
    const std::vector<char> buf((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    BinaryReader rd{"attention launch plan", path, buf, kPlanHeaderBytes};
    if (buf.size() < kPlanHeaderBytes) rd.fail("shorter than its header");
    if (std::memcmp(buf.data(), kPlanMagic, 8) != 0) rd.fail("bad magic (not a stofc *.plan.bin)");
    if (rd.scalar<uint32_t>(8) != kPlanVersion)
        throw OpError("attention launch plan '" + path + "' has layout version " +
                          std::to_string(rd.scalar<uint32_t>(8)) + ", this library reads " +
                          std::to_string(kPlanVersion) + "; rebuild the package and its library with one stofc",
                      ORT_INVALID_GRAPH);
    if (rd.scalar<uint32_t>(12) != kPlanHeaderBytes) rd.fail("unexpected header size");
    auto p = std::make_shared<AttentionPlan>();
    p->path = path;
    const int kind = rd.scalar<int32_t>(16);
    if (kind != 0 && kind != 1) rd.fail("unknown kernel kind");
    p->block = kind == 0;
    p->tile = rd.scalar<int32_t>(20);
    p->tile_rows = rd.scalar<int32_t>(24);
    p->seq_len = rd.scalar<int32_t>(28);
    p->permuted = rd.scalar<int32_t>(32) != 0;
    p->fmt_head_stride = rd.scalar<int32_t>(36);
    int64_t n[7];
    for (int i = 0; i < 7; ++i) n[i] = rd.scalar<int64_t>(40 + 8 * i);
    char hash[33] = {};
    std::memcpy(hash, buf.data() + 96, 32);
    p->spec_hash = hash;
    if (p->tile != 16 && p->tile != 32 && p->tile != 64 && p->tile != 128) rd.fail("bad tile size");
    if (p->seq_len < 1 || p->tile_rows != (p->seq_len + p->tile - 1) / p->tile) rd.fail("bad geometry");
    p->row_ptr = rd.array<int32_t>(n[0], "row_ptr");
    p->col_idx = rd.array<int32_t>(n[1], "col_idx");
    p->part_idx = rd.array<int32_t>(n[2], "part_idx");
    p->bitmaps = rd.array<uint64_t>(n[3], "bitmaps");
    p->gather_keys = rd.array<int32_t>(n[4], "gather_keys");
    p->q_perm = rd.array<int32_t>(n[5], "q_perm");
    p->row_orders = rd.array<int32_t>(n[6], "row_orders");
    if (rd.pos + ((8 - rd.pos % 8) % 8) != buf.size()) rd.fail("trailing bytes or truncated");

    // Everything a kernel follows stays in bounds.
    const int R = p->tile_rows, T = p->tile;
    const int64_t heads = p->fmt_head_stride == 0 ? 1 : static_cast<int64_t>(p->row_ptr.size()) / (R + 1);
    if (p->fmt_head_stride != 0 && p->fmt_head_stride != R + 1) rd.fail("bad head stride");
    if (static_cast<int64_t>(p->row_ptr.size()) != heads * (R + 1)) rd.fail("row_ptr has the wrong length");
    const int64_t walked = static_cast<int64_t>(p->col_idx.size()) - 1;  // minus the sentinel
    if (walked < 0 || p->part_idx.size() != p->col_idx.size()) rd.fail("col_idx / part_idx lengths differ");
    const int64_t words = static_cast<int64_t>(T / 8) * (T / 8);
    const int64_t n_bitmaps = static_cast<int64_t>(p->bitmaps.size()) / words;
    const int64_t gk = static_cast<int64_t>(p->gather_keys.size()) - 4;
    if (gk < 0 || gk % T) rd.fail("gather_keys has the wrong length");
    for (int64_t h = 0; h < heads; ++h)
        for (int r = 0; r < R; ++r) {
            const int32_t a = p->row_ptr[h * (R + 1) + r], b = p->row_ptr[h * (R + 1) + r + 1];
            if (a < 0 || b < a || b > walked) rd.fail("row_ptr is not monotone or points past the walk list");
        }
    for (int64_t j = 0; j < walked; ++j) {
        const int32_t key = p->col_idx[j], part = p->part_idx[j];
        if (part < -1 || part >= n_bitmaps) rd.fail("part index out of range");
        if (p->block) {
            if (key >= 0 ? key % T != 0 || key >= R * T : -static_cast<int64_t>(key) - 1 >= gk / T)
                rd.fail("tile key out of range");
        } else if (key < 0 || key >= R) {
            rd.fail("column out of range");
        }
    }
    for (int64_t i = 0; i < gk; ++i)
        if (p->gather_keys[i] < -1 || p->gather_keys[i] >= R * T) rd.fail("gathered key out of range");
    if (static_cast<int64_t>(p->q_perm.size()) != static_cast<int64_t>(R) * T + 4) rd.fail("q_perm has the wrong length");
    for (int32_t x : p->q_perm)
        if (x < -1 || x >= p->seq_len) rd.fail("q_perm entry out of range");
    if (static_cast<int64_t>(p->row_orders.size()) != static_cast<int64_t>(R) * (R + 1) / 2)
        rd.fail("row_orders has the wrong length");
    for (int rows = 1; rows <= R; ++rows)
        for (int i = 0; i < rows; ++i) {
            const int32_t x = p->row_orders[p->order_offset(rows) + i];
            if (x < 0 || x >= rows) rd.fail("row order entry out of range");
        }
    return p;
}

AttentionLaunchScalars attention_scalars(const AttentionPlan& p, const AttentionLaunchShape& s) {
    AttentionLaunchScalars a;
    a.rows = p.rows_for(s.S);
    a.grid = s.H * s.B * a.rows * s.blocks_per_tile_row;
    a.order_offset = p.order_offset(a.rows);
    const int64_t hkv = s.Hkv > 0 ? s.Hkv : s.H;
    const int64_t HD = s.H * s.D, KD = hkv * s.D, in_row = s.packed ? HD + 2 * KD : HD;
    const int64_t kv_row = s.packed ? in_row : KD;
    a.q_sb = s.S * in_row;
    a.q_ss = in_row;
    a.q_sh = s.D;
    a.k_sb = s.S * kv_row;
    a.k_ss = kv_row;
    a.k_sh = s.D;
    a.o_sb = s.S * HD;
    a.o_ss = HD;
    a.o_sh = s.D;
    a.k_offset = s.packed ? HD : 0;
    a.v_offset = s.packed ? HD + KD : 0;
    a.kv_group = static_cast<int>(s.H / hkv);
    a.softcap = s.softcap;
    a.permuted = p.permuted ? 1 : 0;
    a.fmt_head_stride = p.fmt_head_stride;
    a.key_words = s.has_key_bits ? static_cast<int>((s.S + 63) / 64) : 0;
    a.bias_sb = s.has_bias ? s.bias_sb : 0;
    a.bias_sh = s.has_bias ? s.bias_sh : 0;
    a.bias_sq = s.has_bias ? s.S : 0;
    a.B = static_cast<int>(s.B);
    a.H = static_cast<int>(s.H);
    a.L = static_cast<int>(s.S);
    a.scale = s.scale;
    return a;
}

}  // namespace stofc_ort
