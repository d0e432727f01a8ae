// stofc row-wise sparse attention, generated.
//
// A warp owns ROWS_PER_WARP query rows (one after another); a block of WARPS warps
// covers WARPS * ROWS_PER_WARP consecutive rows inside one mask tile row. For its
// row q the warp walks the load CSR of q's tile row; in each tile it reads q's
// row of the 8x8 bitmaps (TILE bits) 32 columns at a time, ballots the allowed,
// in-range keys into a per-warp queue in shared memory, and consumes the queue
// in chunks of 32 keys: lane j computes the score of key j (the whole K row,
// 16-byte loads, q pre-scaled in registers), the warp takes the max by
// shuffles, then every lane accumulates its own dims of P V. No block barrier:
// only __syncwarp. Online softmax in log2 units; rows without keys write 0.
#include <stofc/attention.cuh>

using namespace stofc;

namespace {

typedef __half T;
typedef DTypeTraits<T> DT;

constexpr int D = 32;
constexpr int TILE = 64;
constexpr int WARPS = 4;
constexpr int ROWS_PER_WARP = 1;
constexpr bool HAS_BIAS = false;
constexpr bool HAS_KEY_BITS = false;
constexpr bool HAS_SOFTCAP = false;     // logit soft-capping (Gemma 2)
constexpr bool Q_IN_REGS = true;       // else the scaled q row sits in smem

constexpr int NT = WARPS * 32;
constexpr int ROWS = WARPS * ROWS_PER_WARP;   // rows per block
constexpr int SUBS = TILE / ROWS;             // blocks per tile row
constexpr int ITN = TILE / 8;
constexpr int CH = D / 8;                     // 16-byte chunks of a K row
constexpr int PAIRS = D / 2;                  // dim pairs of a V row
constexpr int PPL = (PAIRS + 31) / 32;        // pairs per lane
constexpr int QCAP = 64;                      // queue: < 32 left + 32 added
static_assert(TILE % ROWS == 0, "a block's rows must sit inside one tile row");
static_assert(D % 8 == 0, "head_dim must be a multiple of 8");

}  // namespace

