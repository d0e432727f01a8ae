// stofc block-wise sparse attention (FlashAttention-2 structure), generated.
//
// One thread block owns BM = TILE / Q_SPLIT query rows of one mask tile row, for
// one (batch, head). Its WARPS warps split those rows (WARP_M = 16 * MT rows
// each), so no cross-warp softmax reduction exists. Q lives in registers; the
// block walks ONLY the load CSR of its tile row (full + part outer tiles, key
// tile = TILE, consumed in steps of KN = 64 keys so S stays in registers); K, V
// (and the part tile's 8x8 bitmaps) of each tile stream in
// with cp.async through a STAGES-deep shared-memory ring. The walk list is a
// TilePlan (stofc.kernels.attention.gather): tile_key >= 0 is a contiguous tile
// of keys tile_key.., < 0 a gathered tile whose K/V rows come by key index
// (gather_keys), which packs sparse-column part tiles together. With `permuted`,
// the walk list lives in a residue-permuted space (stofc.kernels.attention.permute):
// Q rows are read and O rows written through q_perm, every tile is gathered. Full tiles evaluate
// no mask; part tiles test the bitmap words at fragment granularity; a step whose
// 64 keys are not all valid (runtime key length and key-padding bits, one word per
// step), gathered tiles and the bias take the masked path. Online softmax in log2
// units with the scale folded into one FFMA.
// Rows with no allowed key write zeros; a fully masked tile never makes NaN.
#include <stofc/block_tile.cuh>

using namespace stofc;

namespace {

typedef __half T;
typedef DTypeTraits<T> DT;

constexpr int D = 256;
constexpr int TILE = 64;
constexpr int MT = 16 / 16;
constexpr int WARPS = 4;
constexpr int STAGES = 2;
constexpr int Q_SPLIT = 1;
constexpr int MIN_BLOCKS = 1;     // __launch_bounds__: caps registers for occupancy
constexpr bool HAS_BIAS = false;
constexpr bool HAS_KEY_BITS = true;
constexpr bool HAS_SOFTCAP = true;     // logit soft-capping (Gemma 2)
constexpr bool Q_IN_REGS = false;       // else Q's fragments are re-read from smem

constexpr int BM = TILE / Q_SPLIT;         // query rows per block
constexpr int BN = TILE;                   // keys per tile
constexpr int WARP_M = 16 * MT;
constexpr int NT = WARPS * 32;
constexpr int SROW = D + 8;                // padded smem row: conflict-free ldmatrix
constexpr int CH = D / 8;                  // 16-byte chunks per row
constexpr int ITN = TILE / 8;              // inner tiles per outer-tile side
constexpr int KN = BN < 64 ? BN : 64;      // keys per softmax step (bounds S registers)
constexpr int NB = KN / 8;                 // n8 blocks of S per step
constexpr int KC = D / 16;                 // k16 chunks of Q K^T
constexpr int ND = D / 8;                  // n8 blocks of O
static_assert(BM == WARPS * WARP_M, "warps must cover the block's rows");
static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
static_assert(STAGES >= 2, "the pipeline needs two stages");
static_assert(KN == 64, "a softmax step's key validity is one 64-bit word (step_key_word)");

constexpr int Q_ELEMS = BM * SROW;
constexpr int KV_ELEMS = BN * SROW;
constexpr int STAGE_ELEMS = 2 * KV_ELEMS;
constexpr int BITMAP_WORDS = ITN * ITN;
constexpr int KV_ITERS = (BN * CH + NT - 1) / NT;   // 16-byte chunks per thread per tile
constexpr int KV_UNROLL = KV_ITERS <= 4 ? KV_ITERS : 1;  // unrolled addresses cost registers

}  // namespace

