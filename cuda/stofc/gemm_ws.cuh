// stofc Hopper GEMM helpers: wgmma with both operands in shared memory, A K-major and
// B MN-major (a row-major [K, N] weight read as stored), N = 128 or 256 (sm_90a only).
//
// Contract (read-only for every template that includes it):
//   * Compile with -arch=sm_90a; wgmma.cuh (included here) gives the descriptors, fences and
//     the accumulator operand-list macros.
//   * Operand layouts are wgmma.cuh's 128-byte-swizzled panels: A is one panel of 64 rows
//     by 64 k (k16 step kk at +32 kk bytes, descriptor sw128_desc(a, 16, 1024)); B is N / 64
//     panels of 64 k rows by 64 n columns placed `lbo` bytes apart (k16 step kk at
//     +2048 kk bytes, descriptor sw128_desc(b, lbo, 1024)).
//   * d holds the m64nNk16 accumulator layout of wgmma.cuh; `accumulate` 0 overwrites d.
#ifndef STOFC_GEMM_WS_CUH
#define STOFC_GEMM_WS_CUH

#include <stofc/wgmma.cuh>

namespace stofc {

/// GELU, exact (erf) form, branchless: x * Phi(x) with the half upper tail
/// h = erfc(z) / 2 = t 2^(Q(t) - log2(e) z^2), t = 1 / (1 + z / 2), z = |x| / sqrt 2 (the form of
/// Numerical Recipes' erfcc with the 1/2 and log2(e) folded into Q, a degree-7 polynomial fitted
/// here by bench/fit_gelu_erf.py for relative error 6.4e-7 in h over z in [0, 10]; Phi = h below
/// 0, 1 - h above). Two MUFU (rcp.approx, ex2.approx); in the GEMM epilogue's SASS 9 FFMA and 3
/// FMUL per element (the degree-9 erfcc: 11 and 5), plus the select and 1 - h. Against
/// float64 GELU (the same operations emulated in numpy float32, 2001 points in [-12, 12]):
/// relative error <= 8.8e-7 on [-3, inf), <= 7.0e-6 in the far negative tail, where the float32
/// 0.5 x (1 + erf(x / sqrt 2)) form loses every digit; +inf gives +inf.
__device__ __forceinline__ float gelu_erf_fast(float x) {
    const float a = fabsf(x);
    float t;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(t) : "f"(fmaf(a, 0.35355339059327373f, 1.0f)));
    float q = -0.26495692f;
    q = fmaf(q, t, 1.0588835f);
    q = fmaf(q, t, -1.3995183f);
    q = fmaf(q, t, 0.46291375f);
    q = fmaf(q, t, -0.034854323f);
    q = fmaf(q, t, 0.56156892f);
    q = fmaf(q, t, 1.4417270f);
    q = fmaf(q, t, -2.8257647f);
    // log2(e) z^2 = a * (a * log2(e) / 2)
    const float h = t * exp2_fast(fmaf(-a, a * 0.72134752044448170f, q));
    return x * (x >= 0.0f ? 1.0f - h : h);
}

/// 16 bytes of shared memory at `addr` (16-byte aligned).
__device__ __forceinline__ uint4 lds128(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

/// d (64 x N) = A (64 x 16, smem, K-major) * B (16 x N, smem, MN-major) [+ d if accumulate].
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_tb(float (&d)[N / 8][4], u64 desc_a, u64 desc_b,
                                            int accumulate);

#define STOFC_WGMMA_SS_TB(TY, NAME)                                                               \
    template <>                                                                                   \
    __device__ __forceinline__ void wgmma_ss_tb<TY, 128>(float (&d)[16][4], u64 desc_a,          \
                                                         u64 desc_b, int accumulate) {            \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                 \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." NAME "." NAME " " STOFC_D64  \
                     ", %64, %65, p, 1, 1, 0, 1;\n}\n"                                            \
                     : STOFC_ACC8_AT(d, 0), STOFC_ACC8_AT(d, 8)                                   \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                \
    }                                                                                             \
    template <>                                                                                   \
    __device__ __forceinline__ void wgmma_ss_tb<TY, 256>(float (&d)[32][4], u64 desc_a,          \
                                                         u64 desc_b, int accumulate) {            \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                \
                     "wgmma.mma_async.sync.aligned.m64n256k16.f32." NAME "." NAME " " STOFC_D128 \
                     ", %128, %129, p, 1, 1, 0, 1;\n}\n"                                          \
                     : STOFC_ACC8_AT(d, 0), STOFC_ACC8_AT(d, 8), STOFC_ACC8_AT(d, 16),           \
                       STOFC_ACC8_AT(d, 24)                                                      \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                \
    }
STOFC_WGMMA_SS_TB(__half, "f16")
STOFC_WGMMA_SS_TB(__nv_bfloat16, "bf16")
#undef STOFC_WGMMA_SS_TB

}  // namespace stofc

#endif  // STOFC_GEMM_WS_CUH
