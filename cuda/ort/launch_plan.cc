// stofc ONNX Runtime custom-op library: `*.plan.bin` reading and validation.
#include "launch_plan.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>

#include "attention_abi.h"
#include "binary_reader.h"
#include "common.h"

namespace stofc_ort {
namespace {

constexpr char kPlanMagic[8] = {'S', 'T', 'O', 'F', 'A', 'P', 'L', 'N'};
constexpr uint32_t kPlanVersion = 7;  // maskbin.PLAN_BIN_VERSION
constexpr size_t kPlanHeaderBytes = 256;
constexpr size_t kCountsAt = 128;
constexpr int kBlockRowArrays = 7, kWsArrays = 8;
constexpr int kWsMaxChunks = 64;  // stofc/kernels/attention/ws_plan.py MAX_CHUNKS (the most a row is cut into)

/// Block- and row-wise: everything a kernel follows stays in bounds.
void check_block_row(AttentionPlan& p, BinaryReader& rd, const int64_t* n) {
    p.row_ptr = rd.array<int32_t>(n[0], "row_ptr");
    p.col_idx = rd.array<int32_t>(n[1], "col_idx");
    p.part_idx = rd.array<int32_t>(n[2], "part_idx");
    p.bitmaps = rd.array<uint64_t>(n[3], "bitmaps");
    p.gather_keys = rd.array<int32_t>(n[4], "gather_keys");
    p.q_perm = rd.array<int32_t>(n[5], "q_perm");
    p.row_orders = rd.array<int32_t>(n[6], "row_orders");
    const int R = p.tile_rows, T = p.tile;
    const bool block = p.kind == KernelKind::kBlock;
    if (p.fmt_head_stride != (p.num_heads == 1 ? 0 : R + 1)) rd.fail("bad head stride");
    const int64_t heads = p.num_heads;
    if (static_cast<int64_t>(p.row_ptr.size()) != heads * (R + 1)) rd.fail("row_ptr has the wrong length");
    const int64_t walked = static_cast<int64_t>(p.col_idx.size()) - 1;  // minus the sentinel
    if (walked < 0 || p.part_idx.size() != p.col_idx.size()) rd.fail("col_idx / part_idx lengths differ");
    const int64_t words = static_cast<int64_t>(T / 8) * (T / 8);
    const int64_t n_bitmaps = static_cast<int64_t>(p.bitmaps.size()) / words;
    const int64_t gk = static_cast<int64_t>(p.gather_keys.size()) - 4;
    if (gk < 0 || gk % T) rd.fail("gather_keys has the wrong length");
    for (int64_t h = 0; h < heads; ++h)
        for (int r = 0; r < R; ++r) {
            const int32_t a = p.row_ptr[h * (R + 1) + r], b = p.row_ptr[h * (R + 1) + r + 1];
            if (a < 0 || b < a || b > walked) rd.fail("row_ptr is not monotone or points past the walk list");
        }
    for (int64_t j = 0; j < walked; ++j) {
        const int32_t key = p.col_idx[j], part = p.part_idx[j];
        if (part < -1 || part >= n_bitmaps) rd.fail("part index out of range");
        if (block) {
            if (key >= 0 ? key % T != 0 || key >= R * T : -static_cast<int64_t>(key) - 1 >= gk / T)
                rd.fail("tile key out of range");
        } else if (key < 0 || key >= R) {
            rd.fail("column out of range");
        }
    }
    for (int64_t i = 0; i < gk; ++i)
        if (p.gather_keys[i] < -1 || p.gather_keys[i] >= R * T) rd.fail("gathered key out of range");
    if (static_cast<int64_t>(p.q_perm.size()) != static_cast<int64_t>(R) * T + 4) rd.fail("q_perm has the wrong length");
    for (int32_t x : p.q_perm)
        if (x < -1 || x >= p.seq_len) rd.fail("q_perm entry out of range");
    if (static_cast<int64_t>(p.row_orders.size()) != static_cast<int64_t>(R) * (R + 1) / 2)
        rd.fail("row_orders has the wrong length");
    for (int rows = 1; rows <= R; ++rows)
        for (int i = 0; i < rows; ++i) {
            const int32_t x = p.row_orders[p.order_offset(rows) + i];
            if (x < 0 || x >= rows) rd.fail("row order entry out of range");
        }
}

/// Warp-specialised: every index the kernel, its producer and the combine kernel follow
/// stays in bounds (stofc/kernels/attention/ws_plan.py, block_ws.cu.j2).
void check_ws(AttentionPlan& p, BinaryReader& rd, const int64_t* n) {
    WsTables& w = p.ws;
    w.entry_key = rd.array<int32_t>(n[0], "entry_key");
    w.entry_part = rd.array<int32_t>(n[1], "entry_part");
    p.bitmaps = rd.array<uint64_t>(n[2], "bitmaps");
    w.items = rd.array<int32_t>(n[3], "items");
    w.orders = rd.array<int32_t>(n[4], "orders");
    w.combine = rd.array<int32_t>(n[5], "combine");
    w.order_ptr = rd.array<int32_t>(n[6], "order_ptr");
    w.items_upto = rd.array<int32_t>(n[7], "items_upto");
    const int64_t heads = p.num_heads, R = p.tile_rows;
    if (p.tile != kWsTile) rd.fail("a warp-specialised plan has 64x64 tiles");
    if (w.consumers < 1 || w.consumers > 4) rd.fail("a warp-specialised block has 1 to 4 consumer warpgroups");
    if (w.period != 1 && w.period != 2 && w.period != 4) rd.fail("a residue split has period 1, 2 or 4");
    const int rows = ws_rows(w.consumers);
    const int walked_len = (p.seq_len + w.period - 1) / w.period;  // residue 0's rows
    if (w.pairs != (walked_len + rows - 1) / rows) rd.fail("bad number of pair rows");
    if (w.slots < 1 || w.n_items < 1 || w.n_split < 1 || w.split < 0 || w.orders_per_head < 0)
        rd.fail("bad ws scalars");
    // the walk: tile keys inside the mask, each warpgroup's part SKIP (-2), FULL (-1) or a bitmap
    const int64_t entries = static_cast<int64_t>(w.entry_key.size()) - 1;  // minus the sentinel
    if (entries < 0 || static_cast<int64_t>(w.entry_part.size()) != w.consumers * (entries + 1))
        rd.fail("entry_key / entry_part lengths differ");
    const int64_t words = static_cast<int64_t>(kWsTile / 8) * (kWsTile / 8);
    if (p.bitmaps.size() < 2 || (p.bitmaps.size() % words && p.bitmaps.size() != 2))
        rd.fail("bitmaps has the wrong length");
    const int64_t n_bitmaps = static_cast<int64_t>(p.bitmaps.size()) / words;
    for (int64_t j = 0; j <= entries; ++j) {
        const int32_t key = w.entry_key[j];
        if (key < 0 || key % kWsTile || key >= R * kWsTile) rd.fail("entry key out of range");
    }
    for (int32_t part : w.entry_part)
        if (part < -2 || part >= n_bitmaps) rd.fail("entry part out of range");
    // work items: (pair row, begin, end, slot, shared), a pair row -1 = padding; shared 0 or
    // 1 + w0 (every warpgroup on tile row w0; their partials in the chunk's own slot)
    if (static_cast<int64_t>(w.items.size()) != heads * w.n_items * kWsItemFields)
        rd.fail("items has the wrong length");
    for (size_t i = 0; i < w.items.size(); i += kWsItemFields) {
        const int32_t prow = w.items[i], begin = w.items[i + 1], end = w.items[i + 2], slot = w.items[i + 3],
                      shared = w.items[i + 4];
        if (prow == -1) continue;
        if (prow < 0 || prow >= w.pairs) rd.fail("item pair row out of range");
        if (begin < 0 || end < begin || end > entries) rd.fail("item range outside the walk");
        if (slot < -1 || slot >= w.slots) rd.fail("item slot out of range");
        // shared = 1 + w0: a chunk of tile row w0 every warpgroup works on (ws_plan.py)
        if (shared < 0 || shared > w.consumers || (shared && slot < 0))
            rd.fail("item shared out of range");
    }
    // the orders of every run length: offsets, counts, item indices
    const int64_t want_orders = std::max<int64_t>(1, heads * w.orders_per_head);
    if (static_cast<int64_t>(w.orders.size()) != want_orders) rd.fail("orders has the wrong length");
    for (int32_t x : w.orders)
        if (x < 0 || x >= w.n_items) rd.fail("order entry out of range");
    if (static_cast<int64_t>(w.order_ptr.size()) != w.pairs + 1 ||
        static_cast<int64_t>(w.items_upto.size()) != w.pairs + 1)
        rd.fail("order_ptr / items_upto have the wrong length");
    if (w.order_ptr[0] != 0 || w.order_ptr[w.pairs] != w.orders_per_head) rd.fail("order_ptr does not span the orders");
    for (int q = 1; q <= w.pairs; ++q)
        if (w.items_upto[q] < 0 || w.items_upto[q] > w.n_items ||
            w.order_ptr[q] - w.order_ptr[q - 1] != w.items_upto[q])
            rd.fail("order_ptr / items_upto are inconsistent");
    // the combine table: (pair row, first slot, chunks), a pair row -1 = padding
    if (static_cast<int64_t>(w.combine.size()) != heads * w.n_split * 3) rd.fail("combine has the wrong length");
    for (size_t i = 0; i < w.combine.size(); i += 3) {
        const int32_t prow = w.combine[i], first = w.combine[i + 1], chunks = w.combine[i + 2];
        if (prow == -1) continue;
        if (prow < 0 || prow >= w.pairs || first < 0 || chunks < 1 || chunks > kWsMaxChunks ||
            static_cast<int64_t>(first) + chunks > w.slots)
            rd.fail("combine row out of range");
        w.splits = true;
    }
}

}  // namespace

std::vector<HostArray> AttentionPlan::device_arrays() const {
    const auto a = [](const auto& v) { return HostArray{v.data(), v.size() * sizeof(v[0])}; };
    if (kind == KernelKind::kWs)
        return {a(ws.entry_key), a(ws.entry_part), a(bitmaps), a(ws.items), a(ws.orders), a(ws.combine)};
    return {a(row_ptr), a(col_idx), a(part_idx), a(bitmaps), a(gather_keys), a(q_perm), a(row_orders)};
}

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
    if (kind < 0 || kind > 2) rd.fail("unknown kernel kind " + std::to_string(kind));
    p->kind = static_cast<KernelKind>(kind);
    p->tile = rd.scalar<int32_t>(20);
    p->tile_rows = rd.scalar<int32_t>(24);
    p->seq_len = rd.scalar<int32_t>(28);
    p->num_heads = rd.scalar<int32_t>(32);
    const int n_arrays = rd.scalar<int32_t>(36);
    int32_t sc[8];
    for (int i = 0; i < 8; ++i) sc[i] = rd.scalar<int32_t>(40 + 4 * i);
    char hash[33] = {};
    std::memcpy(hash, buf.data() + 72, 32);
    p->spec_hash = hash;
    int64_t n[16];
    for (int i = 0; i < 16; ++i) n[i] = rd.scalar<int64_t>(kCountsAt + 8 * i);
    if (p->tile != 16 && p->tile != 32 && p->tile != 64 && p->tile != 128) rd.fail("bad tile size");
    if (p->seq_len < 1 || p->tile_rows != (p->seq_len + p->tile - 1) / p->tile) rd.fail("bad geometry");
    if (p->num_heads < 1) rd.fail("bad number of mask heads");
    if (n_arrays != (p->kind == KernelKind::kWs ? kWsArrays : kBlockRowArrays))
        rd.fail("wrong number of arrays for a " + std::string(kind_name(p->kind)) + " plan");
    if (p->kind == KernelKind::kWs) {
        p->ws.pairs = sc[0];
        p->ws.slots = sc[1];
        p->ws.n_items = sc[2];
        p->ws.n_split = sc[3];
        p->ws.split = sc[4];
        p->ws.orders_per_head = sc[5];
        p->ws.consumers = sc[6];
        p->ws.period = sc[7];
        check_ws(*p, rd, n);
    } else {
        p->permuted = sc[0] != 0;
        p->fmt_head_stride = sc[1];
        check_block_row(*p, rd, n);
    }
    if (rd.pos + ((8 - rd.pos % 8) % 8) != buf.size()) rd.fail("trailing bytes or truncated");
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

WsLaunchScalars ws_scalars(const AttentionPlan& p, const AttentionLaunchShape& s, const AttentionLaunchScalars& a,
                           int64_t sm_count) {
    const WsTables& w = p.ws;
    WsLaunchScalars r;
    const int rows = ws_rows(w.consumers);
    r.threads = ws_threads(w.consumers);
    const int64_t walked = (s.S + w.period - 1) / w.period;  // residue 0's rows (period 1: S)
    r.pairs = static_cast<int>(std::min<int64_t>(w.pairs, (walked + rows - 1) / rows));
    if (r.pairs < 1) return r;  // an empty sequence: nothing is launched
    r.order_offset = w.order_ptr[r.pairs - 1];
    r.items = w.items_upto[r.pairs];
    // work w: head w % H, batch-and-residue (w / H) % (B P), item order[w / (H B P)]
    r.n_work = s.H * s.B * w.period * r.items;
    // persistent: ws_blocks_per_sm(consumers) blocks on each SM (three with one consumer)
    r.grid = std::min(r.n_work, std::max<int64_t>(sm_count, 1) * ws_blocks_per_sm(w.consumers));
    r.combine_grid = w.splits ? s.H * s.B * w.period * w.n_split * kWsCombineGroups : 0;
    const bool per_head = p.num_heads > 1;
    r.items_head_stride = per_head ? w.n_items * kWsItemFields : 0;
    r.order_head_stride = per_head ? w.orders_per_head : 0;
    r.combine_head_stride = per_head ? w.n_split * 3 : 0;
    r.slots = w.slots;
    const int64_t hkv = s.Hkv > 0 ? s.Hkv : s.H;
    constexpr long long kElem = 2;  // float16 / bfloat16
    const auto map = [&](int64_t heads, long long sb, long long ss, long long offset) {
        TensorMapShape m;
        m.dims[0] = static_cast<uint64_t>(s.D);
        m.dims[1] = static_cast<uint64_t>(heads);
        m.dims[2] = static_cast<uint64_t>(s.S);
        m.dims[3] = static_cast<uint64_t>(s.B);
        m.strides[0] = static_cast<uint64_t>(s.D * kElem);  // head (element stride D)
        m.strides[1] = static_cast<uint64_t>(ss * kElem);
        m.strides[2] = static_cast<uint64_t>(sb * kElem);
        m.box[0] = kWsBox;
        m.box[1] = 1;
        m.box[2] = kWsBox * static_cast<uint32_t>(w.period);  // 64 rows, period apart
        m.box[3] = 1;
        m.elem[2] = static_cast<uint32_t>(w.period);
        m.offset = offset;
        return m;
    };
    r.q = map(s.H, a.q_sb, a.q_ss, 0);
    r.k = map(hkv, a.k_sb, a.k_ss, a.k_offset);
    r.v = map(hkv, a.k_sb, a.k_ss, a.v_offset);
    if (w.splits) {
        const size_t slot_rows =
            static_cast<size_t>(s.B) * w.period * static_cast<size_t>(s.H) * static_cast<size_t>(w.slots) * rows;
        r.part_o_bytes = slot_rows * static_cast<size_t>(s.D) * sizeof(float);
        r.part_ml_bytes = slot_rows * 2 * sizeof(float);
    }
    return r;
}

}  // namespace stofc_ort
