// stofc block-wise attention: per-step score masking, online softmax and the row
// write, shared by the mma.sync (block.cu.j2) and wgmma (block_wgmma.cu.j2) kernels.
//
// Contract: every function works on ONE thread's fragments of one m16 row pair
// (rows g and g+8 of a warp's 16 rows; g = lane >> 2, t4 = lane & 3) over one
// softmax step of NB n8 blocks of keys; s[n][0..1] are (row g, keys 8n + 2*t4..+1),
// s[n][2..3] the same keys of row g+8 (mma.sync's C layout, which is also wgmma's
// accumulator layout). Scores are raw (unscaled) Q.K; the softmax works in log2
// units with the scale folded into one FFMA (sl = scale * log2 e). A row with no
// allowed key keeps max -inf and sum 0 and writes zeros; no NaN is ever formed.
#ifndef STOFC_BLOCK_TILE_CUH
#define STOFC_BLOCK_TILE_CUH

#include <stofc/attention.cuh>

namespace stofc {

/// Where the keys of one softmax step come from and which of them a row may see.
struct StepKeys {
    int kbase;            // first key of the step (contiguous tiles)
    const int* gathered;  // the step's key indices (gathered tiles), else nullptr
    int kvl;              // runtime key length of the sequence
    const u64* key_bits;  // packed key-validity bits of the sequence (HAS_KEY_BITS)
    u64 word;             // contiguous steps: step_key_word (bit i: key kbase + i allowed)
};

/// Which of the 64 keys kbase..kbase+63 of a contiguous step a row may see: bit i
/// is set when key kbase + i is below the runtime key length `kvl` and (HAS_KEY_BITS)
/// its key-padding bit is set. `kbase` is a multiple of 64 (contiguous tiles start
/// at tile boundaries), so the padding bits are one word, read once per step
/// instead of once per score; all-ones means the step needs no key test at all.
template <bool HAS_KEY_BITS>
__device__ __forceinline__ u64 step_key_word(int kbase, int kvl, const u64* key_bits) {
    if (kvl <= kbase) return 0ull;
    u64 w = kvl - kbase >= 64 ? ~0ull : (1ull << (kvl - kbase)) - 1ull;
    if (HAS_KEY_BITS) w &= key_bits[kbase >> 6];
    return w;
}

/// Bits 0, 2, 4, ... of x packed into the low 32 bits (a parallel bit extract).
__device__ __forceinline__ u64 even_bits(u64 x) {
    x &= 0x5555555555555555ull;
    x = (x | (x >> 1)) & 0x3333333333333333ull;
    x = (x | (x >> 2)) & 0x0F0F0F0F0F0F0F0Full;
    x = (x | (x >> 4)) & 0x00FF00FF00FF00FFull;
    x = (x | (x >> 8)) & 0x0000FFFF0000FFFFull;
    return (x | (x >> 16)) & 0x00000000FFFFFFFFull;
}

/// step_key_word of a residue walk (PERIOD P = 1, 2 or 4; stofc/kernels/attention/residue.py):
/// `kbase` and `kvl` count the residue's keys (real key P a + r), `key_words` bounds the
/// padding words of the batch. The 64 keys' padding bits are every P-th bit from r of the P
/// words from (P kbase) / 64 (kbase is a multiple of 64, so they start a word). P = 1 is
/// step_key_word.
template <bool HAS_KEY_BITS, int P>
__device__ __forceinline__ u64 residue_key_word(int kbase, int kvl, const u64* key_bits, int key_words,
                                                int r) {
    static_assert(P == 1 || P == 2 || P == 4, "residue periods 1, 2 and 4");
    if (P == 1) return step_key_word<HAS_KEY_BITS>(kbase, kvl, key_bits);
    if (kvl <= kbase) return 0ull;
    u64 w = kvl - kbase >= 64 ? ~0ull : (1ull << (kvl - kbase)) - 1ull;
    if (HAS_KEY_BITS) {
        const int first = (kbase * P) >> 6;
        u64 bits = 0ull;
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const u64 word = first + i < key_words ? key_bits[first + i] >> r : 0ull;
            const u64 packed = P == 2 ? even_bits(word) : even_bits(even_bits(word));
            bits |= packed << (i * (64 / P));
        }
        w &= bits;
    }
    return w;
}

/// Soft-cap every raw score of the step (c = softcap / scale, inv_c = 1 / c); before
/// mask_step, which then overwrites disallowed scores with -inf.
template <int NB>
__device__ __forceinline__ void soft_cap_step(float (&s)[NB][4], float c, float inv_c) {
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = soft_cap(s[n][e], c, inv_c);
}