extern "C" __global__ void __launch_bounds__(NT, MIN_BLOCKS)
stofc_attn_block_f16_d256_t64_w4_m16_s2_q1_o1_c_b0_k1(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
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
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sKV = sQ + Q_ELEMS;
    u64* sBM = reinterpret_cast<u64*>(sKV + STAGES * STAGE_ELEMS);
    int* sKeys = reinterpret_cast<int*>(sBM + STAGES * BITMAP_WORDS);   // gathered tiles' keys

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int t4 = lane & 3;

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
        cp_async_16(smem_addr(sQ + row * SROW + c * 8), ok ? qb + qr * q_ss + c * 8 : q, ok);
    }
    auto load_tile = [&](int j, int stage) {
        const int kbase = tile_key[j];
        T* sK = sKV + stage * STAGE_ELEMS;
        T* sV = sK + KV_ELEMS;
        if (kbase >= 0) {
#pragma unroll KV_UNROLL
            for (int it = 0; it < KV_ITERS; ++it) {
                const int i = tid + it * NT;
                if ((BN * CH) % NT != 0 && i >= BN * CH) break;
                const int row = i / CH, c = i % CH;
                const int key = kbase + row;
                const bool ok = key < kvl;
                cp_async_16(smem_addr(sK + row * SROW + c * 8), ok ? kb + key * k_ss + c * 8 : k, ok);
                cp_async_16(smem_addr(sV + row * SROW + c * 8), ok ? vb + key * v_ss + c * 8 : v, ok);
            }
        } else {                                   // gathered tile: K/V rows by key index
            const int* gk = gather_keys + static_cast<long long>(-kbase - 1) * TILE;
#pragma unroll KV_UNROLL
            for (int it = 0; it < KV_ITERS; ++it) {
                const int i = tid + it * NT;
                if ((BN * CH) % NT != 0 && i >= BN * CH) break;
                const int row = i / CH, c = i % CH;
                const int key = gk[row];
                const bool ok = key >= 0 && key < kvl;
                cp_async_16(smem_addr(sK + row * SROW + c * 8), ok ? kb + key * k_ss + c * 8 : k, ok);
                cp_async_16(smem_addr(sV + row * SROW + c * 8), ok ? vb + key * v_ss + c * 8 : v, ok);
            }
            for (int i = tid; i < TILE / 4; i += NT)
                cp_async_16(smem_addr(sKeys + stage * TILE + 4 * i), gk + 4 * i, true);
        }
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

    float acc[MT][ND][4];
    float row_m[MT][2], row_l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < ND; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][n][e] = 0.0f;
        row_m[mt][0] = row_m[mt][1] = STOFC_NEG_INF;
        row_l[mt][0] = row_l[mt][1] = 0.0f;
    }

    cp_async_wait<STAGES - 2>();
    __syncthreads();
    // Q's A fragments: kept in registers (Q_IN_REGS), else read again from smem at each
    // k16 chunk (head_dim 256: the output accumulators need the registers)
    auto load_q = [&](u32 (&f)[4], int mt, int kc) {
        const int row = warp * WARP_M + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int col = kc * 16 + (lane >> 4) * 8;
        ldmatrix_x4(f, smem_addr(sQ + row * SROW + col));
    };
    u32 qf[MT][Q_IN_REGS ? KC : 1][4];
    if (Q_IN_REGS) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kc = 0; kc < (Q_IN_REGS ? KC : 1); ++kc) load_q(qf[mt][kc], mt, kc);
    }

    // local row (inside the outer tile) of this thread's first fragment row
    const int lrow0 = sub * BM + warp * WARP_M;
    // real query rows of this thread's fragment rows (residue permutation, or identity)
    int rq[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int p0 = q0 + warp * WARP_M + mt * 16 + g;
        rq[mt][0] = permuted ? q_perm[p0] : p0;
        rq[mt][1] = permuted ? q_perm[p0 + 8] : p0 + 8;
    }

    for (int j = j0; j < j1; ++j) {
        const int it = j - j0;
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            const int jn = j + STAGES - 1;
            if (jn < j1) load_tile(jn, (it + STAGES - 1) % STAGES);
            cp_async_commit();
        }
        const int stage = it % STAGES;
        const T* sK = sKV + stage * STAGE_ELEMS;
        const T* sV = sK + KV_ELEMS;
        const int kbase0 = tile_key[j];
        const bool gathered = kbase0 < 0;
        const int part = tile_part[j];
        const int* sk = sKeys + stage * TILE;
