// stofc attention device helpers shared by the block-wise and row-wise templates.
//
// Reductions over the 4 lanes of an mma quad (lanes sharing g = lane >> 2) and
// over a whole warp; the -inf-safe online-softmax rescale; the runtime key
// validity test (length bound plus optional packed key bits); trimming a walk to the
// run's key length.
#ifndef STOFC_ATTENTION_CUH
#define STOFC_ATTENTION_CUH

#include <stofc/mma.cuh>

namespace stofc {

#define STOFC_NEG_INF (__int_as_float(0xff800000))
#define STOFC_LOG2E 1.4426950408889634f

/// Max over the 4 lanes of a quad.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    return x;
}

/// Sum over the 4 lanes of a quad.
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

/// Max over the 32 lanes of a warp.
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

/// Sum over the 32 lanes of a warp.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/// The subtrahend of the exponent for a running max `m` (in log2 units):
/// 0 when m is -inf so that exp2(-inf - 0) = 0 and never exp2(-inf + inf) = NaN.
__device__ __forceinline__ float safe_max(float m) {
    return m == STOFC_NEG_INF ? 0.0f : m;
}

/// Logit soft-capping, `c * tanh(x / c)` for c > 0, in x's own units (raw scores:
/// c = softcap / scale; log2 units: c = softcap * log2 e). tanh(y) = 1 - 2 / (e^2|y| + 1)
/// with the sign of y: ex2.approx (2^-22 relative) and no cancellation issue for the
/// absolute error (<= 2e-7 * c); large |y| overflows e to inf and gives exactly +-c.
/// Never called on -inf (masking comes after).
__device__ __forceinline__ float soft_cap(float x, float c, float inv_c) {
    const float y = x * inv_c;
    const float e = exp2_fast(2.0f * STOFC_LOG2E * fabsf(y));
    const float t = 1.0f - __fdividef(2.0f, e + 1.0f);
    return copysignf(t, y) * c;
}

/// The end of walk entries [j0, j1) once those whose key is at or past the run's key
/// length `kvl` are dropped. A walk lists any gathered tiles first (key < 0), then
/// contiguous tiles in ascending key order (`tile` keys apart where consecutive), so
/// "key >= kvl" holds exactly on a suffix. Each round below is one dependent load (the
/// loads inside a round are independent), on the critical path of every block or item:
///   1. the last and the first key: most walks end inside the run (done);
///   2. a walk of consecutive tiles (a window, a global row) ends at the guess
///      j0 + ceil((kvl - first) / tile): two loads confirm it (done);
///   3. else a binary search of what round 2 left open, log2 loads.
/// (A 16K package run on 128 tokens walked its global rows' 256 entries in 9 rounds.)
__device__ __forceinline__ int trim_walk(const int* key, int j0, int j1, int kvl, int tile) {
    if (j0 >= j1) return j1;
    const int last = key[j1 - 1];
    const int first = key[j0];
    if (last < kvl) return j1;
    if (first >= 0) {
        const int g = min(j1 - 1, j0 + max(0, (kvl - first + tile - 1) / tile));
        const bool below = g == j0 || key[g - 1] < kvl;   // every entry before g is kept
        const bool above = key[g] >= kvl;                  // entry g is dropped
        if (below && above) return g;
        if (below)
            j0 = g + 1;                                    // key[g] < kvl: the end lies past g
        else
            j1 = g - 1;                                    // key[g - 1] >= kvl: before g - 1
    }
    while (j0 < j1) {
        const int mid = (j0 + j1) >> 1;
        if (key[mid] >= kvl)
            j1 = mid;
        else
            j0 = mid + 1;
    }
    return j1;
}

/// Bit `key` (>= 0) of the packed key-validity words of one sequence.
__device__ __forceinline__ u32 key_bit(const u64* words, int key) {
    return static_cast<u32>((words[key >> 6] >> (key & 63)) & 1ull);
}

}  // namespace stofc

#endif  // STOFC_ATTENTION_CUH
