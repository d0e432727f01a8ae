// stofc EmbedLayerNorm (memory-bound, one pass): out[b, s] = LayerNorm(sum_i table_i[ids_i[b, s]])
// __half tables and out, fp32 math; 3 summand(s), added in order; gamma / beta
// T, beta=1. 32 threads per row (one token), 4 rows per block,
// 3 16-byte vectors per thread (rows up to 768 wide, C % 8 == 0). The
// row stays in registers; one write. An id outside [-V, V) makes its token's row NaN.
// cuda/ort/OPS.md, "EmbedLayerNorm".
#include <stofc/gemm_common.cuh>

namespace {
using namespace stofc_ds;
typedef __half T;
typedef T TP;
constexpr int TPR = 32, ROWS = 4, ITEMS = 3;
constexpr int SUMMANDS = 3, HAS_BETA = 1;
constexpr int THREADS = TPR * ROWS, WPR = TPR / 32;
static_assert(TPR % 32 == 0, "a row is handled by whole warps");
static_assert(SUMMANDS >= 1 && SUMMANDS <= 3, "one to three gathered tables");

// The table row a token reads: ids[at] (int32 when `i32`, else int64), or `at` itself when
// there are no ids (null: the token's sequence position, strides 0 and 1); a negative id
// counted from the end (ONNX Gather); -1 when it is outside [-V, V).
__device__ __forceinline__ long long table_row(const void* ids, bool i32, long long at, long long V) {
  long long id = ids == nullptr ? at
                 : i32 ? static_cast<long long>(static_cast<const int*>(ids)[at])
                       : static_cast<const long long*>(ids)[at];
  if (id < 0) id += V;
  return id >= 0 && id < V ? id : -1;
}
}  // namespace

// Grid ceil(B*S / ROWS): row r of the launch is token (b, s) = (r / S, r % S). Summand i reads
// ids_i[b * sb_i + s * ss_i] (strides 0 broadcast an axis of size 1), bit i of ids32 set when
// ids_i is int32; a null ids_i reads row b * sb_i + s * ss_i itself (the host passes 0 and 1:
// the sequence position); table i has V_i rows of C elements. Pointers of the summands past
// SUMMANDS are not read.
extern "C" __global__ void __launch_bounds__(THREADS) stofc_embed_norm_float16_e3_ln_n768_t32x4(
    const void* __restrict__ ids0, const void* __restrict__ ids1, const void* __restrict__ ids2,
    const T* __restrict__ table0, const T* __restrict__ table1, const T* __restrict__ table2,
    const TP* __restrict__ gamma, const TP* __restrict__ beta, T* __restrict__ out,
    long long sb0, long long ss0, long long sb1, long long ss1, long long sb2, long long ss2,
    long long V0, long long V1, long long V2, int ids32, int B, int S, int C, float eps) {
  __shared__ float red[ROWS * WPR];
  const int rl = threadIdx.x / TPR, lt = threadIdx.x % TPR;
  const int row = blockIdx.x * ROWS + rl;
  const bool row_ok = row < B * S;
  const T* src[SUMMANDS];
  bool valid = row_ok;
  {
    const int b = row_ok ? row / S : 0, s = row_ok ? row - b * S : 0;
    const void* ids[3] = {ids0, ids1, ids2};
    const T* tables[3] = {table0, table1, table2};
    const long long sb[3] = {sb0, sb1, sb2}, ss[3] = {ss0, ss1, ss2}, V[3] = {V0, V1, V2};
#pragma unroll
    for (int i = 0; i < SUMMANDS; ++i) {
      const long long r = row_ok ? table_row(ids[i], (ids32 >> i) & 1, b * sb[i] + s * ss[i], V[i]) : 0;
      valid = valid && r >= 0;
      src[i] = tables[i] + (r > 0 ? r : 0) * static_cast<long long>(C);
    }
  }
  float v[ITEMS][8];
  float sum = 0.0f;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int c = (it * TPR + lt) * 8;
#pragma unroll
    for (int j = 0; j < 8; ++j) v[it][j] = 0.0f;
    if (valid && c < C) {
      load8(v[it], src[0] + c);
#pragma unroll
      for (int i = 1; i < SUMMANDS; ++i) {
        float t[8];
        load8(t, src[i] + c);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[it][j] += t[j];
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += v[it][j];
  }
  const float inv_n = 1.0f / static_cast<float>(C);
  const float mean = row_sum<WPR>(sum, red, rl, lt) * inv_n;
  float q = 0.0f;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const bool ok = (it * TPR + lt) * 8 < C;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float d = v[it][j] - mean;
      q += ok ? d * d : 0.0f;
    }
  }
  const float rstd = rsqrtf(row_sum<WPR>(q, red, rl, lt) * inv_n + eps);
  const float nan = __int_as_float(0x7fc00000);
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int c = (it * TPR + lt) * 8;
    if (row_ok && c < C) {
      float gm[8], y[8];
      load8(gm, gamma + c);
#pragma unroll
      for (int j = 0; j < 8; ++j) y[j] = (v[it][j] - mean) * rstd * gm[j];
      if constexpr (HAS_BETA) {
        float bt[8];
        load8(bt, beta + c);
#pragma unroll
        for (int j = 0; j < 8; ++j) y[j] += bt[j];
      }
      if (!valid) {
#pragma unroll
        for (int j = 0; j < 8; ++j) y[j] = nan;
      }
      store8(out + static_cast<long long>(row) * C + c, y);
    }
  }
}