#pragma unroll
        for (int kh = 0; kh < BN / KN; ++kh) {
        const int kbase = kbase0 + kh * KN;     // first key of this step
        const T* sKh = sK + kh * KN * SROW;
        const T* sVh = sV + kh * KN * SROW;

        // ---- S = Q K^T
        float s[MT][NB][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
            if (!Q_IN_REGS) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) load_q(qf[mt][0], mt, kc);
            }
#pragma unroll
            for (int n2 = 0; n2 < NB / 2; ++n2) {
                u32 kf[4];
                const int key = n2 * 16 + (lane >> 4) * 8 + (lane & 7);
                const int col = kc * 16 + ((lane >> 3) & 1) * 8;
                ldmatrix_x4(kf, smem_addr(sKh + key * SROW + col));
                const u32 b0[2] = {kf[0], kf[1]};
                const u32 b1[2] = {kf[2], kf[3]};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    DT::mma(s[mt][2 * n2], qf[mt][Q_IN_REGS ? kc : 0], b0);
                    DT::mma(s[mt][2 * n2 + 1], qf[mt][Q_IN_REGS ? kc : 0], b1);
                }
            }
        }

        // ---- masks (part-tile bitmaps, key bound / key bits, bias), then the online
        // softmax step with P packed straight into A fragments (stofc/block_tile.cuh)
        // contiguous steps: the 64 keys' validity as one word (all-ones: no key test)
        const u64 kword = gathered ? 0ull : step_key_word<HAS_KEY_BITS>(kbase, kvl, kbits);
        const bool need_keys = gathered || kword != ~0ull;
        const StepKeys keys{kbase, gathered ? sk + kh * KN : nullptr, kvl, kbits, kword};
        const u32* bm32 = part >= 0
            ? reinterpret_cast<const u32*>(sBM + stage * BITMAP_WORDS) + (g >> 2) : nullptr;
        u32 pf[MT][NB / 2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if (HAS_SOFTCAP) soft_cap_step<NB>(s[mt], cap, inv_cap);
            if (part >= 0 || need_keys || HAS_BIAS) {
                const T* br0 = HAS_BIAS ? bias_row(rq[mt][0]) : nullptr;
                const T* br1 = HAS_BIAS ? bias_row(rq[mt][1]) : nullptr;
                mask_step<T, NB, ITN, HAS_BIAS, HAS_KEY_BITS>(
                    s[mt], bm32, kh * NB, (lrow0 + mt * 16) >> 3, need_keys, keys, br0, br1,
                    inv_scale, g, t4);
            }
            softmax_step<T, NB, ND>(s[mt], acc[mt], row_m[mt], row_l[mt], pf[mt], sl);
        }

        // ---- O += P V
#pragma unroll
        for (int kk = 0; kk < NB / 2; ++kk) {
#pragma unroll
            for (int n2 = 0; n2 < ND / 2; ++n2) {
                u32 vf[4];
                const int key = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
                const int col = n2 * 16 + (lane >> 4) * 8;
                ldmatrix_x4_trans(vf, smem_addr(sVh + key * SROW + col));
                const u32 b0[2] = {vf[0], vf[1]};
                const u32 b1[2] = {vf[2], vf[3]};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    DT::mma(acc[mt][2 * n2], pf[mt][kk], b0);
                    DT::mma(acc[mt][2 * n2 + 1], pf[mt][kk], b1);
                }
            }
        }
        }  // kh
    }
    cp_async_wait_all();

    // ---- epilogue: normalise, rows with no allowed key write 0
    T* ob = o + b * o_sb + h * o_sh;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        store_rows<T, ND>(acc[mt], row_l[mt], rq[mt][0], rq[mt][1], ob, o_ss, L, t4);
}
