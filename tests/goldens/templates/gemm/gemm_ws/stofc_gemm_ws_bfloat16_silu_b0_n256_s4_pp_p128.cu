// stofc Hopper GEMM with a fused epilogue (sm_90a): out[M, N] = act(x[M, K] @ w[K, N] + bias[N])
// (__nv_bfloat16 in and out, fp32 accumulate); bias=0 act=4.
// Warp-specialised and persistent: warpgroup 0 (one thread) loads 64 x 64 tiles of x and
// 64 x 64 panels of w with the TMA into a 4-stage ring; warpgroups 1 and 2 compute.
// COOP=0: 1, both share each stage over a 128 x 256 block tile (64 rows each);
// 0, they take the block's 64 x 256 tiles in turns (ping-pong), so one's epilogue runs
// beside the other's wgmma. The epilogue adds the bias and applies the activation in fp32,
// then stages 128 columns at a time through shared memory for 16-byte stores.
// Needs K % 8 == 0, N % 8 == 0 and 16-byte aligned x, w and out (the TMA's and the stores'
// alignment); x rows past M and k past K read as zeros, columns past N are not written.
#include <stofc/ws.cuh>
#include <stofc/wgmma.cuh>
#include <stofc/gemm_ws.cuh>
#include <stofc/gemm_common.cuh>
#include <stofc/pdl.cuh>

namespace {
using namespace stofc;
typedef __nv_bfloat16 T;
typedef DTypeTraits<T> DT;
constexpr int BN = 256, STAGES = 4, HAS_BIAS = 0, ACT = 4;
constexpr int COOP = 0, PASS = 128;
// COOP 0 (ping-pong): a block tile is one warpgroup's 64 rows; COOP 1 (cooperative): both
// warpgroups share each stage's w panels over a 128-row block tile (half the w bytes per
// FLOP), and their epilogues run together
constexpr int BM = COOP ? 128 : 64, BK = 64, CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1);
constexpr int NB = BN / 8;                        // n8 accumulator blocks of a tile row
constexpr int PANEL = 64 * 128;                   // bytes of a 64 x 64 swizzled panel
constexpr int A_PANELS = BM / 64, B_PANELS = BN / 64;
constexpr int SLOT = PANEL * (A_PANELS + B_PANELS);   // one ring stage: x rows, then w's panels
constexpr int PASSES = BN / PASS;
constexpr int ROW_BYTES = PASS * 2 + 16;          // staged row, padded (conflict-free)
constexpr int WARP_STAGE = 16 * ROW_BYTES;        // a warp's 16 rows
constexpr int OFF_STAGE = STAGES * SLOT;
constexpr int OFF_BAR = OFF_STAGE + 4 * CONSUMERS * WARP_STAGE;
constexpr int SMEM_END = OFF_BAR + 2 * STAGES * 8;
static_assert(BN % PASS == 0 && (BN == 128 || BN == 256), "tile width");
static_assert(SMEM_END + 1024 <= 199744, "the launch's dynamic shared memory holds "
              "every region and the 1024 bytes of alignment slack");

