// stofc downstream kernels: device helpers shared by the GEMM, GLU and norm templates.
// mma.sync m16n8k16 (fp16/bf16 in, fp32 accumulate), ldmatrix, cp.async with
// zero-fill predication, dtype traits, activations. sm_80 and newer.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace stofc_ds {

template <typename T> struct Traits;
template <> struct Traits<__half> {
  using T2 = __half2;
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ __half2 pack(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ float2 unpack(__half2 v) { return __half22float2(v); }
};
template <> struct Traits<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ __nv_bfloat162 pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ float2 unpack(__nv_bfloat162 v) { return __bfloat1622float2(v); }
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; copies `src_bytes` (0 or 16) and zero-fills the rest.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

template <typename T> __device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4],
                                                               unsigned b0, unsigned b1);
template <> __device__ __forceinline__ void mma16816<__half>(float (&d)[4], const unsigned (&a)[4],
                                                             unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4],
                                                                   unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Activations by code (stofc.kernels.epilogue.ACTIVATIONS order).
template <int ACT> __device__ __forceinline__ float activate(float x) {
  if constexpr (ACT == 1) {         // gelu, exact erf form
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
  } else if constexpr (ACT == 2) {  // gelu, tanh approximation
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
  } else if constexpr (ACT == 3) {  // relu
    return fmaxf(x, 0.0f);
  } else if constexpr (ACT == 4) {  // silu: x * sigmoid(x)
    return x / (1.0f + __expf(-x));
  } else {
    return x;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// 8 consecutive elements <-> 8 floats with one 16-byte access (16-bit T: one uint4; float:
// two float4). p must be 16-byte aligned. Used by the norm and GLU templates.
template <typename T>
__device__ __forceinline__ void load8(float (&d)[8], const T* p) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const typename Traits<T>::T2* h = reinterpret_cast<const typename Traits<T>::T2*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = Traits<T>::unpack(h[j]);
    d[2 * j] = f.x;
    d[2 * j + 1] = f.y;
  }
}

__device__ __forceinline__ void load8(float (&d)[8], const float* p) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  d[0] = a.x; d[1] = a.y; d[2] = a.z; d[3] = a.w;
  d[4] = b.x; d[5] = b.y; d[6] = b.z; d[7] = b.w;
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&d)[8]) {
  uint4 raw;
  typename Traits<T>::T2* h = reinterpret_cast<typename Traits<T>::T2*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = Traits<T>::pack(d[2 * j], d[2 * j + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// Sum over the WPR warps that hold one row (row rl of a block, lane lt of the row); every
// thread gets the total. With WPR > 1 every thread of the block must call it (barriers);
// red holds ROWS * WPR floats.
template <int WPR>
__device__ __forceinline__ float row_sum(float v, float* red, int rl, int lt) {
  v = warp_sum(v);
  if constexpr (WPR > 1) {
    __syncthreads();
    if ((lt & 31) == 0) red[rl * WPR + lt / 32] = v;
    __syncthreads();
    v = 0.0f;
#pragma unroll
    for (int w = 0; w < WPR; ++w) v += red[rl * WPR + w];
  }
  return v;
}

}  // namespace stofc_ds
