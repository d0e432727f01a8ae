// stofc Hopper warpgroup MMA helpers (wgmma, sm_90a only).
//
// Contract (read-only for every template that includes it):
//   * Compile with -arch=sm_90a (or compute_90a): wgmma exists only there.
//   * A warpgroup is 4 consecutive warps (128 threads); every helper below is
//     executed by all 128 threads of a warpgroup, convergent.
//   * Shared-memory operands use the 128-byte swizzle: a "panel" is 64 b16
//     columns (128 bytes) by R rows, row r at byte r * 128, its 16-byte chunk c
//     stored at chunk c ^ (r % 8) (sw128_offset); every panel starts 1024-byte
//     aligned. A wider matrix is D / 64 panels, one after the other.
//   * Accumulator layout of m64nNk16 (fp32): warp w of the warpgroup owns rows
//     16w..16w+15; d[n][0..1] = (row g, cols 8n + 2t..+1), d[n][2..3] = (row g+8,
//     same cols), g = lane >> 2, t = lane & 3: mma.sync's C layout repeated over
//     N / 8 blocks. The register A operand (four b32 of two b16) is mma.sync's A
//     fragment for the warp's 16 rows, so S's accumulators pack straight into it.
//   * Async: issue (fence, mma..., commit), then wait_group<N>() before reading
//     or writing the accumulators or the register A operand again.
#ifndef STOFC_WGMMA_CUH
#define STOFC_WGMMA_CUH

#include <stofc/mma.cuh>