/// Set disallowed scores of the step to -inf and add the bias to allowed ones; the step's
/// NB n8 blocks are s[OFF .. OFF + NB - 1] (several 64-key tiles per softmax step).
///
/// `bm32` points at the 32-bit half (g >> 2) of the part tile's first 8x8 word
/// (nullptr: a full tile, no bitmap); word (n0 + n) * ITN + ir holds this row
/// pair's block of key block n; `need_keys` asks for the key tests (gathered
/// steps, or a contiguous step whose key word is not all-ones). NB * 8 <= 64. `br0` / `br1` are the
/// bias rows of rows g / g+8 (HAS_BIAS), added in raw score units; the bias of key k is
/// br[KS * k] (KS > 1: a residue walk, whose key k is real key KS k + r, r folded into br).
template <typename T, int NB, int ITN, bool HAS_BIAS, bool HAS_KEY_BITS, int M = NB, int OFF = 0,
          int KS = 1>
__device__ __forceinline__ void mask_step(float (&s_all)[M][4], const u32* bm32, int n0, int ir,
                                          bool need_keys, const StepKeys& keys, const T* br0,
                                          const T* br1, float inv_scale, int g, int t4) {
    static_assert(OFF + NB <= M, "the step's keys must lie inside the score array");
    float (&s)[M][4] = s_all;
    typedef DTypeTraits<T> DT;
    const int sh = 8 * (g & 3) + 2 * t4;
#pragma unroll
    for (int n = 0; n < NB; ++n) {
        u32 keep_hi = 3u, keep_lo = 3u;
        if (bm32 != nullptr) {
            const int w = (n0 + n) * ITN + ir;
            keep_hi = (bm32[2 * w] >> sh) & 3u;
            keep_lo = (bm32[2 * w + 2] >> sh) & 3u;
        }
        int key0 = keys.kbase + n * 8 + 2 * t4;
        int key1 = key0 + 1;
        if (need_keys) {
            u32 kmask;
            if (keys.gathered != nullptr) {        // keys by index: test each one
                key0 = keys.gathered[n * 8 + 2 * t4];
                key1 = keys.gathered[n * 8 + 2 * t4 + 1];
                kmask = (static_cast<unsigned>(key0) < static_cast<unsigned>(keys.kvl) ? 1u : 0u) |
                        (static_cast<unsigned>(key1) < static_cast<unsigned>(keys.kvl) ? 2u : 0u);
                if (HAS_KEY_BITS) {
                    if (kmask & 1u) kmask &= ~1u | key_bit(keys.key_bits, key0);
                    if (kmask & 2u) kmask &= ~2u | (key_bit(keys.key_bits, key1) << 1);
                }
            } else {                               // contiguous: the step's key word
                kmask = static_cast<u32>(keys.word >> (n * 8 + 2 * t4)) & 3u;
            }
            keep_hi &= kmask;
            keep_lo &= kmask;
        }
        if (HAS_BIAS) {
            if (keep_hi & 1) s[OFF + n][0] += DT::to_float(br0[KS * key0]) * inv_scale;
            if (keep_hi & 2) s[OFF + n][1] += DT::to_float(br0[KS * key1]) * inv_scale;
            if (keep_lo & 1) s[OFF + n][2] += DT::to_float(br1[KS * key0]) * inv_scale;
            if (keep_lo & 2) s[OFF + n][3] += DT::to_float(br1[KS * key1]) * inv_scale;
        }
        s[OFF + n][0] = (keep_hi & 1u) ? s[OFF + n][0] : STOFC_NEG_INF;
        s[OFF + n][1] = (keep_hi & 2u) ? s[OFF + n][1] : STOFC_NEG_INF;
        s[OFF + n][2] = (keep_lo & 1u) ? s[OFF + n][2] : STOFC_NEG_INF;
        s[OFF + n][3] = (keep_lo & 2u) ? s[OFF + n][3] : STOFC_NEG_INF;
    }
}

/// The key mask of a contiguous step (`word`: step_key_word, bit i = key kbase + i) in
/// mask_step_frag's fragment order: bits 4 n + e set where key 8 n + 2 t4 + e % 2 may be seen.
template <int NB>
__device__ __forceinline__ u32 frag_key_mask(u64 word, int t4) {
    const u64 mine = word >> (2 * t4);
    u32 m = 0u;
#pragma unroll
    for (int n = 0; n < NB; ++n) m |= (static_cast<u32>(mine >> (8 * n)) & 3u) * 5u << (4 * n);
    return m;
}

