// stofc Hopper warp-specialisation helpers: mbarriers, the Tensor Memory Accelerator
// (TMA), bulk copies, named barriers, the persistent work order, output rows staged
// through shared memory (stmatrix) and register reallocation (sm_90a).
//
// Contract (read-only for every template that includes it):
//   * Compile with -arch=sm_90a: setmaxnreg and wgmma need the arch-specific target;
//     the mbarrier / cp.async.bulk forms used here exist from sm_90.
//   * A TmaDesc is the 128-byte CUtensorMap the host encodes with
//     cuTensorMapEncodeTiled; kernels take it by value as a `const __grid_constant__`
//     parameter and pass its address (param space, generic) to tma_load_4d.
//   * An mbarrier lives in shared memory, 8-byte aligned; its phase parity starts at 0.
//     A "full" barrier is armed by one producer thread with arrive_expect_tx(bytes)
//     and completes when every byte of the copies issued against it has landed; an
//     "empty" barrier counts one arrival per consumer warpgroup. Waiters spin on
//     mbar_wait(bar, parity).
//   * Named barriers 0 (= __syncthreads) is not used here; callers pick ids 1..15 and
//     pass the number of participating threads (a multiple of 32).
#ifndef STOFC_WS_CUH
#define STOFC_WS_CUH

#include <stofc/attention.cuh>

namespace stofc {

/// The 128-byte tensor map (CUtensorMap) as a kernel parameter type.
struct __align__(64) TmaDesc {
    u64 words[16];
};

// ---------------------------------------------------------------- mbarriers

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}

/// Make mbarrier initialisation visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

/// Arrive once and add `bytes` to the transaction count the phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(bar), "r"(bytes) : "memory");
}

/// Arrive once (release: this thread's earlier shared-memory reads are ordered before).
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}

/// Wait until the phase with parity `parity` has completed.
#ifndef STOFC_WS_HANG_CHECK
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "STOFC_MBAR_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra STOFC_MBAR_WAIT;\n"
        "}\n" :: "r"(bar), "r"(parity) : "memory");
}
#else
// Debugging aid (define STOFC_WS_HANG_CHECK when compiling): a wait that has not
// completed after ~2^24 tries names the barrier (its shared address), the parity and the
// thread, then traps, so a protocol deadlock ends as an error instead of a hang.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    for (unsigned tries = 0;; ++tries) {
        u32 done;
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n"
            "}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        if (done) return;
        if (tries == (1u << 24)) {
            printf("stofc ws hang: block %d thread %d barrier 0x%x parity %u\n",
                   blockIdx.x, threadIdx.x, bar, parity);
            __trap();
        }
    }
}
#endif

// ---------------------------------------------------------------- TMA and bulk copies

/// Prefetch a tensor map (param space) into the descriptor cache.
__device__ __forceinline__ void tma_prefetch(const TmaDesc* desc) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<u64>(desc)) : "memory");
}

/// Load the box at coordinates (c0, c1, c2, c3) (innermost first) of a rank-4 tensor
/// map into shared memory at `dst`, completing `bytes` of `bar`'s transaction count.
/// Elements outside the tensor are zero-filled.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaDesc* desc, u32 bar, int c0, int c1,
                                            int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        :: "r"(dst), "l"(reinterpret_cast<u64>(desc)), "r"(bar), "r"(c0), "r"(c1), "r"(c2),
           "r"(c3)
        : "memory");
}

/// Copy `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory
/// to shared memory, completing `bytes` of `bar`'s transaction count.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// ---------------------------------------------------------------- named barriers

__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// ---------------------------------------------------------------- persistent work order

/// The k-th work of block `block` in a persistent grid of `grid` blocks that deals the works
/// (longest first) in waves of `grid`, snaking: position `block` of even waves, `grid - 1 -
/// block` of odd ones, so each wave's long end pairs with the next one's short end (a plain
/// deal, block + k * grid, gave block 0 the longest work of every wave). Every work
/// w < n_work is some block's exactly once; a block is done at its first index >= n_work.
__device__ __forceinline__ int ws_work_index(int k, int block, int grid) {
    return k * grid + ((k & 1) ? grid - 1 - block : block);
}

