// stofc ONNX Runtime custom-op library: the `mask.bin` reader.
//
// `mask.bin` is the MaskFormat (stofc/masks/format.py) in a raw little-endian
// layout that C++ reads without numpy; the writer is
// stofc.package.maskbin.write_mask_binary and the layout is documented there and
// in OPS.md. `load_mask_file` validates everything a kernel indexes with (sizes,
// CSR monotonicity and bounds, part indices), so a corrupt or truncated file is
// an error at session creation, never an out-of-bounds read.
#ifndef STOFC_ORT_MASK_FILE_H
#define STOFC_ORT_MASK_FILE_H

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace stofc_ort {

constexpr char kMaskMagic[8] = {'S', 'T', 'O', 'F', 'M', 'A', 'S', 'K'};
constexpr uint32_t kMaskVersion = 1;
constexpr uint32_t kMaskHeaderBytes = 128;

struct MaskData {
    std::string path;
    std::string spec_hash;
    int seq_len = 0;     // L_max
    int tile = 0;        // outer tile size T
    int num_heads = 0;   // 1 = shared by every head
    int tile_rows = 0;   // R = ceil(L_max / T)
    int64_t n_full = 0, n_part = 0, nnz = 0;
    std::vector<int32_t> full_row_ptr, full_col_idx, part_row_ptr, part_col_idx;
    std::vector<uint64_t> part_bitmaps;  // [n_part, (T/8)^2], ITs column-major
    std::vector<int32_t> load_row_ptr, load_col_idx, load_part_idx;
    std::vector<int64_t> row_nnz;        // [num_heads, R]

    int words_per_tile() const { return (tile / 8) * (tile / 8); }

    /// Calls fn(key_begin, key_end, part) for every stored outer tile of query `q`'s
    /// tile row under mask head `mh`, in ascending key order; `part` is the row of
    /// part_bitmaps or -1 for a full tile. Keys are clipped to `[0, key_limit)`.
    template <typename Fn>
    void for_each_tile(int mh, int q, int key_limit, Fn&& fn) const {
        const int r = q / tile;
        const int32_t* rp = load_row_ptr.data() + static_cast<size_t>(mh) * (tile_rows + 1);
        for (int32_t j = rp[r]; j < rp[r + 1]; ++j) {
            const int k0 = load_col_idx[j] * tile;
            if (k0 >= key_limit) break;  // columns are sorted
            const int k1 = k0 + tile < key_limit ? k0 + tile : key_limit;
            fn(k0, k1, load_part_idx[j]);
        }
    }

    /// Whether (q, key) is allowed inside part tile `part` (key in that tile).
    bool part_bit(int part, int q, int key) const {
        const int qr = q % tile, kc = key % tile, itn = tile / 8;
        const uint64_t w = part_bitmaps[static_cast<size_t>(part) * words_per_tile() + (kc / 8) * itn + (qr / 8)];
        return (w >> ((qr % 8) * 8 + (kc % 8))) & 1ull;
    }
};

/// Reads and validates `path`; throws OpError naming the file and the defect.
std::shared_ptr<const MaskData> load_mask_file(const std::string& path);

}  // namespace stofc_ort

#endif  // STOFC_ORT_MASK_FILE_H