namespace stofc {

/// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` inside a 128B-swizzled panel.
__device__ __forceinline__ u32 sw128_offset(int row, int chunk) {
    return static_cast<u32>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

/// Descriptor of a shared-memory operand at `addr` without swizzle (K-major B: core matrices
/// of 8 rows x 16 contiguous bytes; `lbo` = byte stride between core matrices along K, `sbo`
/// = along N); the fields every layout shares. The row-sum operand (ws ones) uses it as is.
__device__ __forceinline__ u64 plain_desc(u32 addr, u32 lbo, u32 sbo) {
    return static_cast<u64>((addr & 0x3FFFFu) >> 4) |
           (static_cast<u64>((lbo & 0x3FFFFu) >> 4) << 16) |
           (static_cast<u64>((sbo & 0x3FFFFu) >> 4) << 32);
}

/// Descriptor of a 128B-swizzled shared-memory operand at `addr` (1024-aligned panel
/// base plus a k offset). K-major (no transpose): `lbo` unused, `sbo` = 1024 (8 rows).
/// MN-major (transposed B): `lbo` = byte stride between 64-column panels along N,
/// `sbo` = 1024 (8 K rows of 128 bytes).
__device__ __forceinline__ u64 sw128_desc(u32 addr, u32 lbo, u32 sbo) {
    return plain_desc(addr, lbo, sbo) | (1ull << 62);   // layout type 1: 128-byte swizzle
}

/// Order earlier register writes (accumulators, register A) before the next wgmma.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

/// Close the group of wgmma issued since the last commit.
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/// Wait until at most N committed wgmma groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

/// Make this thread's generic-proxy shared-memory writes (st.shared, cp.async)
/// visible to the async proxy that wgmma reads operands through; then barrier.
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/// Pin `n` accumulator blocks in registers at this point (no reordering across).
template <int N>
__device__ __forceinline__ void wgmma_pin(float (&d)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
        asm volatile("" : "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3]) :: "memory");
}

/// Keep `n` register-A fragments alive (unmodified, in their registers) up to this
/// point: after the wgmma_wait that retires the GEMM reading them, so the compiler
/// cannot reuse their registers while the asynchronous GEMM still reads them.
template <int N>
__device__ __forceinline__ void wgmma_keep(u32 (&a)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
        asm volatile("" : "+r"(a[n][0]), "+r"(a[n][1]), "+r"(a[n][2]), "+r"(a[n][3]) :: "memory");
}

#define STOFC_ACC1(d, n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define STOFC_ACC8(d) \
    STOFC_ACC1(d, 0), STOFC_ACC1(d, 1), STOFC_ACC1(d, 2), STOFC_ACC1(d, 3), \
    STOFC_ACC1(d, 4), STOFC_ACC1(d, 5), STOFC_ACC1(d, 6), STOFC_ACC1(d, 7)
#define STOFC_ACC8_HI(d) \
    STOFC_ACC1(d, 8), STOFC_ACC1(d, 9), STOFC_ACC1(d, 10), STOFC_ACC1(d, 11), \
    STOFC_ACC1(d, 12), STOFC_ACC1(d, 13), STOFC_ACC1(d, 14), STOFC_ACC1(d, 15)
#define STOFC_D32 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define STOFC_D64 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

#define STOFC_ACC8_AT(d, o) \
    STOFC_ACC1(d, o + 0), STOFC_ACC1(d, o + 1), STOFC_ACC1(d, o + 2), STOFC_ACC1(d, o + 3), \
    STOFC_ACC1(d, o + 4), STOFC_ACC1(d, o + 5), STOFC_ACC1(d, o + 6), STOFC_ACC1(d, o + 7)
#define STOFC_D128 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

/// d (64 x N) = A (64 x 16, smem, K-major) * B (16 x N, smem, K-major) [+ d if accumulate],
/// N = 64 (the block kernels' softmax step).
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], u64 desc_a, u64 desc_b,
                                         int accumulate);

template <>
__device__ __forceinline__ void wgmma_ss<__half, 64>(float (&d)[8][4], u64 desc_a, u64 desc_b,
                                                     int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " STOFC_D32
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : STOFC_ACC8(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_ss<__nv_bfloat16, 64>(float (&d)[8][4], u64 desc_a,
                                                            u64 desc_b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " STOFC_D32
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : STOFC_ACC8(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/// d (64 x N) = A (64 x 16, registers) * B (16 x N, smem, K-major) [+ d if accumulate], N = 64:
/// S = Q K^T with Q's fragments held in registers (the warp-specialised kernel).
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const u32 (&a)[4], u64 desc_b,
                                         int accumulate);

template <>
__device__ __forceinline__ void wgmma_rs<__half, 64>(float (&d)[8][4], const u32 (&a)[4],
                                                     u64 desc_b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " STOFC_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : STOFC_ACC8(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 64>(float (&d)[8][4], const u32 (&a)[4],
                                                            u64 desc_b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " STOFC_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : STOFC_ACC8(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

/// d (64 x 128) = A (64 x 16: registers, or smem K-major) * B (16 x 128, smem, K-major)
/// [+ d if accumulate]: S = Q K^T of two 64-key tiles whose K panels lie back to back.
template <typename T>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[16][4], const u32 (&a)[4], u64 desc_b,
                                              int accumulate);
template <typename T>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[16][4], u64 desc_a, u64 desc_b,
                                              int accumulate);

#define STOFC_WGMMA_N128(TY, NAME)                                                              \
    template <>                                                                                 \
    __device__ __forceinline__ void wgmma_rs_n128<TY>(float (&d)[16][4], const u32 (&a)[4],    \
                                                      u64 desc_b, int accumulate) {             \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                               \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." NAME "." NAME " " STOFC_D64 \
                     ", {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                             \
                     : STOFC_ACC8(d), STOFC_ACC8_HI(d)                                         \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)); \
    }                                                                                           \
    template <>                                                                                 \
    __device__ __forceinline__ void wgmma_ss_n128<TY>(float (&d)[16][4], u64 desc_a, u64 desc_b, \
                                                      int accumulate) {                         \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                               \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." NAME "." NAME " " STOFC_D64 \
                     ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                          \
                     : STOFC_ACC8(d), STOFC_ACC8_HI(d)                                         \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate));                              \
    }
STOFC_WGMMA_N128(__half, "f16")
STOFC_WGMMA_N128(__nv_bfloat16, "bf16")
#undef STOFC_WGMMA_N128

template <typename T> struct IsHalf { static constexpr bool value = false; };
template <> struct IsHalf<__half> { static constexpr bool value = true; };

/// As wgmma_rs<T, 64> / wgmma_ss<T, 64>, into the 8 n8 blocks OFF..OFF+7 of a longer
/// accumulator array (several 64-key tiles per softmax step).
template <typename T, int OFF, int M>
__device__ __forceinline__ void wgmma_rs_at(float (&d)[M][4], const u32 (&a)[4], u64 desc_b,
                                            int accumulate) {
    static_assert(OFF + 8 <= M, "the slice must lie inside the accumulators");
    if constexpr (IsHalf<T>::value)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " STOFC_D32
                     ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                     : STOFC_ACC8_AT(d, OFF)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " STOFC_D32
                     ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                     : STOFC_ACC8_AT(d, OFF)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

template <typename T, int OFF, int M>
__device__ __forceinline__ void wgmma_ss_at(float (&d)[M][4], u64 desc_a, u64 desc_b,
                                            int accumulate) {
    static_assert(OFF + 8 <= M, "the slice must lie inside the accumulators");
    if constexpr (IsHalf<T>::value)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " STOFC_D32
                     ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : STOFC_ACC8_AT(d, OFF) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " STOFC_D32
                     ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : STOFC_ACC8_AT(d, OFF) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/// d (64 x N) += A (64 x 16, registers) * B (16 x N, smem, N-major: transposed), N = 64, 128
/// or 256 (head_dim 256: the V descriptor's lbo steps over the four 64-column panels).
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[N / 8][4], const u32 (&a)[4], u64 desc_b);

template <>
__device__ __forceinline__ void wgmma_rs_tb<__half, 64>(float (&d)[8][4], const u32 (&a)[4],
                                                        u64 desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " STOFC_D32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : STOFC_ACC8(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_rs_tb<__nv_bfloat16, 64>(float (&d)[8][4],
                                                               const u32 (&a)[4], u64 desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " STOFC_D32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : STOFC_ACC8(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_rs_tb<__half, 128>(float (&d)[16][4], const u32 (&a)[4],
                                                         u64 desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " STOFC_D64
                 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                 : STOFC_ACC8(d), STOFC_ACC8_HI(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_rs_tb<__nv_bfloat16, 128>(float (&d)[16][4],
                                                                const u32 (&a)[4], u64 desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " STOFC_D64
                 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                 : STOFC_ACC8(d), STOFC_ACC8_HI(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_rs_tb<__half, 256>(float (&d)[32][4], const u32 (&a)[4],
                                                         u64 desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 " STOFC_D128
                 ", {%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n"
                 : STOFC_ACC8_AT(d, 0), STOFC_ACC8_AT(d, 8), STOFC_ACC8_AT(d, 16),
                   STOFC_ACC8_AT(d, 24)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_rs_tb<__nv_bfloat16, 256>(float (&d)[32][4],
                                                                const u32 (&a)[4], u64 desc_b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " STOFC_D128
                 ", {%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n"
                 : STOFC_ACC8_AT(d, 0), STOFC_ACC8_AT(d, 8), STOFC_ACC8_AT(d, 16),
                   STOFC_ACC8_AT(d, 24)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

/// d (64 x 8) += A (64 x 16, registers) * B (16 x 8, smem, K-major). With B all ones every
/// column of d is the row sum of A: the ws kernel's softmax row sums of P, on the tensor
/// cores (ROWSUM_MMA) instead of ~2 FADDs per probability.
template <typename T>
__device__ __forceinline__ void wgmma_rs_n8(float (&d)[1][4], const u32 (&a)[4], u64 desc_b);

#define STOFC_RS_N8(TYPE, KIND)                                                                 \
    template <>                                                                                 \
    __device__ __forceinline__ void wgmma_rs_n8<TYPE>(float (&d)[1][4], const u32 (&a)[4],       \
                                                      u64 desc_b) {                              \
        asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32." KIND "." KIND                 \
                     " {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1, 0;\n"                   \
                     : STOFC_ACC1(d, 0)                                                         \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));                \
    }
STOFC_RS_N8(__half, "f16")
STOFC_RS_N8(__nv_bfloat16, "bf16")
#undef STOFC_RS_N8

/// d (64 x 64) += A (64 x 16, registers) * B (16 x 64, smem, N-major: transposed) and, in the
/// same m64n72k16 wgmma, s (64 x 8) += A * B's ninth n8 block: the 64 columns after B's
/// first panel, `lbo` bytes past it (desc_b's leading byte offset). With ones there, every
/// column of s is A's row sum: the ws kernel's P V and its softmax row sums in one GEMM
/// (head_dim 64).
template <typename T>
__device__ __forceinline__ void wgmma_rs_tb_sum(float (&d)[8][4], float (&s)[1][4],
                                                const u32 (&a)[4], u64 desc_b);

#define STOFC_RS_TB_SUM(TYPE, KIND)                                                             \
    template <>                                                                                 \
    __device__ __forceinline__ void wgmma_rs_tb_sum<TYPE>(float (&d)[8][4], float (&s)[1][4],   \
                                                          const u32 (&a)[4], u64 desc_b) {      \
        asm volatile("wgmma.mma_async.sync.aligned.m64n72k16.f32." KIND "." KIND " "            \
                     STOFC_D32_PLUS4 ", {%36, %37, %38, %39}, %40, 1, 1, 1, 1;\n"                 \
                     : STOFC_ACC8(d), STOFC_ACC1(s, 0)                                          \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));                \
    }
#define STOFC_D32_PLUS4 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35}"
STOFC_RS_TB_SUM(__half, "f16")
STOFC_RS_TB_SUM(__nv_bfloat16, "bf16")
#undef STOFC_RS_TB_SUM
#undef STOFC_D32_PLUS4

// STOFC_ACC1, STOFC_ACC8_AT, STOFC_D64 and STOFC_D128 stay defined: gemm_ws.cuh's wgmma
// forms take the same operand lists.
#undef STOFC_ACC8
#undef STOFC_ACC8_HI
#undef STOFC_D32

}  // namespace stofc

#endif  // STOFC_WGMMA_CUH