/// mask_step for the warp-specialised kernel, whose part tiles come in fragment order: `frag`
/// holds this thread's 32 bits of a 64-key tile, bit 4 n + e for score s[OFF + n][e] (rows g /
/// g+8 and keys 8 n + 2 t4 + e % 2: stofc/kernels/attention/ws_plan.py fragment_bitmaps), ~0u
/// for a full tile. One shared-memory load per tile replaces two per n8 block, the key test
/// (`need_keys`: a contiguous step whose key word is not all-ones; no gathered keys) is folded
/// into `frag` once, and every score's test reads one constant bit.
template <typename T, int NB, bool HAS_BIAS, bool HAS_KEY_BITS, int M = NB, int OFF = 0, int KS = 1>
__device__ __forceinline__ void mask_step_frag(float (&s)[M][4], u32 frag, bool need_keys,
                                               const StepKeys& keys, const T* br0, const T* br1,
                                               float inv_scale, int t4) {
    static_assert(OFF + NB <= M, "the step's keys must lie inside the score array");
    static_assert(NB <= 8, "32 bits: at most 64 keys per call");
    typedef DTypeTraits<T> DT;
    if (need_keys) frag &= frag_key_mask<NB>(keys.word, t4);
#pragma unroll
    for (int n = 0; n < NB; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const bool keep = (frag >> (4 * n + e)) & 1u;
            if (HAS_BIAS && keep) {
                const T* br = e < 2 ? br0 : br1;
                s[OFF + n][e] += DT::to_float(br[KS * (keys.kbase + 8 * n + 2 * t4 + (e & 1))]) * inv_scale;
            }
            s[OFF + n][e] = keep ? s[OFF + n][e] : STOFC_NEG_INF;
        }
    }
}

/// The probabilities of one online-softmax step, in place: update the running max
/// `m` and sum `l` (per row of the pair, this thread's partial sum), overwrite s
/// with P = exp2(s * sl - max), and return in `alpha` the factor the output
/// accumulated so far must be rescaled by (rescale_rows) before P.V is added.
template <int NB>
__device__ __forceinline__ void softmax_exp(float (&s)[NB][4], float (&m)[2], float (&l)[2],
                                            float sl, float (&alpha)[2]) {
    // pairwise (tree) reductions: log2(NB) dependent steps instead of NB
    float r0[NB], r1[NB];
#pragma unroll
    for (int n = 0; n < NB; ++n) {
        r0[n] = fmaxf(s[n][0], s[n][1]);
        r1[n] = fmaxf(s[n][2], s[n][3]);
    }
#pragma unroll
    for (int w = 1; w < NB; w *= 2)
#pragma unroll
        for (int n = 0; n + w < NB; n += 2 * w) {
            r0[n] = fmaxf(r0[n], r0[n + w]);
            r1[n] = fmaxf(r1[n], r1[n + w]);
        }
    float mx0 = r0[0], mx1 = r1[0];
    mx0 = fmaxf(m[0], quad_max(mx0) * sl);   // sl > 0: max commutes with the scale
    mx1 = fmaxf(m[1], quad_max(mx1) * sl);
    const float base0 = safe_max(mx0), base1 = safe_max(mx1);
    alpha[0] = exp2_fast(m[0] - base0);
    alpha[1] = exp2_fast(m[1] - base1);
    m[0] = mx0;
    m[1] = mx1;
#pragma unroll
    for (int n = 0; n < NB; ++n) {
        s[n][0] = exp2_fast(fmaf(s[n][0], sl, -base0));
        s[n][1] = exp2_fast(fmaf(s[n][1], sl, -base0));
        s[n][2] = exp2_fast(fmaf(s[n][2], sl, -base1));
        s[n][3] = exp2_fast(fmaf(s[n][3], sl, -base1));
        r0[n] = s[n][0] + s[n][1];
        r1[n] = s[n][2] + s[n][3];
    }
#pragma unroll
    for (int w = 1; w < NB; w *= 2)
#pragma unroll
        for (int n = 0; n + w < NB; n += 2 * w) {
            r0[n] += r0[n + w];
            r1[n] += r1[n + w];
        }
    l[0] = l[0] * alpha[0] + r0[0];
    l[1] = l[1] * alpha[1] + r1[0];
}

/// softmax_exp with a lazy running max (FlashAttention-4's rescaling rule): a row's max
/// moves only when the step's max exceeds it by more than LAZY_MAX_SLACK (log2 units),
/// so after the first tiles of a row its output needs no rescaling at most steps. The
/// probabilities are then at most 2^LAZY_MAX_SLACK (exact in fp16/bf16, whose relative
/// precision does not depend on the magnitude), and O / l is the same function. Returns
/// whether any row of this thread changed its max (alpha != 1): rescale only then.
constexpr float LAZY_MAX_SLACK = 8.0f;