extern "C" __global__ void __launch_bounds__(NT)
stofc_attn_row_f16_d32_t64_w4_m1_s1_q1_o1_b0_k0(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  T* __restrict__ o,
                  long long q_sb, long long q_ss, long long q_sh,
                  long long k_sb, long long k_ss, long long k_sh,
                  long long v_sb, long long v_ss, long long v_sh,
                  long long o_sb, long long o_ss, long long o_sh,
                  const int* __restrict__ load_row_ptr, const int* __restrict__ load_col_idx,
                  const int* __restrict__ load_part_idx, const u64* __restrict__ part_bitmaps,
                  const int* __restrict__ gather_keys,   // unused: row-wise walks the format
                  const int* __restrict__ q_perm, int permuted,  // unused (block-wise only)
                  int fmt_head_stride, const int* __restrict__ row_order,
                  const int* __restrict__ kv_len, const u64* __restrict__ key_bits,
                  int key_words,
                  const T* __restrict__ bias, long long bias_sb, long long bias_sh,
                  long long bias_sq,
                  int B, int H, int L, float scale, int kv_group, float softcap) {
    __shared__ int queue_all[WARPS][QCAP];
    __shared__ __align__(16) float q_smem[Q_IN_REGS ? 1 : WARPS][Q_IN_REGS ? 4 : D];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    int* queue = queue_all[warp];

    int idx = blockIdx.x;
    const int h = idx % H; idx /= H;
    const int b = idx % B; idx /= B;
    const int sub = idx % SUBS;
    const int r = row_order[idx / SUBS];

    const int* rp = load_row_ptr + h * fmt_head_stride;
    const int j0 = rp[r];
    const int j1 = rp[r + 1];
    const int kvl = min(kv_len[b], L);

    const T* qb = q + b * q_sb + h * q_sh;
    const int hkv = h / kv_group;                    // grouped-query attention: K/V head
    const T* kb = k + b * k_sb + hkv * k_sh;
    const T* vb = v + b * v_sb + hkv * v_sh;
    T* ob = o + b * o_sb + h * o_sh;
    const u64* kbits = key_bits + (HAS_KEY_BITS ? b * key_words : 0);
    const float sl = scale * STOFC_LOG2E;
    const float cap = softcap * STOFC_LOG2E;         // soft-capping in log2 units
    const float inv_cap = 1.0f / cap;

    for (int ri = 0; ri < ROWS_PER_WARP; ++ri) {
        const int lr = sub * ROWS + warp * ROWS_PER_WARP + ri;   // row inside the tile
        const int qr = r * TILE + lr;
        if (qr >= L) break;
        const int ir = lr >> 3, rr = lr & 7;

        // q row, pre-scaled to log2 units: fully in every lane's registers, or (large
        // head_dim) in this warp's smem row, read by broadcast
        float qv[Q_IN_REGS ? D : 1];
        float* qs = q_smem[Q_IN_REGS ? 0 : warp];
        if (Q_IN_REGS) {
#pragma unroll
            for (int c = 0; c < CH; ++c) {
                const uint4 raw = *reinterpret_cast<const uint4*>(qb + qr * q_ss + c * 8);
                const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 f = DT::to_float2(w[e]);
                    qv[Q_IN_REGS ? c * 8 + 2 * e : 0] = f.x * sl;
                    qv[Q_IN_REGS ? c * 8 + 2 * e + 1 : 0] = f.y * sl;
                }
            }
        } else {
            __syncwarp();
            for (int i = lane; i < D / 2; i += 32) {
                const float2 f = DT::to_float2(*reinterpret_cast<const u32*>(qb + qr * q_ss + 2 * i));
                qs[2 * i] = f.x * sl;
                qs[2 * i + 1] = f.y * sl;
            }
            __syncwarp();
        }
        auto qval = [&](int d) { return Q_IN_REGS ? qv[Q_IN_REGS ? d : 0] : qs[d]; };
        const T* brow = HAS_BIAS ? bias + b * bias_sb + h * bias_sh + qr * bias_sq : bias;

        float m = STOFC_NEG_INF, l_part = 0.0f;
        float acc[PPL][2];
#pragma unroll
        for (int p = 0; p < PPL; ++p) acc[p][0] = acc[p][1] = 0.0f;

        // consume n (1..32) queued keys
        auto consume = [&](int n) {
            const int key = lane < n ? queue[lane] : 0;
            float s = STOFC_NEG_INF;
            if (lane < n) {
                const T* kr = kb + key * k_ss;
                float dot = 0.0f;
#pragma unroll
                for (int c = 0; c < CH; ++c) {
                    const uint4 raw = *reinterpret_cast<const uint4*>(kr + c * 8);
                    const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float2 f = DT::to_float2(w[e]);
                        dot = fmaf(qval(c * 8 + 2 * e), f.x, dot);
                        dot = fmaf(qval(c * 8 + 2 * e + 1), f.y, dot);
                    }
                }
                s = HAS_SOFTCAP ? soft_cap(dot, cap, inv_cap) : dot;
                if (HAS_BIAS) s += DT::to_float(brow[key]) * STOFC_LOG2E;
            }
            const float m_new = fmaxf(m, warp_max(s));
            const float base = safe_max(m_new);
            const float alpha = exp2_fast(m - base);
            const float p = exp2_fast(s - base);
            m = m_new;
            l_part = l_part * alpha + p;
#pragma unroll
            for (int pp = 0; pp < PPL; ++pp) {
                acc[pp][0] *= alpha;
                acc[pp][1] *= alpha;
            }
#pragma unroll 4
            for (int jj = 0; jj < n; ++jj) {
                const float pj = __shfl_sync(0xffffffffu, p, jj);
                const int kj = __shfl_sync(0xffffffffu, key, jj);
                const T* vr = vb + kj * v_ss;
#pragma unroll
                for (int pp = 0; pp < PPL; ++pp) {
                    const int pair = lane + 32 * pp;
                    if (PAIRS % 32 == 0 || pair < PAIRS) {
                        const float2 f = DT::to_float2(*reinterpret_cast<const u32*>(vr + 2 * pair));
                        acc[pp][0] = fmaf(pj, f.x, acc[pp][0]);
                        acc[pp][1] = fmaf(pj, f.y, acc[pp][1]);
                    }
                }
            }
        };

        int count = 0;
        for (int j = j0; j < j1; ++j) {
            const int kbase = load_col_idx[j] * TILE;
            if (kbase >= kvl) break;                       // columns are ascending
            const int part = load_part_idx[j];
            const u64* bm = part >= 0 ? part_bitmaps + static_cast<long long>(part) * ITN * ITN
                                      : part_bitmaps;
#pragma unroll
            for (int cb = 0; cb < TILE / 32; ++cb) {
                const int col = cb * 32 + lane;
                const int key = kbase + col;
                bool ok = key < kvl;
                if (part >= 0) ok = ok && ((bm[(col >> 3) * ITN + ir] >> (rr * 8 + (col & 7))) & 1ull);
                if (HAS_KEY_BITS) ok = ok && ((kbits[key >> 6] >> (key & 63)) & 1ull);
                const u32 ballot = __ballot_sync(0xffffffffu, ok);
                if (ok) queue[count + __popc(ballot & ((1u << lane) - 1u))] = key;
                count += __popc(ballot);
                __syncwarp();
                if (count >= 32) {
                    consume(32);
                    __syncwarp();
                    if (lane < count - 32) queue[lane] = queue[32 + lane];
                    count -= 32;
                    __syncwarp();
                }
            }
        }
        if (count > 0) {
            consume(count);
            __syncwarp();
        }

        const float l = warp_sum(l_part);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        T* orow = ob + qr * o_ss;
#pragma unroll
        for (int pp = 0; pp < PPL; ++pp) {
            const int pair = lane + 32 * pp;
            if (PAIRS % 32 == 0 || pair < PAIRS)
                *reinterpret_cast<u32*>(orow + 2 * pair) = DT::pack(acc[pp][0] * inv, acc[pp][1] * inv);
        }
    }
}
