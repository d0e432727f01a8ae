// stofc ONNX Runtime custom-op library: `mask.bin` reading and validation.
#include "mask_file.h"

#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <map>
#include <mutex>

#include "binary_reader.h"
#include "common.h"

namespace stofc_ort {
namespace {

void check_csr(BinaryReader& rd, const std::vector<int32_t>& row_ptr, const std::vector<int32_t>& col_idx,
               int heads, int rows, const char* name) {
    const int64_t n = static_cast<int64_t>(col_idx.size());
    int64_t prev = 0;
    for (int h = 0; h < heads; ++h) {
        const int32_t* rp = row_ptr.data() + static_cast<size_t>(h) * (rows + 1);
        if (rp[0] < prev) rd.fail(std::string(name) + " row_ptr of head " + std::to_string(h) + " goes backwards");
        for (int r = 0; r < rows; ++r) {
            if (rp[r + 1] < rp[r]) rd.fail(std::string(name) + " row_ptr is not monotone");
            if (rp[r + 1] > n) rd.fail(std::string(name) + " row_ptr points past col_idx");
            for (int32_t j = rp[r]; j < rp[r + 1]; ++j) {
                if (col_idx[j] < 0 || col_idx[j] >= rows) rd.fail(std::string(name) + " col_idx out of range");
                if (j > rp[r] && col_idx[j] <= col_idx[j - 1]) rd.fail(std::string(name) + " col_idx not ascending");
            }
        }
        prev = rp[rows];
    }
}

std::shared_ptr<const MaskData> parse(const std::string& path, const std::vector<char>& buf) {
    BinaryReader rd{"mask file", path, buf, kMaskHeaderBytes};
    if (buf.size() < kMaskHeaderBytes) rd.fail("shorter than its header");
    if (std::memcmp(buf.data(), kMaskMagic, 8) != 0) rd.fail("bad magic (not a stofc mask.bin)");
    const auto version = rd.scalar<uint32_t>(8);
    if (version != kMaskVersion)
        throw OpError("mask file '" + path + "' has layout version " + std::to_string(version) +
                          ", this library reads version " + std::to_string(kMaskVersion) +
                          "; rebuild the package and its library with the same stofc",
                      ORT_INVALID_GRAPH);
    if (rd.scalar<uint32_t>(12) != kMaskHeaderBytes) rd.fail("unexpected header size");

    auto m = std::make_shared<MaskData>();
    m->path = path;
    m->seq_len = rd.scalar<int32_t>(16);
    m->tile = rd.scalar<int32_t>(20);
    m->num_heads = rd.scalar<int32_t>(24);
    m->tile_rows = rd.scalar<int32_t>(28);
    m->n_full = rd.scalar<int64_t>(32);
    m->n_part = rd.scalar<int64_t>(40);
    m->nnz = rd.scalar<int64_t>(48);
    const auto payload = rd.scalar<uint64_t>(56);
    m->spec_hash.assign(buf.data() + 64, strnlen(buf.data() + 64, 64));

    if (payload + kMaskHeaderBytes != buf.size()) rd.fail("size does not match its header (truncated?)");
    if (m->tile < 8 || m->tile % 8 != 0) rd.fail("tile must be a positive multiple of 8");
    if (m->seq_len < 1 || m->num_heads < 1) rd.fail("seq_len and num_heads must be >= 1");
    if (m->tile_rows != (m->seq_len + m->tile - 1) / m->tile) rd.fail("tile_rows != ceil(seq_len / tile)");
    if (m->n_full < 0 || m->n_part < 0) rd.fail("negative tile counts");

    const int64_t H = m->num_heads, R = m->tile_rows;
    m->full_row_ptr = rd.array<int32_t>(H * (R + 1), "full_row_ptr");
    m->full_col_idx = rd.array<int32_t>(m->n_full, "full_col_idx");
    m->part_row_ptr = rd.array<int32_t>(H * (R + 1), "part_row_ptr");
    m->part_col_idx = rd.array<int32_t>(m->n_part, "part_col_idx");
    m->part_bitmaps = rd.array<uint64_t>(m->n_part * m->words_per_tile(), "part_bitmaps");
    m->load_row_ptr = rd.array<int32_t>(H * (R + 1), "load_row_ptr");
    m->load_col_idx = rd.array<int32_t>(m->n_full + m->n_part, "load_col_idx");
    m->load_part_idx = rd.array<int32_t>(m->n_full + m->n_part, "load_part_idx");
    m->row_nnz = rd.array<int64_t>(H * R, "row_nnz");
    rd.pos = (rd.pos + 7) & ~static_cast<size_t>(7);
    if (rd.pos != buf.size()) rd.fail("trailing bytes after row_nnz");

    check_csr(rd, m->full_row_ptr, m->full_col_idx, m->num_heads, m->tile_rows, "full");
    check_csr(rd, m->part_row_ptr, m->part_col_idx, m->num_heads, m->tile_rows, "part");
    check_csr(rd, m->load_row_ptr, m->load_col_idx, m->num_heads, m->tile_rows, "load");
    for (int32_t p : m->load_part_idx)
        if (p < -1 || p >= m->n_part) rd.fail("load_part_idx out of range");
    return m;
}

}  // namespace

std::shared_ptr<const MaskData> load_mask_file(const std::string& path) {
    // Many nodes (every layer) share one mask file: read it once per process, keyed
    // by path, size and modification time so a rewritten package is read afresh.
    static std::mutex mu;
    static std::map<std::string, std::weak_ptr<const MaskData>> cache;
    struct stat st {};
    const std::string key = ::stat(path.c_str(), &st) == 0
                                ? path + "|" + std::to_string(st.st_size) + "|" + std::to_string(st.st_mtim.tv_sec) +
                                      "." + std::to_string(st.st_mtim.tv_nsec)
                                : path;
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end())
        if (auto hit = it->second.lock()) return hit;

    std::ifstream f(path, std::ios::binary);
    if (!f)
        throw OpError("mask file '" + path +
                          "' cannot be opened; check the package directory (session config entry '" +
                          kPackageDirKey + "', else the directory of libstofc_ort.so)",
                      ORT_NO_SUCHFILE);
    std::vector<char> buf((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    auto m = parse(path, buf);
    cache[key] = m;
    return m;
}

}  // namespace stofc_ort
