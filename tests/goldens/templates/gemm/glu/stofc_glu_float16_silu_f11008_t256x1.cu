// stofc gated activation (memory-bound, one pass): out = act(gate + bg) * (up + bu)
// x = [gate | up] is the gated FFN's projection [M, 2F] (__half), out [M, F]; fp32 math.
// 256 threads per row, 1 rows per block, 16-byte vectors (F % 8 == 0).
// bias=0 act=4 (bias: [bg | bu], [2F]; 0 when cuBLASLt added it).
#include <stofc/gemm_common.cuh>

namespace {
using namespace stofc_ds;
typedef __half T;
constexpr int TPR = 256, ROWS = 1;
constexpr int HAS_BIAS = 0, ACT = 4;
constexpr int THREADS = TPR * ROWS;
static_assert(TPR % 32 == 0, "a row is handled by whole warps");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS) stofc_glu_float16_silu_f11008_t256x1(
    const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ out, int M, int F) {
  const int rl = threadIdx.x / TPR, lt = threadIdx.x % TPR;
  const int row = blockIdx.x * ROWS + rl;
  if (row >= M) return;
  const T* gate = x + (size_t)row * 2 * F;
  const T* up = gate + F;
  T* dst = out + (size_t)row * F;
  for (int c = lt * 8; c < F; c += TPR * 8) {
    float g[8], u[8], y[8];
    load8(g, gate + c);
    load8(u, up + c);
    if constexpr (HAS_BIAS) {
      float bg[8], bu[8];
      load8(bg, bias + c);
      load8(bu, bias + F + c);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        g[j] += bg[j];
        u[j] += bu[j];
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = activate<ACT>(g[j]) * u[j];
    store8(dst + c, y);
  }
}