// ---------------------------------------------------------------- staged output rows

/// Bytes of one staged output row of head_dim D: 16 bytes of padding put the 8 rows of an
/// 8x8 matrix (stmatrix) and the 8 lanes of a 16-byte read phase in distinct banks.
template <int D>
constexpr int staged_row_bytes() { return 2 * D + 16; }

/// Four 8x8 b16 matrices from registers (the inverse of ldmatrix_x4): lanes 8i..8i+7 give
/// the 16-byte row addresses of matrix i; r[i] is this lane's pair (row lane/4, cols
/// 2*(lane%4)..+1) of matrix i, the layout of an mma accumulator fragment.
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

/// Write a warp's 16 rows of O (accumulator fragments of m64nDk16 wgmma: lane (g, t4)
/// holds rows g and g + 8, columns 8n + 2 t4 ..+1 of every n8 block n), divided by the
/// row sums l (quad-partial, as the softmax keeps them; 0 for a row without keys),
/// through `stage`, this warp's 16 x staged_row_bytes<D>() bytes of shared memory: the
/// global stores are then 16-byte vectors of whole 32-byte sectors (two rows of D = 128
/// per warp store) instead of 4-byte pieces of eight rows each. Row r goes to
/// ob + (row0 + r) * o_ss if row0 + r < L. Needs ob and o_ss * sizeof(T) 16-byte aligned.
/// The warp's previous use of `stage` must be over (the leading __syncwarp orders it).
template <typename T, int ND>
__device__ __forceinline__ void store_rows_staged(const float (&acc)[ND][4], const float (&l)[2],
                                                  int row0, T* ob, long long o_ss, int L,
                                                  int lane, u32 stage) {
    typedef DTypeTraits<T> DT;
    constexpr int D = ND * 8;
    constexpr int ROW = staged_row_bytes<D>();
    constexpr int CHUNKS = D / 8;                  // 16-byte chunks of a row
    static_assert(ND % 2 == 0, "stmatrix_x4 takes two n8 blocks of both row halves");
    const float l0 = quad_sum(l[0]);
    const float l1 = quad_sum(l[1]);
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f;
    const float inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    __syncwarp();
    // lane (m, r) addresses row r of matrix m = rows (m & 1) * 8.., n8 block 2 j + (m >> 1)
    const int m = lane >> 3;
    const u32 at = stage + static_cast<u32>(((m & 1) * 8 + (lane & 7)) * ROW + (m >> 1) * 16);
#pragma unroll
    for (int j = 0; j < ND / 2; ++j) {
        const int n = 2 * j;
        stmatrix_x4(at + j * 32, DT::pack(acc[n][0] * inv0, acc[n][1] * inv0),
                    DT::pack(acc[n][2] * inv1, acc[n][3] * inv1),
                    DT::pack(acc[n + 1][0] * inv0, acc[n + 1][1] * inv0),
                    DT::pack(acc[n + 1][2] * inv1, acc[n + 1][3] * inv1));
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 16 * CHUNKS / 32; ++i) {
        const int c = i * 32 + lane;
        const int r = c / CHUNKS, k = c % CHUNKS;
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(stage + static_cast<u32>(r * ROW + k * 16)));
        if (row0 + r < L) *reinterpret_cast<uint4*>(ob + (row0 + r) * o_ss + k * 8) = v;
    }
}

// ---------------------------------------------------------------- register reallocation

/// Lower this warpgroup's register limit to N (the producer gives its registers away).
template <int N>
__device__ __forceinline__ void regs_release() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}

/// Raise this warpgroup's register limit to N (the consumers take them).
template <int N>
__device__ __forceinline__ void regs_acquire() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
}

}  // namespace stofc

#endif  // STOFC_WS_CUH
