// stofc device helpers: tensor-core MMA, ldmatrix, cp.async, packing, dtype traits.
//
// Contract (read-only for every template that includes it):
//   * Everything is `__device__ __forceinline__` in namespace `stofc`; no globals.
//   * Needs sm_80 or newer (mma.sync m16n8k16 with bf16, cp.async, ldmatrix).
//   * Fragment layouts are the PTX ISA's (see design/KERNELS.md): with
//     g = lane >> 2 and t = lane & 3,
//       A 16x16 (row):  a0 = (g, 2t..2t+1)   a1 = (g+8, 2t..)  a2 = (g, 2t+8..)  a3 = (g+8, 2t+8..)
//       B 16x8  (col):  b0 = (k 2t..2t+1, n g)                 b1 = (k 2t+8..2t+9, n g)
//       C 16x8  (f32):  c0,c1 = (g, 2t..2t+1)                  c2,c3 = (g+8, 2t..2t+1)
//   * Switch fp16/bf16 with one typedef: `using DT = stofc::DTypeTraits<__half>;`
//     then use DT::scalar, DT::pair, DT::mma(...), DT::pack(...), DT::to_float2(...).
// NVRTC has no <cstdint>: the 32/64-bit unsigned types are aliased below.
#ifndef STOFC_MMA_CUH
#define STOFC_MMA_CUH

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace stofc {

typedef unsigned int u32;
typedef unsigned long long u64;

// ---------------------------------------------------------------- addresses

/// Shared-memory address (32-bit, .shared window) of a generic pointer into smem.
__device__ __forceinline__ u32 smem_addr(const void* ptr) {
    return static_cast<u32>(__cvta_generic_to_shared(ptr));
}

// ---------------------------------------------------------------- ldmatrix

/// Four 8x8 b16 matrices; lanes 8i..8i+7 give the 16-byte row addresses of matrix i.
/// r[i] receives this lane's two elements (row lane/4, cols 2*(lane%4)..+1) of matrix i.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

/// As ldmatrix_x4, transposed: r[i] holds (rows 2*(lane%4)..+1, col lane/4) of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

/// Two 8x8 b16 matrices (lanes 0..15 give the addresses).
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

/// Two 8x8 b16 matrices, transposed.
__device__ __forceinline__ void ldmatrix_x2_trans(u32 (&r)[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// ---------------------------------------------------------------- mma.sync

/// d += A(16x16 fp16, row) * B(16x8 fp16, col), fp32 accumulate, in place.
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const u32 (&a)[4],
                                                 const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/// d += A(16x16 bf16, row) * B(16x8 bf16, col), fp32 accumulate, in place.
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const u32 (&a)[4],
                                                  const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---------------------------------------------------------------- cp.async

/// 16-byte global->shared copy, L2 only (.cg). When `pred` is false nothing is
/// read and the 16 destination bytes are zero-filled (src-size 0).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool pred) {
    const int src_size = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_size));
}

/// 8-byte global->shared copy (.ca; sizes below 16 cannot use .cg), zero-filled when !pred.
__device__ __forceinline__ void cp_async_8(u32 dst, const void* src, bool pred) {
    const int src_size = pred ? 8 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_size));
}

/// Close the current group of cp.async copies (an empty group is legal).
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}

/// Wait until at most N groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

/// Wait for every cp.async of this thread.
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;\n" ::);
}

// ---------------------------------------------------------------- math

/// 2^x, fast approximate (ex2.approx.ftz); 2^-inf = 0.
__device__ __forceinline__ float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// ---------------------------------------------------------------- packing

/// Two floats -> one 32-bit register holding (lo, hi) as fp16.
__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}

/// Two floats -> one 32-bit register holding (lo, hi) as bf16.
__device__ __forceinline__ u32 pack_bf162(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}

// ---------------------------------------------------------------- dtype traits

/// Switch a template between fp16 and bf16 with one typedef.
template <typename T>
struct DTypeTraits;

template <>
struct DTypeTraits<__half> {
    typedef __half scalar;
    typedef __half2 pair;
    __device__ __forceinline__ static void mma(float (&d)[4], const u32 (&a)[4],
                                               const u32 (&b)[2]) {
        mma_m16n8k16_f16(d, a, b);
    }
    __device__ __forceinline__ static u32 pack(float lo, float hi) { return pack_half2(lo, hi); }
    __device__ __forceinline__ static float2 to_float2(u32 bits) {
        __half2 h = *reinterpret_cast<__half2*>(&bits);
        return __half22float2(h);
    }
    __device__ __forceinline__ static float to_float(scalar x) { return __half2float(x); }
    __device__ __forceinline__ static scalar from_float(float x) { return __float2half_rn(x); }
};

template <>
struct DTypeTraits<__nv_bfloat16> {
    typedef __nv_bfloat16 scalar;
    typedef __nv_bfloat162 pair;
    __device__ __forceinline__ static void mma(float (&d)[4], const u32 (&a)[4],
                                               const u32 (&b)[2]) {
        mma_m16n8k16_bf16(d, a, b);
    }
    __device__ __forceinline__ static u32 pack(float lo, float hi) { return pack_bf162(lo, hi); }
    __device__ __forceinline__ static float2 to_float2(u32 bits) {
        __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&bits);
        return __bfloat1622float2(h);
    }
    __device__ __forceinline__ static float to_float(scalar x) { return __bfloat162float(x); }
    __device__ __forceinline__ static scalar from_float(float x) { return __float2bfloat16_rn(x); }
};

}  // namespace stofc

#endif  // STOFC_MMA_CUH
