// stofc ONNX Runtime custom-op library: the reader shared by the package's binary
// files (`mask.bin`, `*.plan.bin`): little-endian scalars at fixed offsets, then
// 8-byte-aligned arrays; any overrun is an OpError naming the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"

namespace stofc_ort {

struct BinaryReader {
    const char* kind;  // "mask file", "attention launch plan": how errors name the file
    const std::string& path;
    const std::vector<char>& buf;
    size_t pos;  // where the next array starts (after the header)

    [[noreturn]] void fail(const std::string& what) const {
        throw OpError(std::string(kind) + " '" + path + "' is corrupt: " + what +
                          "; rewrite the package with 'stofc compile'",
                      ORT_INVALID_GRAPH);
    }

    template <typename T>
    T scalar(size_t offset) const {
        if (offset + sizeof(T) > buf.size()) fail("truncated header");
        T v;
        std::memcpy(&v, buf.data() + offset, sizeof(T));
        return v;
    }

    template <typename T>
    std::vector<T> array(int64_t count, const char* name) {
        if (count < 0) fail(std::string(name) + " has a negative length");
        pos = (pos + 7) & ~static_cast<size_t>(7);
        if (static_cast<uint64_t>(count) > buf.size()) fail(std::string("truncated inside ") + name);
        const size_t bytes = static_cast<size_t>(count) * sizeof(T);
        if (pos + bytes > buf.size()) fail(std::string("truncated inside ") + name);
        std::vector<T> out(static_cast<size_t>(count));
        if (bytes) std::memcpy(out.data(), buf.data() + pos, bytes);
        pos += bytes;
        return out;
    }
};

}  // namespace stofc_ort