template <int NB>
__device__ __forceinline__ bool softmax_exp_lazy(float (&s)[NB][4], float (&m)[2], float (&l)[2],
                                                 float sl, float (&alpha)[2]) {
    float r0[NB], r1[NB];
#pragma unroll
    for (int n = 0; n < NB; ++n) {
        r0[n] = fmaxf(s[n][0], s[n][1]);
        r1[n] = fmaxf(s[n][2], s[n][3]);
    }
#pragma unroll
    for (int w = 1; w < NB; w *= 2)
#pragma unroll
        for (int n = 0; n + w < NB; n += 2 * w) {
            r0[n] = fmaxf(r0[n], r0[n + w]);
            r1[n] = fmaxf(r1[n], r1[n + w]);
        }
    const float mx0 = quad_max(r0[0]) * sl, mx1 = quad_max(r1[0]) * sl;   // sl > 0
    const bool up0 = mx0 > m[0] + LAZY_MAX_SLACK, up1 = mx1 > m[1] + LAZY_MAX_SLACK;
    const float m0 = up0 ? mx0 : m[0], m1 = up1 ? mx1 : m[1];
    alpha[0] = up0 ? exp2_fast(m[0] - m0) : 1.0f;        // m[0] = -inf: exp2(-inf) = 0
    alpha[1] = up1 ? exp2_fast(m[1] - m1) : 1.0f;
    m[0] = m0;
    m[1] = m1;
    const float base0 = safe_max(m0), base1 = safe_max(m1);
#pragma unroll
    for (int n = 0; n < NB; ++n) {
        s[n][0] = exp2_fast(fmaf(s[n][0], sl, -base0));
        s[n][1] = exp2_fast(fmaf(s[n][1], sl, -base0));
        s[n][2] = exp2_fast(fmaf(s[n][2], sl, -base1));
        s[n][3] = exp2_fast(fmaf(s[n][3], sl, -base1));
        r0[n] = s[n][0] + s[n][1];
        r1[n] = s[n][2] + s[n][3];
    }
#pragma unroll
    for (int w = 1; w < NB; w *= 2)
#pragma unroll
        for (int n = 0; n + w < NB; n += 2 * w) {
            r0[n] += r0[n + w];
            r1[n] += r1[n + w];
        }
    l[0] = l[0] * alpha[0] + r0[0];
    l[1] = l[1] * alpha[1] + r1[0];
    return up0 || up1;
}

/// Pack the step's probabilities into `pf`, the A operand of P.V (k16 chunk kk =
/// n8 blocks 2kk, 2kk+1).
template <typename T, int NB>
__device__ __forceinline__ void pack_probs(const float (&p)[NB][4], u32 (&pf)[NB / 2][4]) {
    typedef DTypeTraits<T> DT;
#pragma unroll
    for (int n = 0; n < NB; ++n) {
        pf[n >> 1][(n & 1) * 2 + 0] = DT::pack(p[n][0], p[n][1]);
        pf[n >> 1][(n & 1) * 2 + 1] = DT::pack(p[n][2], p[n][3]);
    }
}

/// Rescale the ND n8 blocks of the row pair's output accumulators by `alpha`.
template <int ND>
__device__ __forceinline__ void rescale_rows(float (&acc)[ND][4], const float (&alpha)[2]) {
#pragma unroll
    for (int n = 0; n < ND; ++n) {
        acc[n][0] *= alpha[0];
        acc[n][1] *= alpha[0];
        acc[n][2] *= alpha[1];
        acc[n][3] *= alpha[1];
    }
}

/// One whole online-softmax step: softmax_exp, pack_probs, then rescale_rows of `acc`.
template <typename T, int NB, int ND>
__device__ __forceinline__ void softmax_step(float (&s)[NB][4], float (&acc)[ND][4],
                                             float (&m)[2], float (&l)[2],
                                             u32 (&pf)[NB / 2][4], float sl) {
    float alpha[2];
    softmax_exp<NB>(s, m, l, sl, alpha);
    pack_probs<T, NB>(s, pf);
    rescale_rows<ND>(acc, alpha);
}

/// Normalise the row pair's output by its softmax sums and store it: row g to
/// query row `qr0`, row g+8 to `qr1` (rows outside [0, L) are not written; a row
/// whose sum is 0 writes zeros).
template <typename T, int ND>
__device__ __forceinline__ void store_rows(const float (&acc)[ND][4], const float (&l)[2],
                                           int qr0, int qr1, T* ob, long long o_ss, int L,
                                           int t4) {
    typedef DTypeTraits<T> DT;
    const float l0 = quad_sum(l[0]);
    const float l1 = quad_sum(l[1]);
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f;
    const float inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
    for (int n = 0; n < ND; ++n) {
        const int col = n * 8 + 2 * t4;
        if (qr0 >= 0 && qr0 < L)
            *reinterpret_cast<u32*>(ob + qr0 * o_ss + col) =
                DT::pack(acc[n][0] * inv0, acc[n][1] * inv0);
        if (qr1 >= 0 && qr1 < L)
            *reinterpret_cast<u32*>(ob + qr1 * o_ss + col) =
                DT::pack(acc[n][2] * inv1, acc[n][3] * inv1);
    }
}

}  // namespace stofc

#endif  // STOFC_BLOCK_TILE_CUH