struct RingPos {
    int slot;
    u32 par;
    __device__ __forceinline__ void next() {
        if (++slot == STAGES) { slot = 0; par ^= 1u; }
    }
    __device__ __forceinline__ void skip(int n) {   // n further positions
        const int s = slot + n;
        slot = s % STAGES;
        par ^= static_cast<u32>((s / STAGES) & 1);
    }
};
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1) stofc_gemm_ws_bfloat16_silu_b0_n256_s4_pp_p128(
    const __grid_constant__ TmaDesc x_map, const __grid_constant__ TmaDesc w_map,
    const T* __restrict__ bias, T* __restrict__ out, int M, int N, int K) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw = smem_addr(smem_raw);
    const u32 base = (raw + 1023u) & ~1023u;       // swizzled panels: 1024-byte aligned
    const u32 bar_full = base + OFF_BAR, bar_empty = bar_full + STAGES * 8;
    const int tid = threadIdx.x;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int n_tiles = (N + BN - 1) / BN;
    const int tiles = ((M + BM - 1) / BM) * n_tiles;
    const int kt = (K + BK - 1) / BK;

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_full + 8 * s, 1);
            mbar_init(bar_empty + 8 * s, COOP ? 8 : 4);   // the consuming warps
        }
        mbar_fence_init();
    }
    __syncthreads();
    pdl_wait();                                    // x from the kernel before (pdl.cuh)
    pdl_launch_dependents();

    if (wg == 0) {                                 // producer
        regs_release<40>();
        if (tid == 0) {
            tma_prefetch(&x_map);
            tma_prefetch(&w_map);
            RingPos p{0, 0u};
            for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
                const int m0 = (tile / n_tiles) * BM, n0 = (tile % n_tiles) * BN;
                for (int kc = 0; kc < kt; ++kc, p.next()) {
                    const u32 full = bar_full + 8 * p.slot, slot = base + p.slot * SLOT;
                    mbar_wait(bar_empty + 8 * p.slot, p.par ^ 1u);
                    mbar_arrive_expect_tx(full, SLOT);
#pragma unroll
                    for (int a = 0; a < A_PANELS; ++a)
                        tma_load_4d(slot + PANEL * a, &x_map, full, kc * BK, m0 + 64 * a, 0, 0);
#pragma unroll
                    for (int b = 0; b < B_PANELS; ++b)
                        tma_load_4d(slot + PANEL * (A_PANELS + b), &w_map, full, n0 + 64 * b,
                                    kc * BK, 0, 0);
                }
            }
        }
        return;
    }

    regs_acquire<232>();
    const int w = wg - 1;                          // ping-pong: this consumer takes the block's tiles w, w + 2, ...
    const int lane = tid & 31, warp = (tid >> 5) & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const u32 stage = base + OFF_STAGE + (w * 4 + warp) * WARP_STAGE;
    RingPos p{0, 0u};
    if (!COOP && w == 1) p.skip(kt);
    auto act = [](float v) {                       // GELU-erf branchless (gemm_ws.cuh)
        if constexpr (ACT == 1) return gelu_erf_fast(v);
        else return stofc_ds::activate<ACT>(v);
    };
    float acc[NB][4];
    const int first = blockIdx.x + (COOP ? 0 : w * gridDim.x), step = (COOP ? 1 : 2) * gridDim.x;
    for (int tile = first; tile < tiles; tile += step) {
        const int m0 = (tile / n_tiles) * BM, n0 = (tile % n_tiles) * BN;
#pragma unroll
        for (int n = 0; n < NB; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
        // Turns: a warpgroup starts waiting on the ring only once the other has issued its
        // whole tile (every earlier stage filled), so a full barrier's parity never aliases
        // a fill two phases back; the mainloops alternate and each epilogue runs beside the
        // other warpgroup's wgmma.
        if (!COOP && tile != static_cast<int>(blockIdx.x)) named_bar_sync(1 + w, 256);
        RingPos prev = p;
        for (int kc = 0; kc < kt; ++kc) {
            mbar_wait(bar_full + 8 * p.slot, p.par);
            const u32 sa = base + p.slot * SLOT;
            const u64 da = sw128_desc(sa + (COOP ? w * PANEL : 0), 16, 1024);
            const u64 db = sw128_desc(sa + A_PANELS * PANEL, PANEL, 1024);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk)
                wgmma_ss_tb<T, BN>(acc, da + ((kk * 32) >> 4), db + ((kk * 2048) >> 4), 1);
            wgmma_commit();
            if (kc > 0) {                          // the previous stage's wgmma have retired
                wgmma_wait<1>();
                __syncwarp();
                if (lane == 0) mbar_arrive(bar_empty + 8 * prev.slot);
            }
            prev = p;
            p.next();
        }
        if (!COOP && tile + static_cast<int>(gridDim.x) < tiles) named_bar_arrive(2 - w, 256);  // its turn
        wgmma_wait<0>();
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_empty + 8 * prev.slot);
        if (!COOP) p.skip(kt);                     // the other warpgroup's next tile

        // epilogue: bias and activation in fp32, then PASS columns at a time through this
        // warp's staging rows (stmatrix), stored as whole 16-byte pieces of each row
        const int row0 = m0 + (COOP ? w * 64 : 0) + warp * 16;
#pragma unroll
        for (int ps = 0; ps < PASSES; ++ps) {
            __syncwarp();
            const int m = lane >> 3;
            const u32 at = stage + static_cast<u32>(((m & 1) * 8 + (lane & 7)) * ROW_BYTES + (m >> 1) * 16);
#pragma unroll
            for (int j = 0; j < PASS / 16; ++j) {
                const int n = ps * (PASS / 8) + 2 * j;
                float v[2][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int col = n0 + 8 * (n + h) + 2 * t4;
                    float b0 = 0.0f, b1 = 0.0f;
                    if (HAS_BIAS && col < N) {
                        const float2 bb = DT::to_float2(*reinterpret_cast<const u32*>(bias + col));
                        b0 = bb.x;
                        b1 = bb.y;
                    }
                    v[h][0] = act(acc[n + h][0] + b0);
                    v[h][1] = act(acc[n + h][1] + b1);
                    v[h][2] = act(acc[n + h][2] + b0);
                    v[h][3] = act(acc[n + h][3] + b1);
                }
                stmatrix_x4(at + j * 32, DT::pack(v[0][0], v[0][1]), DT::pack(v[0][2], v[0][3]),
                            DT::pack(v[1][0], v[1][1]), DT::pack(v[1][2], v[1][3]));
            }
            __syncwarp();
            constexpr int CHUNKS = PASS / 8;       // 16-byte pieces of a staged row
#pragma unroll
            for (int i = 0; i < 16 * CHUNKS / 32; ++i) {
                const int c = i * 32 + lane;
                const int r = c / CHUNKS, k = c % CHUNKS;
                const int row = row0 + r, col = n0 + ps * PASS + k * 8;
                const uint4 val = lds128(stage + static_cast<u32>(r * ROW_BYTES + k * 16));
                if (row < M && col < N)
                    *reinterpret_cast<uint4*>(out + static_cast<size_t>(row) * N + col) = val;
            }
        }
    }
}
