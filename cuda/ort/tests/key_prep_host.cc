// Host build of cuda/ort/key_prep.cu for the unit tests (no GPU): one block of ONE
// thread per sequence, which runs the kernel's three phases in order, so its
// kv_len / key-bit logic can be compared with stofc/runtime/attention.py on the CPU.
// stdin: "kpm_type B S" then B*S integers (the mask); stdout: B kv_len values, then
// B*key_words words (key_words = ceil(S/64) with a mask, else 0).
#include <algorithm>
#include <cstdint>
#include <iostream>
#include <vector>

#define __global__
#define __restrict__
#define __shared__ static
struct Dim {
    int x = 0;
};
static Dim blockIdx, threadIdx, blockDim;
static void __syncthreads() {}
static int __clzll(long long x) { return __builtin_clzll(static_cast<unsigned long long>(x)); }
static int atomicMax(int* p, int v) {
    const int old = *p;
    *p = std::max(old, v);
    return old;
}
#include "../key_prep.cu"

int main() {
    int type = 0, B = 0, S = 0;
    std::cin >> type >> B >> S;
    std::vector<long long> i64(static_cast<size_t>(B) * S);
    std::vector<int> i32(i64.size());
    std::vector<unsigned char> u8(i64.size());
    for (size_t i = 0; i < i64.size(); ++i) {
        if (type == 0) break;
        std::cin >> i64[i];
        i32[i] = static_cast<int>(i64[i]);
        u8[i] = static_cast<unsigned char>(i64[i] != 0);
    }
    const void* kpm = type == 1 ? static_cast<const void*>(i64.data())
                      : type == 2 ? static_cast<const void*>(i32.data())
                      : type == 3 ? static_cast<const void*>(u8.data())
                                  : nullptr;
    const int key_words = type ? (S + 63) / 64 : 0;
    std::vector<int> kv_len(B, -1);
    std::vector<unsigned long long> words(static_cast<size_t>(B) * key_words + 1, 0xdeadull);
    blockDim.x = 1;
    for (int b = 0; b < B; ++b) {
        blockIdx.x = b;
        threadIdx.x = 0;
        stofc_key_prep(kpm, type, B, S, key_words, kv_len.data(), words.data());
    }
    for (int b = 0; b < B; ++b) std::cout << kv_len[b] << (b + 1 < B ? ' ' : '\n');
    for (int i = 0; i < B * key_words; ++i) std::cout << words[i] << (i + 1 < B * key_words ? ' ' : '\n');
    if (key_words == 0) std::cout << "\n";
    return 0;
}
