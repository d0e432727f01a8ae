// stofc rotary position embedding (memory-bound, one pass): the ai.stofc Rotary op's CUDA twin.
// out [B, S, (H + 2*Hkv) * D] = [Q' | K' | V]: every Q and K head's first RD elements rotated
// (rotate-half), the rest and V copied; __nv_bfloat16 in and out, fp32 math (no contraction: the
// CPU twin's float arithmetic), cos / sin float32 tables. cuda/ort/OPS.md, "Rotary".
// head_dim=96 rotary_dim=32 interleaved=false
// 8-element vectors; 256 threads per block walk one token's units.
#include <stofc/gemm_common.cuh>

namespace {
using namespace stofc_ds;
typedef __nv_bfloat16 T;
constexpr int D = 96, RD = 32, VEC = 8;
constexpr int THREADS = 256;
constexpr bool INTERLEAVED = false;
constexpr int HALF = RD / 2;
// units of VEC elements (rotate-half: VEC pairs (j, j + HALF)) per Q/K head, per V head
constexpr int ROT_UNITS = INTERLEAVED ? RD / VEC : HALF / VEC;
constexpr int QK_UNITS = ROT_UNITS + (D - RD) / VEC;
constexpr int V_UNITS = D / VEC;
static_assert(RD % 2 == 0 && RD <= D, "rotary_dim is even and at most head_dim");
static_assert(D % VEC == 0 && (RD - (INTERLEAVED ? 0 : HALF)) % VEC == 0, "whole vectors");
static_assert(!INTERLEAVED || VEC % 2 == 0, "interleaved vectors hold whole pairs");

template <int N> struct Raw;
template <> struct Raw<8> { typedef uint4 type; };
template <> struct Raw<4> { typedef uint2 type; };
template <> struct Raw<2> { typedef unsigned type; };
template <> struct Raw<1> { typedef unsigned short type; };
typedef Raw<VEC>::type Vec;

__device__ __forceinline__ void load(float (&d)[VEC], const T* p) {
  const Vec raw = *reinterpret_cast<const Vec*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int j = 0; j < VEC; ++j) d[j] = Traits<T>::to_float(e[j]);
}

__device__ __forceinline__ void store(T* p, const float (&d)[VEC]) {
  Vec raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int j = 0; j < VEC; ++j) e[j] = Traits<T>::from_float(d[j]);
  *reinterpret_cast<Vec*>(p) = raw;
}

__device__ __forceinline__ void copy(T* dst, const T* src) {
  *reinterpret_cast<Vec*>(dst) = *reinterpret_cast<const Vec*>(src);
}

// x * c + r * s, rounded as the CPU twin's float expression (two products, one sum)
__device__ __forceinline__ float rot(float x, float c, float r, float s) {
  return __fadd_rn(__fmul_rn(x, c), __fmul_rn(r, s));
}
}  // namespace

// One block per token (b, s): grid B*S. pos_mode: 0 the table row is s (cos [S, W] or
// [B, S, W]: t_sb = 0 or S*W); 1 position ids [B or 1, S] (pos_sb = S or 0); 2 an offset,
// row = pos[0] + s. A row outside [0, rows) makes the token's rotated elements NaN.
// W = RD (full tables) or RD / 2 (half tables: pair j reads column j).
extern "C" __global__ void __launch_bounds__(THREADS) stofc_rotary_bfloat16_d96_r32_rh_v8_t256(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, long long q_sb, long long q_ss, long long k_sb, long long k_ss,
    long long v_sb, long long v_ss, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, long long t_sb, int W, const long long* __restrict__ pos,
    long long pos_sb, int pos_mode, int rows, int B, int S, int H, int Hkv) {
  const int token = blockIdx.x;
  if (token >= B * S) return;
  const int b = token / S, s = token - b * S;
  const int qk_units = (H + Hkv) * QK_UNITS, units = qk_units + Hkv * V_UNITS;
  T* const row_out = out + (long long)token * (H + 2 * Hkv) * D;
  long long row = s;
  if (pos_mode == 1) row = pos[b * pos_sb + s];
  else if (pos_mode == 2) row = pos[0] + s;
  const bool valid = row >= 0 && row < rows;
  const long long base = (pos_mode == 0 ? b * t_sb : 0) + (valid ? row : 0) * W;
  const float* const ct = cos_t + base;
  const float* const st = sin_t + base;
  const bool half_table = 2 * W == RD;
  const float nan = __int_as_float(0x7fc00000);
  for (int u = threadIdx.x; u < units; u += THREADS) {
    if (u >= qk_units) {  // V: copied
      const int vh = (u - qk_units) / V_UNITS, at = (u - qk_units - vh * V_UNITS) * VEC;
      copy(row_out + (long long)(H + Hkv + vh) * D + at,
           v + b * v_sb + s * v_ss + (long long)vh * D + at);
      continue;
    }
    const int head = u / QK_UNITS, w = u - head * QK_UNITS;
    const T* src = head < H ? q + b * q_sb + s * q_ss + (long long)head * D
                            : k + b * k_sb + s * k_ss + (long long)(head - H) * D;
    T* dst = row_out + (long long)head * D;
    if (w >= ROT_UNITS) {  // past the rotary dimensions: copied
      const int at = RD + (w - ROT_UNITS) * VEC;
      copy(dst + at, src + at);
      continue;
    }
    if (INTERLEAVED) {
      const int i0 = w * VEC;
      float x[VEC], y[VEC];
      load(x, src + i0);
#pragma unroll
      for (int t = 0; t < VEC; t += 2) {
        const int c0 = half_table ? (i0 + t) / 2 : i0 + t, c1 = half_table ? c0 : c0 + 1;
        y[t] = valid ? rot(x[t], ct[c0], -x[t + 1], st[c0]) : nan;
        y[t + 1] = valid ? rot(x[t + 1], ct[c1], x[t], st[c1]) : nan;
      }
      store(dst + i0, y);
    } else {
      const int j0 = w * VEC;
      float a[VEC], c[VEC], ya[VEC], yc[VEC];
      load(a, src + j0);
      load(c, src + HALF + j0);
#pragma unroll
      for (int t = 0; t < VEC; ++t) {
        const int lo = j0 + t, hi = half_table ? lo : HALF + lo;
        ya[t] = valid ? rot(a[t], ct[lo], -c[t], st[lo]) : nan;
        yc[t] = valid ? rot(c[t], ct[hi], a[t], st[hi]) : nan;
      }
      store(dst + j0, ya);
      store(dst + HALF + j0, yc);
    }
  }
}
