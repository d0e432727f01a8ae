// stofc gated activation (memory-bound, one pass): out = act(gate + bg) * (up + bu)
// x = [gate | up] is the gated FFN's projection [M, 2F] (__nv_bfloat16), out [M, F]; fp32 math.
// 32 threads per row, 4 rows per block, 16-byte vectors (F % 8 == 0).
// bias=1 act=1 (bias: [bg | bu], [2F]; 0 when cuBLASLt added it).
#include <stofc/gemm_common.cuh>

namespace {
using namespace stofc_ds;
typedef __nv_bfloat16 T;
constexpr int TPR = 32, ROWS = 4;
constexpr int HAS_BIAS = 1, ACT = 1;
constexpr int THREADS = TPR * ROWS;
static_assert(TPR % 32 == 0, "a row is handled by whole warps");
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS) stofc_glu_bfloat16_gelu_erf_b_f768_t32x4(
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
