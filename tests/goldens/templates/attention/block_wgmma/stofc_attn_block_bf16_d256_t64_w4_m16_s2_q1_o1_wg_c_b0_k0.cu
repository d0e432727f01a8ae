// stofc block-wise sparse attention on Hopper warpgroup MMA (wgmma, sm_90a), generated.
//
// The walk, masks, online softmax and kernel ABI are block.cu.j2's (the CSR walk of
// one tile row, TilePlan gathering, residue permutation, key bound / key bits / bias,
// rows with no allowed key write zeros; stofc/block_tile.cuh). What differs:
// each warpgroup (4 warps, 128 threads) owns 64 query rows; Q, K and V live in
// 128-byte-swizzled shared-memory panels (stofc/wgmma.cuh) filled by cp.async;
// S = Q K^T is a chain of m64n64k16 wgmma reading both operands from shared memory,
// and O += P V takes P straight from the S accumulators in registers and V from
// shared memory as an N-major (transposed) operand. No ldmatrix, no per-fragment
// MMA issue: the tensor cores get 64x64x16 blocks per instruction.
#include <stofc/block_tile.cuh>
#include <stofc/wgmma.cuh>

using namespace stofc;

namespace {

typedef __nv_bfloat16 T;

constexpr int D = 256;
constexpr int TILE = 64;
constexpr int WARPS = 4;
constexpr int STAGES = 2;
constexpr int Q_SPLIT = 1;
constexpr int MIN_BLOCKS = 1;     // __launch_bounds__: caps registers for occupancy
constexpr bool HAS_BIAS = false;
constexpr bool HAS_KEY_BITS = false;
constexpr bool HAS_SOFTCAP = true;     // logit soft-capping (Gemma 2)

constexpr int BM = TILE / Q_SPLIT;         // query rows per block
constexpr int BN = TILE;                   // keys per tile
constexpr int NT = WARPS * 32;
constexpr int CH = D / 8;                  // 16-byte chunks per row
constexpr int PANELS = D / 64;             // 64-column swizzle panels per row
constexpr int ITN = TILE / 8;              // inner tiles per outer-tile side
constexpr int KN = 64;                     // keys per softmax step (one n64 wgmma)
constexpr int NB = KN / 8;                 // n8 blocks of S per step
constexpr int KC = D / 16;                 // k16 steps of Q K^T
constexpr int ND = D / 8;                  // n8 blocks of O
static_assert(BM == WARPS * 16 && BM % 64 == 0, "each warpgroup owns 64 rows, a warp 16");
static_assert(D % 64 == 0, "head_dim must fill 128-byte swizzle panels");
static_assert(BN % KN == 0, "the key tile is a whole number of softmax steps");
static_assert(STAGES >= 2, "the pipeline needs two stages");
static_assert(KN == 64, "a softmax step's key validity is one 64-bit word (step_key_word)");

constexpr int Q_PANEL = BM * 128;          // bytes of one Q panel
constexpr int KV_PANEL = BN * 128;         // bytes of one K (or V) panel
constexpr int Q_BYTES = PANELS * Q_PANEL;
constexpr int KV_BYTES = PANELS * KV_PANEL;
constexpr int STAGE_BYTES = 2 * KV_BYTES;  // K then V
constexpr int BITMAP_WORDS = ITN * ITN;
constexpr int KV_ITERS = (BN * CH + NT - 1) / NT;   // 16-byte chunks per thread per tile
constexpr int KV_UNROLL = KV_ITERS <= 4 ? KV_ITERS : 1;
static_assert(Q_PANEL % 1024 == 0 && KV_PANEL % 1024 == 0, "panels stay 1024-byte aligned");

/// Byte offset of 16-byte chunk c (0..CH-1) of row `row` in a matrix of `panel` bytes per panel.
__device__ __forceinline__ u32 chunk_at(int row, int c, int panel) {
    return static_cast<u32>((c >> 3) * panel) + sw128_offset(row, c & 7);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(NT, MIN_BLOCKS)
stofc_attn_block_bf16_d256_t64_w4_m16_s2_q1_o1_wg_c_b0_k0(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  T* __restrict__ o,
                  long long q_sb, long long q_ss, long long q_sh,
                  long long k_sb, long long k_ss, long long k_sh,
                  long long v_sb, long long v_ss, long long v_sh,
                  long long o_sb, long long o_ss, long long o_sh,
                  const int* __restrict__ tile_row_ptr, const int* __restrict__ tile_key,
                  const int* __restrict__ tile_part, const u64* __restrict__ bitmaps,
                  const int* __restrict__ gather_keys,
                  const int* __restrict__ q_perm, int permuted,
                  int fmt_head_stride, const int* __restrict__ row_order,
                  const int* __restrict__ kv_len, const u64* __restrict__ key_bits,
                  int key_words,
                  const T* __restrict__ bias, long long bias_sb, long long bias_sh,
                  long long bias_sq,
                  int B, int H, int L, float scale, int kv_group, float softcap) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // swizzle panels need 1024-byte alignment: the launch asks for 1024 bytes of slack
    const u32 raw = smem_addr(smem_raw);
    unsigned char* base = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    const u32 sQ = smem_addr(base);
    const u32 sKV = sQ + Q_BYTES;
    u64* sBM = reinterpret_cast<u64*>(base + Q_BYTES + STAGES * STAGE_BYTES);
    int* sKeys = reinterpret_cast<int*>(sBM + STAGES * BITMAP_WORDS);   // gathered tiles' keys

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int wg = warp >> 2;                  // this thread's warpgroup: rows 64*wg..

    // Block -> (head, batch, sub-block, tile row): heads of one batch are neighbours,
    // tile rows come longest-first from row_order.
    int idx = blockIdx.x;
    const int h = idx % H; idx /= H;
    const int b = idx % B; idx /= B;
    const int sub = idx % Q_SPLIT;
    const int r = row_order[idx / Q_SPLIT];
    const int q0 = r * TILE + sub * BM;

    const int* rp = tile_row_ptr + h * fmt_head_stride;
    const int j0 = rp[r];
    int j1 = rp[r + 1];
    const int kvl = min(kv_len[b], L);
    j1 = trim_walk(tile_key, j0, j1, kvl, TILE);          // tiles past the keys (gathered: < 0)

    const T* qb = q + b * q_sb + h * q_sh;
    const int hkv = h / kv_group;                    // grouped-query attention: K/V head
    const T* kb = k + b * k_sb + hkv * k_sh;
    const T* vb = v + b * v_sb + hkv * v_sh;
    const u64* kbits = key_bits + (HAS_KEY_BITS ? b * key_words : 0);

    const float sl = scale * STOFC_LOG2E;            // scores -> log2 units
    const float inv_scale = 1.0f / scale;            // bias in raw score units
    const float cap = softcap / scale;               // soft-capping in raw score units
    const float inv_cap = scale / softcap;
    auto bias_row = [&](int qr) {                    // the bias row of query row qr
        return bias + b * bias_sb + h * bias_sh + min(max(qr, 0), L - 1) * bias_sq;
    };

    // ---- prologue: Q, then the first STAGES-1 tiles
#pragma unroll
    for (int it = 0; it < (BM * CH + NT - 1) / NT; ++it) {
        const int i = tid + it * NT;
        if ((BM * CH) % NT != 0 && i >= BM * CH) break;
        const int row = i / CH, c = i % CH;
        const int qr = permuted ? q_perm[q0 + row] : q0 + row;   // real query row
        const bool ok = qr >= 0 && qr < L;
        cp_async_16(sQ + chunk_at(row, c, Q_PANEL), ok ? qb + qr * q_ss + c * 8 : q, ok);
    }
    auto load_tile = [&](int j, int stage) {
        const int kbase = tile_key[j];
        const u32 sK = sKV + stage * STAGE_BYTES;
        const u32 sV = sK + KV_BYTES;
        const int* gk = gather_keys + static_cast<long long>(kbase < 0 ? -kbase - 1 : 0) * TILE;
#pragma unroll KV_UNROLL
        for (int it = 0; it < KV_ITERS; ++it) {
            const int i = tid + it * NT;
            if ((BN * CH) % NT != 0 && i >= BN * CH) break;
            const int row = i / CH, c = i % CH;
            const int key = kbase >= 0 ? kbase + row : gk[row];   // gathered: by key index
            const bool ok = key >= 0 && key < kvl;
            const u32 off = chunk_at(row, c, KV_PANEL);
            cp_async_16(sK + off, ok ? kb + key * k_ss + c * 8 : k, ok);
            cp_async_16(sV + off, ok ? vb + key * v_ss + c * 8 : v, ok);
        }
        if (kbase < 0)
            for (int i = tid; i < TILE / 4; i += NT)
                cp_async_16(smem_addr(sKeys + stage * TILE + 4 * i), gk + 4 * i, true);
        const int p = tile_part[j];
        if (p >= 0) {
            const u64* src = bitmaps + static_cast<long long>(p) * BITMAP_WORDS;
            u64* dst = sBM + stage * BITMAP_WORDS;
            for (int i = tid; i < BITMAP_WORDS / 2; i += NT)
                cp_async_16(smem_addr(dst + 2 * i), src + 2 * i, true);
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (j0 + s < j1) load_tile(j0 + s, s);
        cp_async_commit();
    }

    float acc[ND][4];
    float row_m[2] = {STOFC_NEG_INF, STOFC_NEG_INF};
    float row_l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;

    // local row (inside the outer tile) of this warp's first row; real query rows
    const int lrow0 = sub * BM + warp * 16;
    const int p0 = q0 + warp * 16 + g;
    const int rq0 = permuted ? q_perm[p0] : p0;
    const int rq1 = permuted ? q_perm[p0 + 8] : p0 + 8;
    const T* br0 = HAS_BIAS ? bias_row(rq0) : nullptr;
    const T* br1 = HAS_BIAS ? bias_row(rq1) : nullptr;
    const u32 q_wg = sQ + wg * 64 * 128;     // this warpgroup's 64 rows of every Q panel

    for (int j = j0; j < j1; ++j) {
        const int it = j - j0;
        cp_async_wait<STAGES - 2>();
        fence_proxy_async_smem();              // cp.async data -> wgmma's async proxy
        __syncthreads();
        {
            const int jn = j + STAGES - 1;
            if (jn < j1) load_tile(jn, (it + STAGES - 1) % STAGES);
            cp_async_commit();
        }
        const int stage = it % STAGES;
        const u32 sK = sKV + stage * STAGE_BYTES;
        const u32 sV = sK + KV_BYTES;
        const int kbase0 = tile_key[j];
        const bool gathered = kbase0 < 0;
        const int part = tile_part[j];
        const int* sk = sKeys + stage * TILE;
        const u32* bm32 = part >= 0
            ? reinterpret_cast<const u32*>(sBM + stage * BITMAP_WORDS) + (g >> 2) : nullptr;
#pragma unroll
        for (int kh = 0; kh < BN / KN; ++kh) {
            const int kbase = kbase0 + kh * KN;     // first key of this step

            // ---- S = Q K^T: KC wgmma k16 steps, both operands K-major in smem
            float s[NB][4];
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
            wgmma_fence();
#pragma unroll
            for (int kc = 0; kc < KC; ++kc) {
                const u32 koff = (kc & 3) * 32;
                const u64 da = sw128_desc(q_wg + (kc >> 2) * Q_PANEL + koff, 16, 1024);
                const u64 db = sw128_desc(sK + kh * KN * 128 + (kc >> 2) * KV_PANEL + koff,
                                          16, 1024);
                wgmma_ss<T, KN>(s, da, db, kc > 0 ? 1 : 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_pin(s);

            // ---- masks, then the online softmax step with P packed into A registers
            // contiguous steps: the 64 keys' validity as one word (all-ones: no key test)
            const u64 kword = gathered ? 0ull : step_key_word<HAS_KEY_BITS>(kbase, kvl, kbits);
            const bool need_keys = gathered || kword != ~0ull;
            if (HAS_SOFTCAP) soft_cap_step<NB>(s, cap, inv_cap);
            if (part >= 0 || need_keys || HAS_BIAS) {
                const StepKeys keys{kbase, gathered ? sk + kh * KN : nullptr, kvl, kbits, kword};
                mask_step<T, NB, ITN, HAS_BIAS, HAS_KEY_BITS>(
                    s, bm32, kh * NB, lrow0 >> 3, need_keys, keys, br0, br1, inv_scale, g, t4);
            }
            u32 pf[NB / 2][4];
            softmax_step<T, NB, ND>(s, acc, row_m, row_l, pf, sl);

            // ---- O += P V: P from registers, V N-major (transposed) in smem
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < NB / 2; ++kk) {
                const u64 dv = sw128_desc(sV + (kh * KN + kk * 16) * 128, KV_PANEL, 1024);
                wgmma_rs_tb<T, D>(acc, pf[kk], dv);
            }
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_pin(acc);
        }
    }
    cp_async_wait_all();

    // ---- epilogue: normalise, rows with no allowed key write 0
    store_rows<T, ND>(acc, row_l, rq0, rq1, o + b * o_sb + h * o_sh, o_ss, L, t4);
}
