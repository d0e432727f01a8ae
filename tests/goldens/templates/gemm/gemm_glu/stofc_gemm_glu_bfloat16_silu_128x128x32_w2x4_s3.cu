// stofc GEMM with a gated-FFN epilogue: C = act(A @ Wg^T + bg) * (A @ Wu^T + bu)
// mma.sync m16n8k16 (__nv_bfloat16 in, fp32 accumulate), cp.async 3-stage pipeline,
// block tile 128x128x32, warps 2x4; bias=0 act=4.
// W [N, K] holds the gate and up rows INTERLEAVED (row 2f = Wg row f, row 2f+1 = Wu row f;
// bias likewise), so each thread's accumulator pair (columns 2t, 2t+1) is one (gate, up)
// pair and the product is formed in registers: C [M, N/2], column f = pair f.
// Rows (M) and columns (N) are predicated; K and N must be multiples of 8.
#include <stofc/gemm_common.cuh>

namespace {
using namespace stofc_ds;
typedef __nv_bfloat16 T;
typedef Traits<T>::T2 T2;
constexpr int BM = 128, BN = 128, BK = 32;
constexpr int WARPS_M = 2, WARPS_N = 4, STAGES = 3;
constexpr int HAS_BIAS = 0, ACT = 4;
constexpr int THREADS = WARPS_M * WARPS_N * 32;
constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, MI = WM / 16, NI = WN / 8;
constexpr int LDS = BK + 8;  // padded row: ldmatrix rows hit distinct banks
constexpr int A_STAGE = BM * LDS, B_STAGE = BN * LDS;
constexpr int CK = BK / 8;   // 16-byte chunks per tile row
static_assert(WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0 && STAGES >= 2, "tile shape");

__device__ __forceinline__ void load_tile(T* sA, T* sB, const T* A, const T* W, int M, int N,
                                          int K, int m0, int n0, int k0, int tid) {
#pragma unroll
  for (int i = 0; i < (BM * CK + THREADS - 1) / THREADS; ++i) {
    const int c = tid + i * THREADS;
    if (c < BM * CK) {
      const int r = c / CK, kc = (c % CK) * 8, gm = m0 + r, gk = k0 + kc;
      const bool ok = gm < M && gk < K;
      cp_async16(sA + r * LDS + kc, ok ? A + (size_t)gm * K + gk : A, ok ? 16 : 0);
    }
  }
#pragma unroll
  for (int i = 0; i < (BN * CK + THREADS - 1) / THREADS; ++i) {
    const int c = tid + i * THREADS;
    if (c < BN * CK) {
      const int r = c / CK, kc = (c % CK) * 8, gn = n0 + r, gk = k0 + kc;
      const bool ok = gn < N && gk < K;
      cp_async16(sB + r * LDS + kc, ok ? W + (size_t)gn * K + gk : W, ok ? 16 : 0);
    }
  }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS) stofc_gemm_glu_bfloat16_silu_128x128x32_w2x4_s3(
    const T* __restrict__ A, const T* __restrict__ W, T* __restrict__ C,
    const T* __restrict__ bias, int M, int N, int K) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sA = reinterpret_cast<T*>(smem_raw);
  T* sB = sA + STAGES * A_STAGE;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int KT = (K + BK - 1) / BK;

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load_tile(sA + s * A_STAGE, sB + s * B_STAGE, A, W, M, N, K, m0, n0, s * BK, tid);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int pf = kt + STAGES - 1;
    if (pf < KT) {
      load_tile(sA + (pf % STAGES) * A_STAGE, sB + (pf % STAGES) * B_STAGE, A, W, M, N, K, m0,
                n0, pf * BK, tid);
    }
    cp_async_commit();
    const T* a = sA + (kt % STAGES) * A_STAGE;
    const T* b = sB + (kt % STAGES) * B_STAGE;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned af[MI][4];
      unsigned bf[NI][2];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
        ldmatrix_x4(af[mi], a + (wm * WM + mi * 16 + (lane % 16)) * LDS + kk + (lane / 16) * 8);
#pragma unroll
      for (int nj = 0; nj < NI / 2; ++nj) {
        unsigned r[4];
        ldmatrix_x4(r, b + (wn * WN + nj * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk +
                           ((lane >> 3) & 1) * 8);
        bf[2 * nj][0] = r[0];
        bf[2 * nj][1] = r[1];
        bf[2 * nj + 1][0] = r[2];
        bf[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) mma16816<T>(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue, in registers: bias, then act(gate) * up per (gate, up) column pair.
  const int g = lane >> 2, t = lane & 3, NO = N / 2;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int row = m0 + wm * WM + mi * 16 + g + hf * 8;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int col = n0 + wn * WN + ni * 8 + 2 * t;
        float gate = acc[mi][ni][2 * hf], up = acc[mi][ni][2 * hf + 1];
        if (row < M && col < N) {
          if constexpr (HAS_BIAS) {
            const float2 bb = Traits<T>::unpack(*reinterpret_cast<const T2*>(bias + col));
            gate += bb.x;
            up += bb.y;
          }
          C[(size_t)row * NO + col / 2] = Traits<T>::from_float(activate<ACT>(gate) * up);
        }
      }
    }
}
