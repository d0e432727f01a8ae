// stofc GEMM with fused epilogue: C = epilogue(A[M,K] @ W[N,K]^T)
// mma.sync m16n8k16 (__nv_bfloat16 in, fp32 accumulate), cp.async 4-stage pipeline,
// block tile 64x128x64, warps 2x2.
// Epilogue: bias=1 act=0 residual=0 norm=0
// shift=0 store_pre_norm=0 store_heads=1.
// Rows (M) and columns (N) are predicated; K and N must be multiples of 8.
// With a norm the block spans the full row (gridDim.x == 1, N <= BN).
#include <stofc/gemm_common.cuh>

namespace {
using namespace stofc_ds;
typedef __nv_bfloat16 T;
typedef Traits<T>::T2 T2;
constexpr int BM = 64, BN = 128, BK = 64;
constexpr int WARPS_M = 2, WARPS_N = 2, STAGES = 4;
constexpr int HAS_BIAS = 1, ACT = 0, HAS_RESIDUAL = 0;
constexpr int NORM = 0, NORM_SHIFT = 0, STORE_PRE_NORM = 0;
constexpr int STORE_HEADS = 1;
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

__device__ __forceinline__ size_t out_offset(int row, int col, int M, int N, int seq_len,
                                             int heads, int head_dim) {
  if constexpr (STORE_HEADS) {  // [G, B, H, S, D] with G = N / (H * D)
    const int batch = M / seq_len, b = row / seq_len, s = row % seq_len;
    const int hd = heads * head_dim, grp = col / hd, rem = col % hd;
    const int h = rem / head_dim, d = rem % head_dim;
    return ((((size_t)grp * batch + b) * heads + h) * seq_len + s) * head_dim + d;
  } else {
    return (size_t)row * N + col;
  }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS) stofc_gemm_bfloat16_b_heads_64x128x64_w2x2_s4(
    const T* __restrict__ A, const T* __restrict__ W, T* __restrict__ C,
    const T* __restrict__ bias, const T* __restrict__ residual, const T* __restrict__ gamma,
    const T* __restrict__ beta, T* __restrict__ pre_norm, int M, int N, int K, int seq_len,
    int heads, int head_dim, float eps) {
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

  // Epilogue, in registers: bias -> activation -> residual (-> row norm).
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int row = m0 + wm * WM + mi * 16 + g + hf * 8;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int col = n0 + wn * WN + ni * 8 + 2 * t;
        float v0 = acc[mi][ni][2 * hf], v1 = acc[mi][ni][2 * hf + 1];
        if (col < N) {
          if constexpr (HAS_BIAS) {
            const float2 bb = Traits<T>::unpack(*reinterpret_cast<const T2*>(bias + col));
            v0 += bb.x;
            v1 += bb.y;
          }
          v0 = activate<ACT>(v0);
          v1 = activate<ACT>(v1);
          if constexpr (HAS_RESIDUAL) {
            if (row < M) {
              const float2 rr = Traits<T>::unpack(
                  *reinterpret_cast<const T2*>(residual + (size_t)row * N + col));
              v0 += rr.x;
              v1 += rr.y;
            }
          }
        } else {
          v0 = 0.0f;
          v1 = 0.0f;
        }
        acc[mi][ni][2 * hf] = v0;
        acc[mi][ni][2 * hf + 1] = v1;
        if constexpr (NORM == 0 || STORE_PRE_NORM) {
          if (row < M && col < N) {
            T* dst = NORM == 0 ? C + out_offset(row, col, M, N, seq_len, heads, head_dim)
                               : pre_norm + (size_t)row * N + col;
            *reinterpret_cast<T2*>(dst) = Traits<T>::pack(v0, v1);
          }
        }
      }
    }
  if constexpr (NORM != 0) {
    // The block holds whole rows: reduce each row over its quad, then over WARPS_N warps.
    float* red = reinterpret_cast<float*>(smem_raw);  // [2][WARPS_N][BM]
    float mean[MI][2], rstd[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float s = 0.0f, q = 0.0f;
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const float a0 = acc[mi][ni][2 * hf], a1 = acc[mi][ni][2 * hf + 1];
          s += a0 + a1;
          q += a0 * a0 + a1 * a1;
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        q += __shfl_xor_sync(0xffffffffu, q, 1);
        q += __shfl_xor_sync(0xffffffffu, q, 2);
        const int lr = wm * WM + mi * 16 + g + hf * 8;
        if (t == 0) {
          red[wn * BM + lr] = s;
          red[WARPS_N * BM + wn * BM + lr] = q;
        }
      }
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int lr = wm * WM + mi * 16 + g + hf * 8;
        float s = 0.0f, q = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS_N; ++w) {
          s += red[w * BM + lr];
          q += red[WARPS_N * BM + w * BM + lr];
        }
        const float inv_n = 1.0f / static_cast<float>(N);
        if constexpr (NORM == 1) {  // LayerNorm; two-pass variance from registers below
          mean[mi][hf] = s * inv_n;
        } else {                    // RMSNorm
          mean[mi][hf] = 0.0f;
          rstd[mi][hf] = rsqrtf(q * inv_n + eps);
        }
      }
    if constexpr (NORM == 1) {
      __syncthreads();  // everyone has read red[] before it is reused
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float q = 0.0f;
#pragma unroll
          for (int ni = 0; ni < NI; ++ni) {
            const int col = n0 + wn * WN + ni * 8 + 2 * t;
            const float d0 = acc[mi][ni][2 * hf] - mean[mi][hf];
            const float d1 = acc[mi][ni][2 * hf + 1] - mean[mi][hf];
            q += col < N ? d0 * d0 + d1 * d1 : 0.0f;
          }
          q += __shfl_xor_sync(0xffffffffu, q, 1);
          q += __shfl_xor_sync(0xffffffffu, q, 2);
          if (t == 0) red[wn * BM + wm * WM + mi * 16 + g + hf * 8] = q;
        }
      __syncthreads();
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float q = 0.0f;
#pragma unroll
          for (int w = 0; w < WARPS_N; ++w) q += red[w * BM + wm * WM + mi * 16 + g + hf * 8];
          rstd[mi][hf] = rsqrtf(q / static_cast<float>(N) + eps);
        }
    }
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = m0 + wm * WM + mi * 16 + g + hf * 8;
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const int col = n0 + wn * WN + ni * 8 + 2 * t;
          if (row < M && col < N) {
            const float2 gg = Traits<T>::unpack(*reinterpret_cast<const T2*>(gamma + col));
            float y0 = (acc[mi][ni][2 * hf] - mean[mi][hf]) * rstd[mi][hf] * gg.x;
            float y1 = (acc[mi][ni][2 * hf + 1] - mean[mi][hf]) * rstd[mi][hf] * gg.y;
            if constexpr (NORM_SHIFT) {
              const float2 bb = Traits<T>::unpack(*reinterpret_cast<const T2*>(beta + col));
              y0 += bb.x;
              y1 += bb.y;
            }
            *reinterpret_cast<T2*>(C + (size_t)row * N + col) = Traits<T>::pack(y0, y1);
          }
        }
      }
  }
}
